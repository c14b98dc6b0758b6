#!/usr/bin/env bash
# Packaging as users install it: builds kvconnect's wheel once, checks that it ships every
# package of the source tree, installs it with its declared dependencies into a clean venv and,
# from outside the tree, runs the CLI (server --help, inspect, bench) and imports the engine
# adapters. A package missing from the wheel fails here, whatever the editable installs hide.
#
# The adapters need their engines: the clean venv sees an engine venv's site-packages through a
# .pth line placed after its own (the engine packages; kvconnect itself comes from the wheel
# only: .pth files inside an added directory, such as an editable install's, are not run).
# Each adapter is checked where its engine venv is installed; one whose venv is absent is
# skipped and named (a user's machine has the engines it has). KVCONNECT_WHEEL_ADAPTERS: auto
# (default: check the installed ones, name the others), all (CI: every adapter, an absent venv
# fails; 1 means the same), 0 (none).
# Idempotent: everything lives under build/wheel-check (git-ignored) and is rebuilt each run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WORK="$ROOT/build/wheel-check"

# module, engine venv, the script that installs it, environment for its import ("-": none)
ADAPTERS=(
    "kvconnect.integrations.vllm .venv-vllm .ci/install_vllm.sh -"
    "kvconnect.integrations.sglang .venv-sglang .ci/install_sglang.sh TORCH_DEVICE_BACKEND_AUTOLOAD=0"
)

import_adapter() {  # module, engine venv, env: the wheel's adapter imported against that engine
    local module=$1 engine_venv=$2 env=$3 rc=0
    "$ROOT/$engine_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/zz-engine.pth"
    [ "$env" = - ] && env=""
    env $env "$PY" - "$WORK/venv" "$module" <<'EOF' || rc=$?
import importlib, sys
module = importlib.import_module(sys.argv[2])
assert module.__file__.startswith(sys.argv[1]), module.__file__
print(sys.argv[2], "from the wheel")
EOF
    rm -f "$SITE/zz-engine.pth"
    return $rc
}

check_adapters() {  # mode (auto | all | 1 | 0): each adapter whose engine venv is installed; the others named
    local mode=$1 entry module venv installer env checked=() skipped=() failed=() line
    case "$mode" in auto|all|1|0) ;; *) echo "KVCONNECT_WHEEL_ADAPTERS=$mode: use auto, all or 0"; return 1 ;; esac
    if [ "$mode" = 0 ]; then echo "adapters: not checked (KVCONNECT_WHEEL_ADAPTERS=0)"; return 0; fi
    for entry in "${ADAPTERS[@]}"; do
        read -r module venv installer env <<< "$entry"
        if [ ! -x "$ROOT/$venv/bin/python" ]; then
            if [ "$mode" = auto ]; then
                skipped+=("$module: $venv is not installed (bash $installer installs it)")
            else
                echo "$venv is not installed: cannot import $module (KVCONNECT_WHEEL_ADAPTERS=$mode)"
                failed+=("$module")
            fi
            continue
        fi
        if import_adapter "$module" "$venv" "$env"; then checked+=("$module"); else failed+=("$module"); fi
    done
    echo "adapters checked: ${checked[*]:-none}"
    for line in "${skipped[@]}"; do echo "adapter skipped: $line"; done
    if [ ${#failed[@]} -gt 0 ]; then echo "adapters failed: ${failed[*]}"; return 1; fi
}

main() {
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

    check_adapters "${KVCONNECT_WHEEL_ADAPTERS:-auto}"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced (tests/test_ci_scripts.py sources it)
    main "$@"
fi
