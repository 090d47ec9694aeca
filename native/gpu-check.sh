#!/usr/bin/env bash
# gpu-check.sh: device check of the CUDA memory backend (crate kvferry-pool-cuda).
#
# Builds with --features cuda, runs the CUDA tests (the conformance suite in-process with both
# copy paths and over real CUDA IPC with a child engine process, plus the IPC/cancellation
# tests) with their output, then the daemon's RegisterPool with a real CUDA IPC pool
# (`cargo test -p kvferry-daemon --features cuda --test cuda_register -- --nocapture`, built
# ahead as a binary like the others), then the bench printing gather/scatter GiB/s for
# 64 x 2 MiB blocks (and 4096 x 32 KiB) next to a plain device<->host cuMemcpy of the same
# bytes, measured in the same run. Results go to $OUT when it is set (cuda-tests.log,
# cuda_bench.txt, cuda_bench.jsonl, gpu-check.log).
#
# Usage (from the repository root):
#   native/gpu-check.sh                  build here with cargo, then run
#   native/gpu-check.sh --prepare DIR    only build (no GPU needed) and copy the binaries to DIR
#   native/gpu-check.sh --run DIR        only run binaries prepared in DIR (a GPU machine
#                                        without cargo or without network for crates.io)
#
# A machine with a GPU but no Rust toolchain: on the build machine
#   echo /.gpu-bin/ >> .git/info/exclude; native/gpu-check.sh --prepare .gpu-bin
# then on the GPU machine (with .gpu-bin carried along)
#   native/gpu-check.sh --run .gpu-bin
#
# Exit status: non-zero when a build or test fails, or when a GPU is visible (nvidia-smi -L)
# and a test still reported "SKIPPED: no CUDA driver" (the check must not pass vacuously).
set -euo pipefail

cd "$(dirname "$0")/.."
mode=all
dir=""
case "${1:-}" in
  --prepare) mode=prepare; dir="${2:?--prepare needs a directory}" ;;
  --run) mode=run; dir="${2:?--run needs a directory}" ;;
  "") ;;
  *) echo "usage: $0 [--prepare DIR | --run DIR]" >&2; exit 2 ;;
esac

out="${OUT:-}"
log() {
  echo "gpu-check: $*"
  if [[ -n "$out" ]]; then echo "gpu-check: $*" >>"$out/gpu-check.log"; fi
}

build() {
  local dest="$1"
  mkdir -p "$dest"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
  # Line tables are not needed on the device, and they keep the carried binaries large.
  export CARGO_PROFILE_RELEASE_DEBUG=false
  log "building kvferry-pool-cuda --features cuda (release) into $CARGO_TARGET_DIR"
  local json
  json="$(cargo test -p kvferry-pool-cuda --features cuda --release --no-run --message-format=json)"
  cargo build -p kvferry-pool-cuda --features cuda --release --example cuda_bench
  # One executable per test target: the unit tests (lib) and tests/cuda.rs.
  local lib_bin cuda_bin
  lib_bin="$(grep -o '"name":"kvferry_pool_cuda","src_path":"[^"]*src/lib.rs"[^}]*}[^}]*"executable":"[^"]*"' <<<"$json" \
    | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n1 || true)"
  cuda_bin="$(grep -o '"name":"cuda","src_path":"[^"]*tests/cuda.rs"[^}]*}[^}]*"executable":"[^"]*"' <<<"$json" \
    | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n1 || true)"
  if [[ -z "$lib_bin" || -z "$cuda_bin" ]]; then
    # Fallback: the newest matching files in deps/.
    lib_bin="$(ls -t "$CARGO_TARGET_DIR"/release/deps/kvferry_pool_cuda-* | grep -v '\.d$' | head -n1)"
    cuda_bin="$(ls -t "$CARGO_TARGET_DIR"/release/deps/cuda-* | grep -v '\.d$' | head -n1)"
  fi
  cp "$lib_bin" "$dest/unit-tests"
  cp "$cuda_bin" "$dest/cuda-tests"
  cp "$CARGO_TARGET_DIR/release/examples/cuda_bench" "$dest/cuda_bench"
  # The daemon's RegisterPool over CUDA IPC (crates/daemon/tests/cuda_register.rs): a daemon
  # in process, the engine a child process. Stripped: it links the whole daemon.
  log "building kvferry-daemon --features cuda --test cuda_register (release)"
  json="$(cargo test -p kvferry-daemon --features cuda --release --no-run --test cuda_register --message-format=json)"
  local reg_bin
  reg_bin="$(grep '"name":"cuda_register"' <<<"$json" | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n1 || true)"
  if [[ -z "$reg_bin" ]]; then
    reg_bin="$(ls -t "$CARGO_TARGET_DIR"/release/deps/cuda_register-* | grep -v '\.d$' | head -n1)"
  fi
  cp "$reg_bin" "$dest/daemon-cuda-register"
  strip "$dest/daemon-cuda-register" 2>/dev/null || true
  log "binaries in $dest: $(cd "$dest" && ls -l unit-tests cuda-tests cuda_bench daemon-cuda-register | awk '{print $NF" "$5}' | tr '\n' ' ')"
}

# Make libnvrtc loadable by the names cudarc tries (libnvrtc.so, libnvrtc.so.12, ...): CUDA 13
# installs libnvrtc.so.13, and pip wheels put it under site-packages/nvidia/*/lib.
setup_nvrtc() {
  if ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so '; then
    log "libnvrtc.so found by the loader"
    return
  fi
  local found=""
  local ldpath="${LD_LIBRARY_PATH:-}"
  for d in ${ldpath//:/ } /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/lib/x86_64-linux-gnu $(python3 -c 'import site,sys; print(" ".join(site.getsitepackages()))' 2>/dev/null || true); do
    [[ -d "$d" ]] || continue
    found="$(find "$d" -maxdepth 4 -name 'libnvrtc.so*' ! -name '*builtins*' 2>/dev/null | sort -V | tail -n1)"
    [[ -n "$found" ]] && break
  done
  if [[ -z "$found" ]]; then
    log "no libnvrtc found: the kernel path will be reported unavailable"
    return
  fi
  local shim="${TMPDIR:-/tmp}/kvferry-nvrtc"
  mkdir -p "$shim"
  ln -sf "$found" "$shim/libnvrtc.so"
  export LD_LIBRARY_PATH="$shim:$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "libnvrtc: $found (shim $shim/libnvrtc.so)"
}

run() {
  local bins="$1"
  local gpu=0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu=1
    log "GPU: $(nvidia-smi -L | head -n1)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  else
    log "no GPU visible: the tests will skip and say so"
  fi
  setup_nvrtc
  local tlog="${out:-${TMPDIR:-/tmp}}/cuda-tests.log"
  log "unit tests"
  "$bins/unit-tests" --test-threads=2 2>&1 | tee "$tlog"
  log "CUDA tests (conformance in-process memcpy + kernel, over IPC, IPC behaviour, cancellation)"
  # One test at a time: the timings printed are then not disturbed by other tests.
  set +e
  "$bins/cuda-tests" --include-ignored --test-threads=1 --nocapture 2>&1 | tee -a "$tlog"
  local rc=${PIPESTATUS[0]}
  set -e
  if [[ $rc -ne 0 ]]; then
    log "CUDA tests FAILED (exit $rc)"
    exit "$rc"
  fi
  log "daemon: RegisterPool with a CUDA IPC pool (engine in a child process), read back through the daemon"
  set +e
  "$bins/daemon-cuda-register" --include-ignored --test-threads=1 --nocapture 2>&1 | tee -a "$tlog"
  rc=${PIPESTATUS[0]}
  set -e
  if [[ $rc -ne 0 ]]; then
    log "daemon CUDA RegisterPool tests FAILED (exit $rc)"
    exit "$rc"
  fi
  if [[ $gpu -eq 1 ]] && grep -q 'SKIPPED: no CUDA driver' "$tlog"; then
    log "a GPU is visible but tests skipped: failing (see $tlog)"
    exit 1
  fi
  log "bench: gather/scatter vs plain cuMemcpy"
  "$bins/cuda_bench"
  log "done"
}

if [[ -n "$out" ]]; then mkdir -p "$out"; fi
case "$mode" in
  prepare) build "$dir" ;;
  run) run "$dir" ;;
  all)
    bins="${CARGO_TARGET_DIR:-target}/gpu-check"
    build "$bins"
    run "$bins"
    ;;
esac
