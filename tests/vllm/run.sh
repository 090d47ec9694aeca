#!/usr/bin/env bash
# kvferry with real vLLM: installs everything it needs, then runs the Python package's own
# checks (ruff, pytest) and the two-region proof (tests/vllm/two_region.py) against real vLLM
# processes (CPU build) and real daemons. This is what .ci/run calls.
#
#   tests/vllm/run.sh              # everything (~5 min on 2 cores after the first install)
#   KVFERRY_VLLM_VENV=DIR ...      # venv location (default <repo>/.venv-vllm)
#   KVFERRY_VLLM_WORK=DIR ...      # scratch dir (default: a fresh mktemp dir)
#   KVFERRY_VLLM_BIN_DIR=DIR ...   # use kvferry + kvferry-nixl-engine from DIR instead of building
#                                    (they must be built with features nixl and fault-injection)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"

venv="$(bash tests/vllm/install.sh)"
py="$venv/bin/python"
# NIXL runtime environment for the daemons (and vLLM's NIXL agent).
# shellcheck disable=SC1091
PYTHON="$py" source deploy/install-nixl.sh >/dev/null

work="${KVFERRY_VLLM_WORK:-$(mktemp -d /tmp/kvferry-vllm.XXXXXX)}"
if [ -z "${KVFERRY_VLLM_WORK:-}" ]; then
    # A scratch dir of our own: on exit keep the logs and the JSON, drop the binaries and the
    # generated models (~300 MB a run).
    trap 'rm -rf "$work/bin" "$work/models" "$work"/tiny-llama-*' EXIT
fi
mkdir -p "$work/bin"
if [ -n "${KVFERRY_VLLM_BIN_DIR:-}" ]; then
    target="$KVFERRY_VLLM_BIN_DIR"
else
    # fault-injection: the proof corrupts chunks on purpose (daemon A's `[faults]`).
    echo "== building kvferry (features nixl, fault-injection) and kvferry-nixl-engine" >&2
    cargo build -q -p kvferry -p kvferry-pool-nixl --features kvferry/nixl,kvferry/fault-injection --bins
    target="${CARGO_TARGET_DIR:-$repo/target}/debug"
fi
# Private copies: a shared target dir may be rebuilt from another checkout meanwhile.
cp "$target/kvferry" "$target/kvferry-nixl-engine" "$work/bin/"

echo "== python: ruff + pytest" >&2
(cd python && "$venv/bin/ruff" check . ../tests/vllm && "$venv/bin/ruff" format --check . ../tests/vllm)
# Bounded, with faulthandler: a hang (in a test, or at the interpreter's exit after the
# summary: a CI run once timed out that way) dies with every thread's Python stack printed
# (SIGABRT), in minutes rather than at CI's limit. faulthandler_timeout (pyproject) does the
# same for one test that runs too long.
KVFERRY_BIN_DIR="$work/bin" timeout -k 10 -s ABRT "${KVFERRY_PYTEST_TIMEOUT_S:-600}" \
    "$py" -X faulthandler -m pytest -q -p no:cacheprovider python/tests

echo "== two regions, real vLLM" >&2
timeout -k 10 -s ABRT "${KVFERRY_TWO_REGION_TIMEOUT_S:-1800}" \
    "$py" -X faulthandler tests/vllm/two_region.py --bin-dir "$work/bin" --work "$work" --json "$work/two_region.json"
echo "tests/vllm/run.sh: ok (details in $work)" >&2
