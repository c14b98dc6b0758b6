"""Sleep mode hooks (vLLM >= 0.33's ``supports_sleep_mode`` / ``unregister_kv_caches`` /
``restore_kv_caches``) driven in vLLM 0.33's calling order on vLLM 0.32's real Scheduler
(vLLM 0.33 is a CUDA-only build: its Python does not import on this CPU machine):

    EngineCore.sleep: pause the scheduler, clear vLLM's prefix cache (level >= 1)
    Worker.sleep:     connector.unregister_kv_caches(), then the KV memory is released
    Worker.wake_up:   the memory is mapped back, then connector.restore_kv_caches()
    EngineCore:       scheduling resumes

The release is played by the harness: it fills vLLM's KV tensors with NaN (what a transfer
would read) after unregister and zeros them before restore (fresh pages), and records every
byte write kvconnect makes to them while released.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK = 64


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama")  # conftest: built once per session


def test_supports_sleep_mode():
    from kvconnect.integrations.vllm import KVConnectConnector

    assert KVConnectConnector.supports_sleep_mode(None) is True


def test_sleep_lands_pending_saves_keeps_transfers_off_released_memory_and_wakes(model_dir):
    import torch
    from vllm_scheduler_rig import make_rig

    rig = make_rig(model_dir, chunk_size=CHUNK)
    worker = rig.worker._worker
    engine = rig.engine
    store, landed = engine.store, threading.Event()

    def slow_store(*args, **kwargs):  # TEST HARNESS: the save is still running when sleep begins
        time.sleep(0.5)
        out = store(*args, **kwargs)
        landed.set()
        return out

    engine.store = slow_store
    try:
        tokens = np.random.default_rng(3).integers(3, 1000, 200)
        req = rig.add(tokens)
        rig.step()  # prefills 128 tokens: the save of chunks 0 and 1 is submitted and runs

        # -- vLLM 0.33 sleep(level=1, mode="abort"): pause, abort the running requests (kvconnect
        # holds their blocks while a save may read them), then in the worker unregister, release
        from vllm.v1.request import RequestStatus

        rig.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        assert not landed.is_set()  # the save is still in flight
        rig.worker.unregister_kv_caches()
        assert landed.is_set(), "unregister returned while a save could still read KV memory"
        rig.worker.unregister_kv_caches()  # idempotent
        for cache in rig.kv_caches.values():
            cache.fill_(float("nan"))
        # a load planned now must not write into released memory (vLLM pauses; defend anyway)
        job_tokens = tokens[:192]
        from kvconnect.integrations.vllm.metadata import LoadJob, StepPlan

        blocks = tuple(range(1, 13))  # any blocks: the memory is released
        worker.load(StepPlan(loads=(LoadJob("asleep", job_tokens, (blocks,), 0, 191),)))
        assert all(torch.isnan(c).all() for c in rig.kv_caches.values()), "a load wrote into released KV memory"
        assert worker.take_load_error_blocks() == set(blocks)  # reported for recompute
        worker.transfer_results(set())
        assert engine.lookup(tokens) == 128  # lookups read kvconnect's own memory: still served

        # -- wake_up: memory back (fresh pages), then restore_kv_caches, then scheduling resumes
        for cache in rig.kv_caches.values():
            cache.zero_()
        rig.worker.restore_kv_caches()
        rig.worker.restore_kv_caches()  # idempotent
        rig.run()  # scheduling resumes: the aborted request's blocks come back
        assert rig.scheduler.reset_prefix_cache()
        again = rig.add(tokens)
        rig.run()
        assert rig.computed_log[again.request_id][0][0] == 128  # loaded after wake-up; rows checked by the rig
        assert worker.stats()["saves_skipped_asleep"] == 0
        rig.assert_no_leak()
    finally:
        engine.store = store
        rig.close()
