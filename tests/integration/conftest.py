"""Fixtures for the end-to-end engine tests (tests/integration).

The tests here drive a real engine in subprocesses (one process per engine run, so
engine teardown never leaks into the next run; the runs fork from a process that imported the
engine once: support/forked_runs.py). They skip only when the engine package is
not installed at all; a broken install fails them. For vLLM: ``.ci/install_vllm.sh`` then
``.venv-vllm/bin/python -m pytest tests/integration -m vllm``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Builds a tiny random model on first request: ``tiny_models(kind) -> directory``."""
    from support import tiny_models as builders  # imports transformers: only where the engine is installed

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = builders.BUILDERS[kind](str(root / kind))
        return built[kind]

    return get


@pytest.fixture
def rebuilt_rig(tiny_models):
    """``rebuilt_rig(structure, chunk_size=..., **kwargs)``: vLLM's Scheduler over a hand-built
    group structure (vllm_rebuilt_rig.make_rebuilt_rig, the tiny Llama's ModelConfig only), every
    rig the test made closed after it."""
    from vllm_rebuilt_rig import make_rebuilt_rig

    made = []

    def make(structure, *, chunk_size: int, **kwargs):
        made.append(make_rebuilt_rig(tiny_models("llama"), structure, chunk_size=chunk_size, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def run_vllm(tmp_path):
    """``run_vllm(model_dir, phases, connector=None, **options) -> result dict`` in a subprocess.

    ``phases``: list of phases, each a list of prompts (token-id lists); vLLM's prefix cache
    is reset between phases. ``connector``: the lookup-channel URL, or None for a plain run.
    The result also holds ``log``: the run's stdout and stderr. Each run is its own process,
    forked from one that imported vLLM once (TEST HARNESS, support/forked_runs.py).
    """
    from support.forked_runs import run_script

    counter = iter(range(1000))

    def run(model_dir: str, phases, connector=None, timeout_s: float = 240.0, **options) -> dict:
        n = next(counter)
        prompts, out = tmp_path / f"prompts{n}.json", tmp_path / f"result{n}.json"
        prompts.write_text(json.dumps(phases))
        args = ["--model", model_dir, "--prompts", str(prompts), "--out", str(out)]
        if connector:
            args += ["--connector", connector]
        for key, value in options.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        proc = run_script(HERE / "vllm_run.py", args, env=env, cwd=str(tmp_path), timeout_s=timeout_s)
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"vLLM run failed (rc {proc.returncode}):\n{proc.stdout[-12000:]}")
        result = json.loads(out.read_text())
        result["log"] = proc.stdout  # vLLM's log, kvconnect's lines included
        return result

    return run


def pytest_configure(config):
    sys.path.insert(0, str(HERE))  # vllm_run
