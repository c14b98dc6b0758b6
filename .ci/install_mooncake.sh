#!/usr/bin/env bash
# Installs Mooncake Store for the Mooncake tier's tests: libibverbs1 (every native part of
# Mooncake links it, even for TCP) and the CPU wheel mooncake-transfer-engine-non-cuda
# (mooncake.store, mooncake_master, mooncake_client) into the system python and into each
# engine venv given as an argument that exists (the vLLM / SGLang e2e tests over Mooncake
# import mooncake inside the engine process). Tests start their own master on loopback, the
# mooncake_master beside the interpreter that runs them (its scripts directory, not PATH).
# Idempotent.  Usage: bash .ci/install_mooncake.sh [.venv-vllm .venv-sglang ...]
set -euo pipefail
cd "$(dirname "$0")/.."
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}
PKG="mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"

if ! ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1"; then
    SUDO=""
    if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

scripts_dir() {  # $1: a python interpreter; where its packages' executables land (a venv, a version manager's python, /usr/local alike)
    "$1" -c "import sysconfig; print(sysconfig.get_path('scripts'))"
}

install_into() {  # $1: a python interpreter
    if ! "$1" -c "import mooncake.store" >/dev/null 2>&1 || [ ! -x "$(scripts_dir "$1")/mooncake_master" ]; then
        "$1" -m pip install -q --disable-pip-version-check "$PKG"
    fi
    "$1" -c "import mooncake.store, importlib.metadata as m; print('$1: mooncake', m.version('mooncake-transfer-engine-non-cuda'))"
    # the tests start the master found next to the interpreter that runs them (tests/support/
    # mooncake_master.py), never one that happens to be on PATH: require it there
    [ -x "$(scripts_dir "$1")/mooncake_master" ] || { echo "mooncake_master is not in $(scripts_dir "$1")"; exit 1; }
}

install_into "${PYTHON:-python3}"
for venv in "$@"; do
    if [ -x "$venv/bin/python" ]; then install_into "$venv/bin/python"; fi
done
