#!/usr/bin/env bash
# Installs kvconnect and what its core tests need on a fresh machine (Python >= 3.10, gcc, pip).
# Idempotent; says what it does (about 2-3 minutes with a warm pip cache).
#
# Which python: an active virtual environment (VIRTUAL_ENV, or $PYTHON inside one) is installed
# into; otherwise a virtual environment .venv is made from $PYTHON (else python3) and used, so
# torch and kvconnect never land in a machine's global interpreter (a version manager's, conda, /usr/local, or
# the OS's). The last line says which python to run, and .ci/python holds its path.
#
# torch: an importable torch 2.13 is kept. Otherwise the CPU build, torch==2.13.0+cpu, from pip's
# configured sources or else the PyTorch CPU index (.ci/cpu_torch.sh): plain PyPI's Linux torch
# pulls ~5 GB of CUDA packages. For a GPU, install the CUDA torch 2.13 first (in the venv); it is kept.
# The compiled kernels never link libtorch, so any torch 2.x build serves.
#
# The last line names the python to run kvconnect with; .ci/run reads it from .ci/python.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/cpu_torch.sh
START=$SECONDS
say() { echo "setup [$((SECONDS - START))s]: $*"; }

PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "setup: no '$PY' on PATH; set PYTHON=/path/to/python3 (>= 3.10)" >&2; exit 1; }
"$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null \
    || { echo "setup: $("$PY" --version 2>&1) is too old; kvconnect needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
in_venv() {
    "$1" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null
}
if [ -z "${PYTHON:-}" ] && [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PY=$VIRTUAL_ENV/bin/python
fi
if in_venv "$PY"; then
    say "installing into the active virtual environment ($("$PY" -c 'import sys; print(sys.prefix)'))"
else
    if [ ! -x .venv/bin/python ]; then
        say "making a virtual environment .venv from $("$PY" -c 'import sys; print(sys.executable)')"
        "$PY" -m venv .venv || { echo "setup: cannot create .venv; install python3-venv (apt-get install python3-venv), or activate a virtual environment and run setup again" >&2; exit 1; }
    fi
    PY=.venv/bin/python
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)

say "pip, setuptools, wheel"
"${PIP[@]}" --upgrade pip setuptools wheel
say "torch 2.13.0 ($(cpu_torch_spec 2.13.0))"
install_cpu_torch "$PY" 2.13.0
say "kvconnect's dependencies and test tools"
"${PIP[@]}" "pybind11>=2.11" numpy msgpack pyzmq blake3 xxhash pyyaml \
    "pytest>=7" "hypothesis>=6" redis \
    "prometheus_client>=0.17" "tqdm>=4.60"
# Triton runs the Triton transfer route's kernels in its interpreter on CPU (TRITON_INTERPRET=1,
# tests/test_transfer_triton.py) and compiles them for sm_90 without a GPU; the suite skips those
# tests where it is absent. The version vLLM 0.23 and SGLang pin.
say "triton 3.8.0 (the Triton route's tests run in its interpreter)"
"${PIP[@]}" triton==3.8.0
say "kvconnect itself (editable; compiles the CPU kernels, about a minute)"
"${PIP[@]}" --no-build-isolation -e ".[test,redis]"
# LMCache's releases kvconnect answers for (kvconnect/lmcache_names.py), downloaded (never installed) for
# tests/test_lmcache_names.py, which reads their configuration names from the wheels as data; offline,
# that test checks the vendored lists only.
for spec in lmcache==0.4.5 lmcache==0.5.6; do
    say "$spec's wheel, as data for tests/test_lmcache_names.py (not installed)"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps "$spec" -d "$HOME/.cache/kvconnect-ci" \
        || echo "setup: could not download $spec; tests/test_lmcache_names.py checks its vendored list only"
done
# the interpreter chosen above, for .ci/run and anyone scripting after setup (git-ignored)
"$PY" -c "import os, sys; print(os.path.abspath(sys.executable))" > .ci/python
say "done: run kvconnect with $PY (e.g. $PY examples/quickstart.py)"
