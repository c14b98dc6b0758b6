#!/usr/bin/env bash
# Installs Ascend's Triton compiler into a cached venv linked as .venv-triton-ascend (git-ignored;
# .ci/venv_cache.sh) for the compile check in
# tests/ascend_compile: triton-ascend 3.2.0 (installs as the `triton` package, backend `ascend`, and
# clashes with plain triton, hence a venv of its own) and ascendnpu-ir 1.2.0 (bishengir-compile for
# A2/A3, bishengir-compile-a5). No torch, no CANN: the SoC query and hivmc are TEST-HARNESS
# stand-ins (tests/ascend_compile/harness.py). Idempotent: a complete venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/venv_cache.sh

TRITON_ASCEND_VERSION=${TRITON_ASCEND_VERSION:-3.2.0}
ASCENDNPU_IR_VERSION=${ASCENDNPU_IR_VERSION:-1.2.0}

use_cached_venv .venv-triton-ascend "$0"
if ! venv_complete; then
    "$PY" -m pip install -q "triton-ascend==$TRITON_ASCEND_VERSION" "ascendnpu-ir==$ASCENDNPU_IR_VERSION"
    # `import triton` (triton-ascend) needs pybind11; the test needs pytest
    "$PY" -m pip install -q pybind11 pytest
    mark_venv_complete
fi
"$PY" -c "from triton.backends import backends; assert 'ascend' in backends; import ascendnpuir; print('triton-ascend venv ok')"
