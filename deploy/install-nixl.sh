#!/usr/bin/env bash
# Install what kvferry's NIXL backend (crates/pool-nixl) needs, idempotently:
#   - Debian's libclang-dev (bindgen, used by the nixl-sys build),
#   - PyPI's nixl-cu12 with --no-deps (libnixl_capi.so, the UCX plugin and a bundled UCX;
#     its declared deps torch/numpy are not needed by the Rust side),
#   - numpy (only NIXL's Python API needs it; the Python-engine tests use that API).
# Then prints (and, when sourced, exports) the run-time environment:
#   source deploy/install-nixl.sh            # installs + exports into this shell
#   bash deploy/install-nixl.sh              # installs + prints the export lines
# Env: PYTHON (default python3), NIXL_CU12_VERSION (default 1.5.1).

_kvf_nixl_main() {
    local py="${PYTHON:-python3}"
    local ver="${NIXL_CU12_VERSION:-1.5.1}"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"

    if ! dpkg -s libclang-dev >/dev/null 2>&1; then
        echo "install-nixl: installing libclang-dev" >&2
        $sudo apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libclang-dev >&2 \
            || { echo "install-nixl: apt-get install libclang-dev failed" >&2; return 1; }
    fi

    local have
    have="$( ("$py" -m pip show nixl-cu12 2>/dev/null || true) | sed -n 's/^Version: //p')"
    if [ "$have" != "$ver" ]; then
        echo "install-nixl: pip install --no-deps nixl-cu12==$ver (had: ${have:-none})" >&2
        "$py" -m pip install -q --no-deps "nixl-cu12==$ver" >&2 \
            || { echo "install-nixl: pip install nixl-cu12 failed" >&2; return 1; }
    fi
    if ! "$py" -c 'import numpy' >/dev/null 2>&1; then
        echo "install-nixl: pip install numpy (NIXL's Python API imports it)" >&2
        "$py" -m pip install -q numpy >&2 || { echo "install-nixl: pip install numpy failed" >&2; return 1; }
    fi

    local libs
    libs="$("$py" -c 'import importlib.util, os
s = importlib.util.find_spec("nixl_cu12")
print(os.path.join(os.path.dirname(os.path.dirname(s.origin)), ".nixl_cu12.mesonpy.libs"))')" \
        || { echo "install-nixl: cannot locate the nixl_cu12 package" >&2; return 1; }
    if [ ! -f "$libs/libnixl_capi.so" ] || [ ! -f "$libs/plugins/libplugin_UCX.so" ]; then
        echo "install-nixl: $libs lacks libnixl_capi.so or plugins/libplugin_UCX.so" >&2
        return 1
    fi

    case ":${LD_LIBRARY_PATH:-}:" in
        *":$libs:"*) ;;
        *) export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
    export NIXL_PLUGIN_DIR="$libs/plugins"
    export KVFERRY_NIXL_LIB_DIR="$libs"
    # Loopback only, tcp kept enabled (UCX needs it for wire-up and peer-failure handling).
    export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"

    echo "export LD_LIBRARY_PATH=\"$LD_LIBRARY_PATH\""
    echo "export NIXL_PLUGIN_DIR=\"$NIXL_PLUGIN_DIR\""
    echo "export KVFERRY_NIXL_LIB_DIR=\"$KVFERRY_NIXL_LIB_DIR\""
    echo "export UCX_NET_DEVICES=\"$UCX_NET_DEVICES\""
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    _kvf_nixl_main   # sourced: exports stay in the caller's shell; status is the return value
else
    set -euo pipefail
    _kvf_nixl_main
fi
