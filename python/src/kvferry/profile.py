"""A measured prefill profile from an engine's own steps:
``seconds(c, n) = fixed + linear * n + attention * (n*c + n*(n+1)/2)`` for ``n`` new tokens
after ``c`` cached ones (the daemon's `PrefillProfile`), fitted by least squares over a window
of recent (c, n, seconds) samples, and the engine's queue for `LoadReport`.

The fixed term is what every step costs whatever its tokens (the engine's loop, scheduling,
kernel launches). Fitted without it, a short step's fixed cost is read as a per-token cost: on
vLLM's CPU build a 16-token step took 10-65 ms and a 1,280-token one 0.25-0.48 s, and the
linear term reported from such a mix moved between 0.05 and 0.5 ms/token from run to run
(`bench/results/bench-vllm-2026-12-07/`).
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
    fixed_s: float = 0.0


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
        """The fit, or None without samples: least squares of ``seconds`` on (1, n, pairs)
        with every term non-negative and the linear one positive. Each subset of the terms
        (always with the linear one) is solved from its normal equations; the feasible
        solution with the smallest squared error wins, so a fixed or attention term the
        samples do not support is 0 rather than negative. One pass over the window gathers
        the sums every subset needs."""
        with self._lock:
            s = list(self._samples)
        if not s:
            return None
        # Columns (1, n, pairs) scaled to unit size, for the conditioning of the sums.
        scale = [1.0, max(n for n, _, _ in s), max(max(p for _, p, _ in s), 1e-300)]
        g = [[0.0] * 3 for _ in range(3)]
        b = [0.0] * 3
        yy = 0.0
        for n, p, t in s:
            x = (1.0, n / scale[1], p / scale[2])
            for i in range(3):
                b[i] += x[i] * t
                for j in range(3):
                    g[i][j] += x[i] * x[j]
            yy += t * t
        best: tuple[float, list[float]] | None = None
        for terms in ((0, 1, 2), (1, 2), (0, 1), (1,)):
            if len(s) < len(terms):
                continue
            coef = _solve([[g[i][j] for j in terms] for i in terms], [b[i] for i in terms])
            if coef is None:
                continue
            full = [0.0, 0.0, 0.0]
            for j, c in zip(terms, coef, strict=True):
                full[j] = c
            if not (full[1] > 0 and full[0] >= 0 and full[2] >= 0):
                continue
            # |y - X c|^2 = y'y - 2 c'X'y + c'X'X c
            err = yy - 2 * sum(full[i] * b[i] for i in range(3))
            err += sum(full[i] * g[i][j] * full[j] for i in range(3) for j in range(3))
            if best is None or err < best[0] - 1e-12 * max(yy, 1e-300):
                best = (err, full)
        if best is None:
            # Every subset infeasible (a negative slope through the samples): the mean cost
            # per token, as before the fixed term existed.
            return Fit(
                linear_s_per_token=sum(t for _, _, t in s) / sum(n for n, _, _ in s),
                attention_s_per_pair=0.0,
                samples=len(s),
            )
        f, a, c = (best[1][i] / scale[i] for i in range(3))
        return Fit(linear_s_per_token=a, attention_s_per_pair=c, samples=len(s), fixed_s=f)


def _solve(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Solves the square system ``a x = y`` (Gaussian elimination with partial pivoting);
    None when it is singular."""
    k = len(y)
    m = [row[:] + [v] for row, v in zip(a, y, strict=True)]
    top = max(1.0, max(abs(m[i][i]) for i in range(k)))
    for c in range(k):
        piv = max(range(c, k), key=lambda i: abs(m[i][c]))
        if abs(m[piv][c]) < 1e-12 * top:
            return None
        m[c], m[piv] = m[piv], m[c]
        for i in range(k):
            if i != c:
                f = m[i][c] / m[c][c]
                m[i] = [u - f * v for u, v in zip(m[i], m[c], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]
