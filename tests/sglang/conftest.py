"""Fixtures for the SGLang tests (tests/sglang): the real SGLang 0.5.23 engine on CPU.

Skipped when ``sglang`` is not installed (the core CI run); run by ``.ci/run`` from
``.venv-sglang`` (``.ci/install_sglang.sh``), where a broken install fails them. The engine
runs in subprocesses with the TEST HARNESS stand-ins (``harness/``, see its sitecustomize)
on PYTHONPATH: the product patches nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness"
REPO = HERE.parent.parent


def harness_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HARNESS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(KVCONNECT_SGLANG_CPU_HARNESS="1", SGLANG_USE_CPU_ENGINE="1", TOKENIZERS_PARALLELISM="false")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_engine(spec: dict, workdir: Path, timeout_s: float = 300.0, **env) -> dict:
    """One SGLang engine process through ``spec["phases"]`` (see sglang_run.py); its results."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"spec{len(list(workdir.glob('spec*.json')))}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HERE / "sglang_run.py"), str(path)], capture_output=True, text=True,
                          timeout=timeout_s, env=harness_env(**env), cwd=str(workdir))
    for line in proc.stdout.splitlines():
        if line.startswith("KVCONNECT_RESULT "):
            return {**json.loads(line[len("KVCONNECT_RESULT "):]), "log": proc.stderr[-20000:]}
    pytest.fail(f"SGLang run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")


def pytest_configure(config):
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO / "tests" / "integration"))  # tiny_models
    config.addinivalue_line("markers", "sglang: needs the real SGLang engine (installed by .ci/install_sglang.sh)")
