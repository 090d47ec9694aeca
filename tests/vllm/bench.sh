#!/usr/bin/env bash
# Measures migrated-vs-recompute TTFT, Load GiB/s and the connector's per-step overhead with
# real vLLM; writes bench/results/vllm-migration.md. Run on an otherwise idle host.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
venv="$(bash tests/vllm/install.sh)"
# shellcheck disable=SC1091
PYTHON="$venv/bin/python" source deploy/install-nixl.sh >/dev/null
work="${KVFERRY_VLLM_WORK:-$(mktemp -d /tmp/kvferry-vllm-bench.XXXXXX)}"
mkdir -p "$work/bin"
cargo build -q -p kvferry -p kvferry-pool-nixl --bins
target="${CARGO_TARGET_DIR:-$repo/target}/debug"
cp "$target/kvferry" "$target/kvferry-nixl-engine" "$work/bin/"
"$venv/bin/python" tests/vllm/bench.py --bin-dir "$work/bin" --work "$work" --out bench/results/vllm-migration.md
