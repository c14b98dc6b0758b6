"""What a `vllm serve` user sees of the connector, without vLLM: the log lines (registration,
off, periodic summaries, nothing per request at INFO), their routing into vLLM's logger tree,
and the small-load rule (a hit that saves less than an engine step is left to vLLM)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvconnect import Config, GroupSpec, KVLayout
from kvconnect.integrations.vllm import logs
from kvconnect.integrations.vllm.metadata import RequestView, SaveJob, StepPlan
from kvconnect.integrations.vllm.scheduler import KVConnectScheduler
from kvconnect.integrations.vllm.translate import Translation
from kvconnect.integrations.vllm.worker import KVConnectWorker

CHUNK = 64
NB, BS = 16, 32
WORKER_LOG = "kvconnect.integrations.vllm.worker"
SCHED_LOG = "kvconnect.integrations.vllm.scheduler"


class FixedHits:
    def __init__(self, hit: int) -> None:
        self.hit = hit

    def lookup(self, tokens, namespace=b"", *, generation=None, media=()):
        return self.hit

    def clear(self, generation=None, retire=None):
        return True

    def retired(self, generation):
        return False

    def close(self):
        pass


def _view(n: int, req_id: str = "r") -> RequestView:
    return RequestView(req_id, np.arange(n, dtype=np.int64) + 3, n)


def _translation() -> Translation:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(NB, 2, BS, 16, generator=g)
    swa = torch.randn(NB, 2, BS, 16, generator=g)
    groups = [GroupSpec(block_size=BS, sliding_window=64, restore_window=63), GroupSpec(block_size=BS)]
    layout = KVLayout.from_tensors({"swa": swa, "full": full}, groups=groups, layer_groups={"swa": 0, "full": 1},
                                   layout_hints="page")
    return Translation(layout, source_groups=(0, 1), num_vllm_groups=2, layer_names=("swa", "full"))


# --- the small-load rule -------------------------------------------------------------------
def test_a_load_smaller_than_min_load_tokens_is_left_to_vllm():
    sched = KVConnectScheduler(FixedHits(512), chunk_tokens=CHUNK, min_load_tokens=CHUNK)
    # vLLM's prefix cache holds all but the last block of the hit: 32 tokens to load < 64
    assert sched.num_new_matched_tokens(_view(537), 480) == (0, False)
    sched.after_alloc(_view(537), (), num_computed=480, num_external=0)
    assert sched.build_plan({}, lambda r: 480, lambda r: None).loads == ()
    assert sched.lookup_stats["small_hits"] == 1 and sched.lookup_stats["small_hit_tokens"] == 32
    # exactly min_load_tokens, and a big hit: loaded asynchronously as before
    assert sched.num_new_matched_tokens(_view(537, "b"), 448) == (64, True)
    assert sched.num_new_matched_tokens(_view(537, "c"), 0) == (512, True)
    assert sched.lookup_stats["hits"] == 2 and sched.lookup_stats["hit_tokens"] == 576
    # the prompt-end case: the hit is capped one token short of the prompt
    sched = KVConnectScheduler(FixedHits(512), chunk_tokens=CHUNK, min_load_tokens=CHUNK)
    assert sched.num_new_matched_tokens(_view(512), 464) == (0, False)  # 511 - 464 = 47 < 64


def test_min_load_tokens_one_keeps_every_hit_and_the_default_is_one_chunk():
    sched = KVConnectScheduler(FixedHits(512), chunk_tokens=CHUNK, min_load_tokens=1)
    assert sched.num_new_matched_tokens(_view(537), 480) == (32, True)
    # one chunk: the chunk size the adapter settled on (unset in Config(): chosen from the layout)
    assert Config(chunk_size=256).effective_min_load_tokens == 256 and Config().chunk_size == 0
    assert Config(chunk_size=64).effective_min_load_tokens == 64
    assert Config.from_env({"KVCONNECT_MIN_LOAD_TOKENS": "1"}).effective_min_load_tokens == 1


# --- periodic summaries ----------------------------------------------------------------------
def test_periodic_emits_at_most_once_per_interval_and_only_after_activity():
    now = [0.0]
    calls = []
    p = logs.Periodic(10.0, lambda: calls.append(now[0]), clock=lambda: now[0])
    now[0] = 20.0
    assert not p.tick()  # nothing happened
    p.dirty = True
    assert p.tick() and calls == [20.0]
    p.dirty = True
    now[0] = 25.0
    assert not p.tick()  # within the interval
    now[0] = 30.0
    assert p.tick() and calls == [20.0, 30.0]
    off = logs.Periodic(0.0, lambda: calls.append("never"), clock=lambda: now[0])
    off.dirty = True
    now[0] = 1e9
    assert not off.tick()


def test_scheduler_summary_is_info_and_per_request_lines_are_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="kvconnect")
    sched = KVConnectScheduler(FixedHits(512), chunk_tokens=CHUNK, min_load_tokens=CHUNK, log_interval_s=3600.0)
    for i in range(20):
        sched.num_new_matched_tokens(_view(537, f"r{i}"), 480 if i % 2 else 0)
        sched.build_plan({}, lambda r: 0, lambda r: None)
    info = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert info == []  # the interval has not passed: nothing per request at INFO
    assert any(r.levelno == logging.DEBUG and "min_load_tokens" in r.getMessage() for r in caplog.records)
    sched.summary._last -= 3601.0
    sched.build_plan({}, lambda r: 0, lambda r: None)
    (line,) = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert line.levelno == logging.INFO and line.name == SCHED_LOG
    assert "10 of 20 prompts hit" in line.getMessage() and "10 hits under min_load_tokens=64" in line.getMessage()


# --- registration and off -------------------------------------------------------------------
def test_registration_logs_one_info_line_with_the_layout_and_the_pool(caplog):
    caplog.set_level(logging.DEBUG, logger="kvconnect")
    worker = KVConnectWorker(Config(chunk_size=CHUNK, max_local_cpu_size=0.01, log_interval_s=0), None)
    worker.register(_translation())
    try:
        (line,) = [r for r in caplog.records if r.levelno >= logging.INFO]
        msg = line.getMessage()
        assert line.levelno == logging.INFO and line.name == WORKER_LOG
        for part in ("registered", "2 group(s) [attention block 32 window 63, attention block 32]", "2 planes", "per 64-token chunk", "tiers cpu", "CPU pool 10.2 MiB",
                     "s3fifo eviction", "copy threads: "):
            assert part in msg, (part, msg)
        # per-step work logs nothing at INFO
        tokens = np.arange(128, dtype=np.int64) + 5
        for step in range(5):
            worker.begin_step(StepPlan())
            worker.load(StepPlan())
            worker.save(StepPlan(saves=(SaveJob(f"s{step}", tokens, ((1, 2, 3, 4), (1, 2, 3, 4)), 0),)))
            worker.transfer_results(set())
        worker.drain()
        assert [r for r in caplog.records if r.levelno >= logging.INFO] == [line]
    finally:
        worker.close()


def test_a_zero_pool_turns_the_connector_off_with_one_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="kvconnect")
    worker = KVConnectWorker(Config(chunk_size=CHUNK, max_local_cpu_size=0), None)
    worker.register(_translation())
    try:
        (line,) = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert line.levelno == logging.WARNING and "stores nothing" in line.getMessage() and "0 chunks" in line.getMessage()
        assert worker.engine is None and worker.lookup(np.arange(300, dtype=np.int64)) == 0
        assert worker.stats()["enabled"] == 0
    finally:
        worker.close()


def test_worker_summary_after_activity(caplog):
    caplog.set_level(logging.INFO, logger="kvconnect")
    worker = KVConnectWorker(Config(chunk_size=CHUNK, max_local_cpu_size=0.01, log_interval_s=1e-9), None)
    worker.register(_translation())
    try:
        tokens = np.arange(128, dtype=np.int64) + 5
        worker.save(StepPlan(saves=(SaveJob("a", tokens, ((1, 2, 3, 4), (1, 2, 3, 4)), 0),)))
        worker.begin_step(StepPlan())
        worker.save(StepPlan())
        lines = [r.getMessage() for r in caplog.records if "since start" in r.getMessage()]
        # the pool holds the 2 chunks' prefix parts and the window piece(s) of the restore point at the
        # saved prompt's end (the layout has a window group: kvconnect/restore/parts.py)
        pooled = 2 + worker.engine.stats.window_pieces_stored
        assert worker.engine.stats.window_pieces_stored == len(worker.engine.parts.pieces)
        assert len(lines) == 1 and "1 saves (2 chunks stored" in lines[0] and f"CPU pool {pooled}/" in lines[0]
    finally:
        worker.close()


# --- routing into vLLM's logger tree ----------------------------------------------------------
@pytest.fixture
def vllm_tree():
    """A stand-in for the tree vLLM configures: a ``vllm`` logger with its own handler that
    does not propagate (vLLM's DEFAULT_LOGGING_CONFIG); kvconnect's logger restored after."""
    records: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    vllm, core = logging.getLogger("vllm"), logging.getLogger("kvconnect")
    saved = (vllm.handlers[:], vllm.level, vllm.propagate, core.handlers[:], core.level, core.propagate)
    vllm.handlers[:] = [Keep()]
    vllm.setLevel(logging.INFO)
    vllm.propagate = False
    core.handlers[:] = []
    yield records
    vllm.handlers[:], core.handlers[:] = saved[0], saved[3]
    vllm.setLevel(saved[1])
    vllm.propagate, core.propagate = saved[2], saved[5]
    core.setLevel(saved[4])


def test_kvconnect_records_reach_vllms_handlers_at_vllms_level(vllm_tree):
    assert logs.route_to_vllm() and logs.route_to_vllm()  # idempotent
    assert len(logging.getLogger("kvconnect").handlers) == 1
    logging.getLogger("kvconnect.integrations.vllm.worker").info("kvconnect: registered: test")
    logging.getLogger("kvconnect.storage.manager").debug("below vLLM's level")
    logging.getLogger("kvconnect.storage.manager").warning("kvconnect: a tier failed")
    assert [r.getMessage() for r in vllm_tree] == ["kvconnect: registered: test", "kvconnect: a tier failed"]


def test_a_users_own_kvconnect_handler_is_left_alone(vllm_tree):
    core = logging.getLogger("kvconnect")
    mine = logging.NullHandler()
    core.addHandler(mine)
    assert not logs.route_to_vllm()
    assert core.handlers == [mine]
