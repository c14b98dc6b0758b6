#!/usr/bin/env bash
# Installs vLLM 0.23 + vLLM-Ascend 0.23.0.post1's Python code on a CPU machine
# into a cached venv linked as .venv-ascend (git-ignored; .ci/venv_cache.sh: built once per
# recipe, outside the checkout) for the real-allocation tests in tests/ascend.
# Nothing NPU-specific is ever loaded: torch-npu is installed --no-deps only so
# that package metadata resolves; the test harness (tests/ascend/harness.py)
# stands in for torch_npu / acl / torchvision at import time.
# Idempotent: a complete venv is only refreshed with `pip install -e .` of this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/cpu_torch.sh
source .ci/venv_cache.sh

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_VERSION=${VLLM_VERSION:-0.23.0}
VLLM_ASCEND_VERSION=${VLLM_ASCEND_VERSION:-0.23.0.post1}
TORCH_NPU_VERSION=${TORCH_NPU_VERSION:-2.14.0}

use_cached_venv .venv-ascend "$0"
PIP="$PY -m pip"

if ! venv_complete; then
    $PIP install -q -U pip wheel "setuptools<81" setuptools_scm
    install_cpu_torch "$PY" "$TORCH_VERSION"
    # vLLM's CUDA wheel's Python is what vLLM-Ascend runs on; its CUDA deps are
    # never needed on CPU, so no deps (the pure-Python ones follow below).
    $PIP install -q --no-deps "vllm==$VLLM_VERSION" "torch-npu==$TORCH_NPU_VERSION"
    # The pure-Python packages `import vllm` and vLLM-Ascend's modules need.
    $PIP install -q "transformers>=4.56,<5" tokenizers sentencepiece "numpy<2.3" \
        pydantic msgspec cloudpickle psutil pyzmq requests tqdm prometheus_client \
        "fastapi[standard]" openai aiohttp pillow cachetools blake3 py-cpuinfo \
        gguf partial-json-parser lark "outlines_core" "xgrammar" diskcache einops \
        compressed-tensors pybase64 cbor2 setproctitle ijson depyf watchfiles \
        python-json-logger scipy ninja msgpack pyyaml regex protobuf \
        opencv-python-headless mistral_common openai-harmony anthropic \
        llguidance lm-format-enforcer prometheus-fastapi-instrumentator \
        tiktoken sympy typing_extensions filelock six pybind11 \
        "decorator" "attrs" "psutil" "quart" "pandas" "numba" \
        pytest hypothesis xxhash
    # vLLM-Ascend's sdist: Python only (no custom kernels, no CANN). Its build
    # deps pin a triton-ascend that PyPI lacks, hence no build isolation.
    SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 \
        $PIP install -q --no-deps --no-build-isolation "vllm-ascend==$VLLM_ASCEND_VERSION"
    # PyPI builds of these link CUDA torch and break imports on CPU.
    $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    $PIP install -q pybind11 msgpack pyzmq blake3 xxhash pyyaml pytest hypothesis
    "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm_ascend') and u.find_spec('vllm') else 1)"
    mark_venv_complete
fi
$PIP install -q -e . --no-build-isolation --no-deps
# torch would autoload the installed torch_npu backend (which needs CANN) on import.
TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PY" -c "import importlib.util as u; assert u.find_spec('vllm_ascend'); import kvconnect; print('vllm-ascend venv ok')"
