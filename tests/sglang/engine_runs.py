"""SGLang engine runs for the end-to-end suites: a run's spec (prompts, HiCache backend) and ``run_engine``.

Each run is one sglang_run.py process with the TEST HARNESS stand-ins (``harness/``) on PYTHONPATH,
then this checkout (the engine imports the kvconnect under test, whatever the venv's own install
of it points to: the engine venvs are cached and shared across checkouts).

Shared by test_sglang_e2e, test_sglang_clear, test_sglang_flush and test_sglang_mooncake.
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
    env["PYTHONPATH"] = os.pathsep.join([str(HARNESS), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
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


PAGE = 16
PROMPTS = [
    [(7 * i + 3) % 997 + 1 for i in range(70)],
    [(13 * i + 5) % 991 + 1 for i in range(53)],
]
NEW_TOKENS = 8
BACKEND = {"backend_name": "kvconnect", "module_path": "kvconnect.integrations.sglang", "class_name": "KVConnectStorage",
           "interface_v1": 1, "prefetch_threshold": PAGE, "max_local_cpu_size": 0.05, "max_local_disk_size": 0.5}


def gen():
    return {"op": "generate", "prompts": PROMPTS, "max_new_tokens": NEW_TOKENS}


def spec(model, layout=None, disk=None, phases=(), revision=None, **extra):
    out = {"model": model, "page_size": PAGE, "phases": list(phases)}
    if revision:
        out["revision"] = revision
    if layout:
        tiers = {"local_disk": str(disk)} if disk else {}
        out.update(hicache=True, layout=layout, hicache_ratio=2, backend="dynamic", extra={**BACKEND, **tiers, **extra})
    return out


def storage_hits(phase):
    return [c.get("storage", 0) for c in phase["cached"]]
