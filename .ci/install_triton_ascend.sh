#!/usr/bin/env bash
# Installs Ascend's Triton compiler into .venv-triton-ascend (git-ignored) for the compile check in
# tests/ascend_compile: triton-ascend 3.2.0 (installs as the `triton` package, backend `ascend`, and
# clashes with plain triton, hence a venv of its own) and ascendnpu-ir 1.2.0 (bishengir-compile for
# A2/A3, bishengir-compile-a5). No torch, no CANN: the SoC query and hivmc are TEST-HARNESS
# stand-ins (tests/ascend_compile/harness.py). Idempotent: an existing venv that imports both is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-triton-ascend
TRITON_ASCEND_VERSION=${TRITON_ASCEND_VERSION:-3.2.0}
ASCENDNPU_IR_VERSION=${ASCENDNPU_IR_VERSION:-1.2.0}

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('triton-ascend') == '$TRITON_ASCEND_VERSION' and m.version('ascendnpu-ir') == '$ASCENDNPU_IR_VERSION' else 1)" 2>/dev/null; then
    "$PY" -m pip install -q "triton-ascend==$TRITON_ASCEND_VERSION" "ascendnpu-ir==$ASCENDNPU_IR_VERSION"
fi
# `import triton` (triton-ascend) needs pybind11; the test needs pytest
"$PY" -m pip install -q pybind11 pytest
"$PY" -c "from triton.backends import backends; assert 'ascend' in backends; import ascendnpuir; print('triton-ascend venv ok')"
