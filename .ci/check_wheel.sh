#!/usr/bin/env bash
# Packaging as users install it: builds kvconnect's wheel once, checks that it ships every
# package of the source tree, installs it with its declared dependencies into a clean venv and,
# from outside the tree, runs the CLI (server --help, inspect, bench) and imports both engine
# adapters. A package missing from the wheel fails here, whatever the editable installs hide.
#
# The adapters need their engines: the clean venv sees an engine venv's site-packages through a
# .pth line placed after its own (the engine packages; kvconnect itself comes from the wheel
# only: .pth files inside an added directory, such as an editable install's, are not run).
# Idempotent: everything lives under build/wheel-check (git-ignored) and is rebuilt each run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK="$ROOT/build/wheel-check"
rm -rf "$WORK"
mkdir -p "$WORK/dist" "$WORK/outside"

"${PYTHON:-python3}" -m pip wheel . --no-deps --no-build-isolation -q --disable-pip-version-check -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/kvconnect-*.whl)
echo "wheel: $(basename "$WHEEL")"

"${PYTHON:-python3}" - "$WHEEL" <<'EOF'
import pathlib, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
packages = sorted(str(p.parent) for p in pathlib.Path("kvconnect").rglob("__init__.py"))
missing = [p for p in packages if f"{p}/__init__.py" not in names]
modules = sorted(str(p) for p in pathlib.Path("kvconnect").rglob("*.py"))
missing += [m for m in modules if m not in names]
if missing:
    sys.exit(f"the wheel lacks {missing}")
print(f"wheel ships all {len(packages)} packages, {len(modules)} modules")
EOF

python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
# torch's CPU build first, as setup.sh installs it (an unpinned torch pulls GBs of CUDA wheels)
source "$ROOT/.ci/cpu_torch.sh"
install_cpu_torch "$PY" "${TORCH_VERSION:-2.13.0}"
echo "torch==${TORCH_VERSION:-2.13.0}" > "$WORK/constraints.txt"
"$PY" -m pip install -q --disable-pip-version-check -c "$WORK/constraints.txt" "$WHEEL"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

cd "$WORK/outside"  # nothing of the source tree on sys.path from here on
"$PY" - "$WORK/venv" <<'EOF'
import sys, kvconnect, kvconnect._cpu_kernels
assert kvconnect.__file__.startswith(sys.argv[1]), kvconnect.__file__
print("kvconnect from", kvconnect.__file__)
EOF
"$WORK/venv/bin/kvconnect" server --help > /dev/null
"$WORK/venv/bin/kvconnect" inspect --preset llama-3.1-8b > /dev/null
"$WORK/venv/bin/kvconnect" bench --preset llama-3.1-8b --layers 2 --tokens 512 --repeats 1 --no-progress > /dev/null
echo "CLI: server --help, inspect, bench ok"

adapter() {  # adapter module, engine venv
    local module=$1 engine_venv=$2
    if [ ! -x "$ROOT/$engine_venv/bin/python" ]; then
        echo "$engine_venv is not installed: cannot import $module"; return 1
    fi
    "$ROOT/$engine_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/zz-engine.pth"
    "$PY" - "$WORK/venv" "$module" <<'EOF'
import importlib, sys
module = importlib.import_module(sys.argv[2])
assert module.__file__.startswith(sys.argv[1]), module.__file__
print(sys.argv[2], "from the wheel")
EOF
    local rc=$?
    rm -f "$SITE/zz-engine.pth"
    return $rc
}
status=0
if [ "${KVCONNECT_WHEEL_ADAPTERS:-1}" = 1 ]; then
    adapter kvconnect.integrations.vllm .venv-vllm || status=1
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 adapter kvconnect.integrations.sglang .venv-sglang || status=1
fi
exit $status
