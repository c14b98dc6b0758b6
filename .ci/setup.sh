#!/usr/bin/env bash
# Installs kvconnect and what its core tests need on a fresh machine (Python, gcc, pip).
# Idempotent. torch comes from the pinned 2.13.0 CPU build (a newer unpinned torch would
# pull several GB of CUDA packages); the compiled kernels never link libtorch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check "pybind11>=2.11" numpy msgpack pyzmq blake3 xxhash pyyaml \
    "pytest>=7" "hypothesis>=6" redis \
    "prometheus_client>=0.17" "tqdm>=4.60"
# Triton runs the Triton transfer route's kernels in its interpreter on CPU (TRITON_INTERPRET=1,
# tests/test_transfer_triton.py) and compiles them for sm_90 without a GPU; the suite skips those
# tests where it is absent. The version vLLM 0.23 and SGLang pin.
$PY -m pip install -q --disable-pip-version-check triton==3.8.0
$PY -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[test,redis]"
