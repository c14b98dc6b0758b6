#!/usr/bin/env bash
# Installs kvconnect and what its core tests need on a fresh machine (Python >= 3.10, gcc, pip).
# Idempotent; says what it does (about 2-3 minutes with a warm pip cache).
#
# Which python: $PYTHON, else python3. A python whose packages the OS manages (Debian /
# Ubuntu: "externally-managed-environment") is not installed into: a virtual environment
# .venv is made from it and used instead, and the last line says which python to run.
#
# torch: an importable torch 2.13 is kept. Otherwise the CPU build, torch==2.13.0+cpu, from pip's
# configured sources or else the PyTorch CPU index (.ci/cpu_torch.sh): plain PyPI's Linux torch
# pulls ~5 GB of CUDA packages. For a GPU, install the CUDA torch 2.13 first; it is kept.
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
externally_managed() {
    "$1" - <<'PY'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if (os.path.exists(marker) and not in_venv) else 1)
PY
}
if externally_managed "$PY"; then
    say "$PY's packages are managed by the OS (externally-managed-environment): installing into .venv instead"
    if [ ! -x .venv/bin/python ]; then
        "$PY" -m venv .venv || { echo "setup: cannot create .venv; install python3-venv (apt-get install python3-venv) or set PYTHON to a python you may install into" >&2; exit 1; }
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
"$PY" -c "import sys; print(sys.executable)" > .ci/python
say "done: run kvconnect with $PY (e.g. $PY examples/quickstart.py)"
