#!/usr/bin/env bash
# Installs vLLM 0.13.0 + vLLM-Ascend 0.13.0rc3's Python code on a CPU machine for tests/ascend013:
# vLLM-Ascend's first DeepSeek V4 line. 0.13.0rc3 is commit bbe9bc0d90 ("Add DeepSeek v4
# initial support") of its releases/v0.13.0 branch; the later commits there change docs and
# add two empty __init__.py files (58ea73f959, "Fix Missing __init__.py"), without which the
# released wheel lacks vllm_ascend/models/layer/ and vllm_ascend/transformers_utils/ (its
# model runner imports the first). This script does what that fix does: it copies both
# folders from the same release's sdist into the installed package, with the empty
# __init__.py files.
#
# Nothing NPU-specific is ever loaded: the wheel's NPU libraries are never imported,
# torch-npu is installed --no-deps only so that package metadata resolves, and the test
# harness (tests/ascend013/harness013.py) stands in for torch_npu / acl / torchvision. torch is
# the CPU build (vLLM-Ascend 0.13 pins torch 2.8 for NPU; only its allocation and
# slot-mapping code runs here).
#
# Cache: the venv lives outside the checkout (.ci/venv_cache.sh: $KVCONNECT_CI_CACHE, default
# ~/.cache/kvconnect-ci, /venv-ascend013-<hash of the recipe>), and .venv-ascend013 links to it,
# so a second CI run reuses it (seconds); a cold one takes ~4 min. kvconnect itself is not
# installed there: run it with PYTHONPATH=$PWD (the in-place build of .ci/setup.sh, same python).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/cpu_torch.sh
source .ci/venv_cache.sh

TORCH_VERSION=2.13.0
VLLM_VERSION=0.13.0
VLLM_ASCEND_VERSION=0.13.0rc3
TORCH_NPU_VERSION=2.8.0.post2
use_cached_venv .venv-ascend013 "$0"
PIP="$PY -m pip"
if ! venv_complete; then
    echo "install_ascend013: cold cache (~4 min)"
    $PIP install -q -U pip wheel "setuptools<81" setuptools_scm
    install_cpu_torch "$PY" "$TORCH_VERSION"
    # vLLM's CUDA wheel's Python is what vLLM-Ascend runs on; no CUDA dep is needed on CPU.
    $PIP install -q --no-deps "vllm==$VLLM_VERSION" "torch-npu==$TORCH_NPU_VERSION" \
        "vllm-ascend==$VLLM_ASCEND_VERSION"
    # The pure-Python packages `import vllm` and vLLM-Ascend's kv-cache modules need,
    # and kvconnect's own.
    $PIP install -q "transformers>=4.57,<5" tokenizers sentencepiece "numpy<2.3" \
        pydantic msgspec cloudpickle psutil pyzmq requests tqdm prometheus_client \
        "fastapi[standard]" openai aiohttp pillow cachetools blake3 py-cpuinfo \
        gguf partial-json-parser lark diskcache einops llguidance xgrammar outlines_core lm-format-enforcer \
        compressed-tensors pybase64 cbor2 setproctitle ijson depyf watchfiles \
        python-json-logger scipy msgpack pyyaml regex protobuf \
        mistral_common openai-harmony anthropic \
        prometheus-fastapi-instrumentator tiktoken sympy typing_extensions filelock six \
        decorator attrs quart pandas numba pybind11 pytest hypothesis xxhash
    $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    # The two folders the wheel lacks, from the same release's sdist (see the top).
    SDIST=$(mktemp -d)
    SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 $PIP download -q --no-deps --no-build-isolation \
        --no-binary vllm-ascend -d "$SDIST" "vllm-ascend==$VLLM_ASCEND_VERSION"
    tar xzf "$SDIST"/vllm_ascend-*.tar.gz -C "$SDIST"
    SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    for sub in models/layer transformers_utils; do
        cp -r "$SDIST/vllm_ascend-$VLLM_ASCEND_VERSION/vllm_ascend/$sub" "$SITE/vllm_ascend/$sub"
        touch "$SITE/vllm_ascend/$sub/__init__.py"
    done
    rm -rf "$SDIST"
    mark_venv_complete
fi
TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONPATH=$PWD "$PY" -c "
import importlib.metadata as m, kvconnect
assert m.version('vllm') == '$VLLM_VERSION' and m.version('vllm_ascend') == '$VLLM_ASCEND_VERSION'
print('vllm-ascend 0.13 venv ok:', '$VENV')"
