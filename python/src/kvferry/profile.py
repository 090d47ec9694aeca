"""A measured prefill profile from an engine's own steps:
``seconds(c, n) = linear * n + attention * (n*c + n*(n+1)/2)`` for ``n`` new tokens after
``c`` cached ones (the daemon's `PrefillProfile`), fitted by least squares over a window of
recent (c, n, seconds) samples, and the engine's queue for `LoadReport`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    linear_s_per_token: float
    attention_s_per_pair: float
    samples: int


def pairs(c: int, n: int) -> float:
    """Attention pairs of ``n`` new tokens after ``c`` cached ones."""
    return n * c + n * (n + 1) / 2


class ProfileFit:
    """Thread-safe window of step samples and their least-squares fit (non-negative)."""

    def __init__(self, window: int = 256, min_tokens: int = 16, skip_first: int = 0) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.min_tokens = min_tokens
        # An engine's first steps include one-off warm-up (allocations, kernel selection).
        self._skip = skip_first

    def add(self, cached: int, new: int, seconds: float) -> None:
        """One step that prefilled ``new`` tokens after ``cached`` in ``seconds`` (steps with
        fewer than ``min_tokens`` are decode-dominated and skipped)."""
        if new < self.min_tokens or not seconds > 0:
            return
        with self._lock:
            self._samples.append((float(new), pairs(cached, new), seconds))

    def add_sums(self, new: int, attention_pairs: float, seconds: float) -> None:
        """One step of several requests: total new tokens, total attention pairs, seconds."""
        if new < self.min_tokens or not seconds > 0:
            return
        with self._lock:
            if self._skip > 0:
                self._skip -= 1
                return
            self._samples.append((float(new), float(attention_pairs), seconds))

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)

    def fit(self) -> Fit | None:
        """The fit, or None without samples. Solves the 2x2 normal equations; a negative
        attention term is clamped to 0 and the linear term refitted alone."""
        with self._lock:
            s = list(self._samples)
        if not s:
            return None
        sxx = sum(n * n for n, _, _ in s)
        sxy = sum(n * p for n, p, _ in s)
        syy = sum(p * p for _, p, _ in s)
        sxt = sum(n * t for n, _, t in s)
        syt = sum(p * t for _, p, t in s)
        det = sxx * syy - sxy * sxy
        a = b = -1.0
        if len(s) >= 2 and det > 1e-12 * max(1.0, sxx * syy):
            a = (sxt * syy - syt * sxy) / det
            b = (syt * sxx - sxt * sxy) / det
        if not (a > 0 and b >= 0):
            a, b = sxt / sxx, 0.0
        return Fit(linear_s_per_token=a, attention_s_per_pair=b, samples=len(s))
