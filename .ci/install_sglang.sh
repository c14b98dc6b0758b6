#!/usr/bin/env bash
# Installs the real SGLang 0.5.23 engine (CPU) into a cached venv linked as .venv-sglang
# (git-ignored; .ci/venv_cache.sh: built once per recipe, outside the checkout) for
# tests/sglang and benchmarks/sglang_storage.py.  Recipe (docs/sglang.md,
# shared reference real-engines.md): CPU torch, sglang --no-deps, then sglang's own
# requirement list minus CUDA / torch-family / kernel packages, with torch pinned as a
# constraint, plus triton.  Idempotent: a complete venv is only refreshed with
# `pip install -e .` of this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/cpu_torch.sh
source .ci/venv_cache.sh

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TRITON_VERSION=${TRITON_VERSION:-3.8.0}

use_cached_venv .venv-sglang "$0"

if ! venv_complete; then
    "$PY" -m pip install -q -U pip wheel setuptools
    install_cpu_torch "$PY" "$TORCH_VERSION"
    "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
    # sglang's requirements without the CUDA / torch-family / kernel wheels.
    "$PY" - > "$VENV/sglang-reqs.txt" <<'PYEOF'
import re
from importlib.metadata import requires
skip = re.compile(r"^(torch|torchvision|torchaudio|torchao|torchcodec|triton|nvidia|cuda|flashinfer|"
                  r"flash[-_]attn|sgl[-_]kernel|sglang[-_]kernel|cutlass|"
                  r"nvidia-cutlass|deep[-_]gemm|decord|tilelang|"
                  r"quack|flash[-_]mla|mooncake|nixl|llguidance|outlines|humming|kernels$|nvshmem|"
                  r"sgl[-_]|timm)", re.I)
for r in requires("sglang") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0]
    if skip.match(name):
        continue
    print(r.split(";")[0].strip())
PYEOF
    echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
    "$PY" -m pip install -q -r "$VENV/sglang-reqs.txt" -c "$VENV/constraints.txt"
    "$PY" -m pip install -q "triton==$TRITON_VERSION" -c "$VENV/constraints.txt"
    "$PY" -m pip install -q pybind11 msgpack pyzmq blake3 xxhash pyyaml pytest hypothesis redis
    "$PY" -c "import sglang, torch; assert sglang.__version__ == '$SGLANG_VERSION'; assert torch.__version__.startswith('$TORCH_VERSION')"
    mark_venv_complete
fi
"$PY" -m pip install -q -e . --no-build-isolation --no-deps
PYTHONPATH=tests/sglang/harness "$PY" -c "import sglang, kvconnect; print('sglang', sglang.__version__, 'ok')"
