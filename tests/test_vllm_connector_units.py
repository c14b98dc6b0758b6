"""The vLLM connector's engine-free parts: lookup channel, scheduler planning, worker.

No vLLM needed. The worker runs over a real KVCacheEngine on CPU tensors shaped like vLLM's
CPU backend (pages) and a sliding-window hybrid, driven by the plans the scheduler makes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest
import torch
import zmq

from kvconnect import Config, ConfigError, GroupSpec, KVLayout
from kvconnect.integrations.vllm.lookup_channel import LookupClient, LookupServer, check_address, rank_address
from kvconnect.integrations.vllm.metadata import SAVE_SLACK_STEPS, LoadJob, RequestView, SaveJob, StepPlan
from kvconnect.integrations.vllm.scheduler import KVConnectScheduler
from kvconnect.integrations.vllm.translate import Translation
from kvconnect.integrations.vllm.worker import KVConnectWorker

CHUNK = 64


# --- lookup channel ----------------------------------------------------------------------
class FixedHits:
    def __init__(self, hit: int, delay_s: float = 0.0) -> None:
        self.hit, self.delay_s, self.cleared, self.seen, self.namespaces = hit, delay_s, 0, [], []
        self.generations, self.cleared_to, self.retired_to, self.markers = [], [], [], set()

    def lookup(self, tokens, namespace=b"", generation=None, media=()):
        self.seen.append(tokens.copy())
        self.namespaces.append(namespace)
        self.generations.append(generation)
        time.sleep(self.delay_s)
        return self.hit

    def stats(self):
        return {"hit": self.hit}

    def clear(self, generation=None, retire=None):
        self.cleared += 1
        self.cleared_to.append(generation)
        self.retired_to.append(retire)

    def retired(self, generation):
        time.sleep(self.delay_s)
        return generation in self.markers


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(*handlers):
        base = f"ipc://{tmp_path}/kvc"
        for i, h in enumerate(handlers):
            made.append(LookupServer(rank_address(base, i), h))
        return [rank_address(base, i) for i in range(len(handlers))]

    yield make
    for s in made:
        s.close()


def test_hit_is_the_minimum_over_workers(servers):
    handlers = [FixedHits(512), FixedHits(448)]
    client = LookupClient(servers(*handlers), timeout_s=5.0)
    tokens = np.arange(600, dtype=np.int64)
    assert client.lookup(tokens) == 448
    assert all(np.array_equal(h.seen[0], tokens) for h in handlers)
    assert client.lookup(tokens, b"\x91\xa4salt") == 448
    assert [h.namespaces for h in handlers] == [[b"", b"\x91\xa4salt"]] * 2
    assert client.stats() == [{"hit": 512}, {"hit": 448}]
    assert client.clear() and [h.cleared for h in handlers] == [1, 1]
    client.close()


def test_a_clear_names_the_generation_to_retire_and_retired_asks_every_worker(servers):
    """Issue 39 item 1: a producer's reset names the generation its workers mark as retired; a
    decode asks every worker whether a generation is retired: any worker that reads the marker,
    or that does not answer, makes it so (a recompute, never stale KV)."""
    handlers = [FixedHits(0), FixedHits(0)]
    client = LookupClient(servers(*handlers), timeout_s=5.0)
    old, new = b"\x01" * 16, b"\x02" * 16
    assert client.clear(new, retire=old) and [h.retired_to for h in handlers] == [[old]] * 2
    assert client.clear(new) and [h.retired_to[-1] for h in handlers] == [None] * 2
    assert not client.retired(old)
    handlers[1].markers.add(old)
    assert client.retired(old) and not client.retired(new)
    client.close()


def test_a_silent_worker_makes_a_generation_retired(servers):
    client = LookupClient(servers(FixedHits(0), FixedHits(0, delay_s=0.6)), timeout_s=0.2)
    assert client.retired(b"\x01" * 16)  # unknown: a recompute, never stale KV
    client.close()


def test_a_silent_worker_is_a_miss_and_late_answers_are_ignored(servers):
    client = LookupClient(servers(FixedHits(512), FixedHits(512, delay_s=0.6)), timeout_s=0.2)
    assert client.lookup(np.arange(100)) == 0
    assert client.num_timeouts == 1
    time.sleep(0.7)  # the late answer arrives and must not be taken for the next question
    client.timeout_s = 5.0
    assert client.lookup(np.arange(100)) == 512
    client.close()


def test_server_survives_garbage(servers, tmp_path):
    (address,) = servers(FixedHits(64))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    import pickle  # the payload only: the server must never unpickle it

    garbage = [b"\x00\xff", pickle.dumps({"id": 1, "op": "lookup"}), msgpack.packb([1, 2]),
               msgpack.packb({"id": 2, "op": "lookup", "tokens": b"abc"}), msgpack.packb({"id": 3, "op": "nope"}),
               msgpack.packb({"id": 4, "op": "lookup", "tokens": msgpack.ExtType(1, b"x")}),
               msgpack.packb({"id": 5, "op": "lookup", "tokens": b"\0" * 8, "ns": "a str"}),
               msgpack.packb({"id": 6, "op": "lookup", "tokens": b"\0" * 8, "ns": b"n" * 4097})]
    for g in garbage:
        sock.send(g)
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["ok"] is False
    sock.close(linger=0)
    ctx.term()
    client = LookupClient([address], timeout_s=5.0)
    assert client.lookup(np.arange(10)) == 64  # still serving
    client.close()


@pytest.mark.parametrize("bad", ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://127.0.0.1", "http://x", "ipc://"])
def test_only_ipc_or_loopback_addresses(bad):
    with pytest.raises(ConfigError):
        check_address(bad)


def test_rank_addresses():
    assert rank_address("ipc:///tmp/k", 3) == "ipc:///tmp/k-3"
    assert rank_address("tcp://127.0.0.1:7000", 2) == "tcp://127.0.0.1:7002"


# --- scheduler ---------------------------------------------------------------------------
def _view(n: int, req_id: str = "r", num_tokens: int | None = None, cacheable: bool = True, namespace: bytes = b"") -> RequestView:
    return RequestView(req_id, np.arange(n, dtype=np.int64) + 3, num_tokens if num_tokens is not None else n, cacheable,
                       namespace)


def test_hits_leave_a_token_and_count_beyond_vllms_own():
    sched = KVConnectScheduler(FixedHits(512), chunk_tokens=CHUNK)
    assert sched.num_new_matched_tokens(_view(512), 0) == (511, True)  # whole prompt: one token left
    assert sched.num_new_matched_tokens(_view(537), 0) == (512, True)
    assert sched.num_new_matched_tokens(_view(537), 128) == (384, True)
    assert sched.num_new_matched_tokens(_view(537), 512) == (0, False)
    assert sched.num_new_matched_tokens(_view(60), 0) == (0, False)  # shorter than a chunk
    assert sched.num_new_matched_tokens(_view(537, cacheable=False), 0) == (0, False)


class AllStored:
    """A tier that holds every whole chunk of whatever it is asked about (what the lookup is asked is the point)."""

    def lookup(self, tokens, namespace=b"", generation=None, media=()):
        return len(tokens) // CHUNK * CHUNK


@pytest.mark.parametrize("skip, hit", [(0, 576), (24, 576), (25, 512), (100, 448), (600, 0)])
def test_skip_last_n_tokens_leaves_the_prompts_last_tokens_out_of_the_lookup(skip, hit):
    """LMCache's vLLM key: the lookup is asked about the prompt without its last N tokens."""
    sched = KVConnectScheduler(AllStored(), chunk_tokens=CHUNK, skip_last_n_tokens=skip)
    assert sched.num_new_matched_tokens(_view(600), 0) == (hit, hit > 0)


def test_a_load_is_planned_once_with_vllms_counts():
    sched = KVConnectScheduler(FixedHits(512), chunk_tokens=CHUNK)
    req = _view(537)
    assert sched.num_new_matched_tokens(req, 128) == (384, True)
    sched.after_alloc(req, ((1, 2, 3),), num_computed=0, num_external=384)
    plan = sched.build_plan({}, lambda r: 0, lambda r: None)
    (load,) = plan.loads
    assert (load.present_tokens, load.end_tokens, len(load.tokens), load.block_ids) == (128, 512, 512, ((1, 2, 3),))
    assert sched.build_plan({}, lambda r: 0, lambda r: None).loads == ()


def test_trimmed_hit_loads_whole_chunks_only():
    sched = KVConnectScheduler(FixedHits(512), chunk_tokens=CHUNK)
    req = _view(600)
    sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, ((1,),), num_computed=0, num_external=480)  # vLLM kept 480 of 512
    (load,) = sched.build_plan({}, lambda r: 0, lambda r: None).loads
    assert (len(load.tokens), load.end_tokens) == (448, 480)  # the worker reports [448, 480) as failed


def test_saves_follow_the_chunks_each_step_completes():
    sched = KVConnectScheduler(FixedHits(0), chunk_tokens=CHUNK)
    req = _view(300)
    sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, (), num_computed=0, num_external=0)
    computed = {"r": 0}
    ids = lambda r: ((7, 8),)  # noqa: E731
    stored = []
    for step_tokens in [100, 100, 100]:
        plan = sched.build_plan({"r": step_tokens}, lambda r: computed[r], ids)
        computed["r"] += step_tokens
        stored.append([(len(s.tokens), s.stored_tokens) for s in plan.saves])
    # chunks end at 64, 128, 192, 256: saved in the step that completes them; 300 % 64 is never stored
    assert stored == [[(64, 0)], [(192, 64)], [(256, 192)]]
    assert sched.request_finished("r") is True  # saved in the latest plan: blocks held
    assert sched.build_plan({}, lambda r: 0, ids).finished == ("r",)


@pytest.mark.parametrize("save_unfull", [False, True])
def test_decode_chunks_are_saved_in_the_step_that_completes_them(save_unfull):
    sched = KVConnectScheduler(FixedHits(0), chunk_tokens=CHUNK, save_unfull_chunk=save_unfull, save_decode_cache=True)
    req = _view(100)
    sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, (), num_computed=0, num_external=0)
    outputs = np.arange(1000, 1100, dtype=np.int64)
    reads = []

    def tokens_of(req_id):  # prompt + the outputs sampled so far, as vLLM's all_token_ids
        reads.append(computed["r"])
        return np.concatenate([req.prompt_tokens, outputs[: computed["r"] + 1 - 100]])

    computed = {"r": 0}
    jobs = []
    for step_tokens in [100] + [1] * 60:  # prefill, then one token per decode step
        plan = sched.build_plan({"r": step_tokens}, lambda r: computed[r], lambda r: ((1, 2, 3),), tokens_of)
        computed["r"] += step_tokens
        jobs += [(len(j.tokens), j.stored_tokens) for j in plan.saves]
        for job in plan.saves:
            assert np.array_equal(job.tokens[:100], req.prompt_tokens[: len(job.tokens)])
            assert np.array_equal(job.tokens[100:], outputs[: max(0, len(job.tokens) - 100)])
    prefill = [(100, 0)] if save_unfull else [(64, 0)]
    assert jobs == prefill + [(128, 64)]  # the decode step computing token 127 completes chunk 1
    assert reads == [127]  # token ids are read only in the step a chunk completes


def test_decode_chunks_are_not_saved_by_default():
    sched = KVConnectScheduler(FixedHits(0), chunk_tokens=CHUNK)
    req = _view(100)
    sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, (), num_computed=0, num_external=0)
    never = lambda r: pytest.fail("token ids read without save_decode_cache")  # noqa: E731
    saves = [sched.build_plan({"r": 100}, lambda r: 0, lambda r: ((1,),), never).saves]
    saves += [sched.build_plan({"r": 1}, lambda r: 100 + i, lambda r: ((1,),), never).saves for i in range(40)]
    assert [len(j.tokens) for s in saves for j in s] == [64]


def test_finished_requests_are_held_only_while_a_save_of_theirs_may_run():
    """Workers land a save of plan s before the forward of plan s + SAVE_SLACK_STEPS; blocks
    freed now go to the next plan at the earliest, so only a request whose last save is more
    recent than that keeps its blocks (and is reported by the workers in the next plan)."""
    sched = KVConnectScheduler(FixedHits(0), chunk_tokens=CHUNK)
    names = ("recent", "old", "short", "preempted")
    for rid in names:
        req = _view(40 if rid == "short" else 128, rid)
        sched.num_new_matched_tokens(req, 0)
        sched.after_alloc(req, (), num_computed=0, num_external=0)
    plan = sched.build_plan({rid: 128 for rid in names}, lambda r: 0, lambda r: ((1, 2),))
    assert plan.step == 1 and not plan.idle
    assert sorted(j.req_id for j in plan.saves) == ["old", "preempted", "recent"]
    decode = {rid: 1 for rid in names if rid != "preempted"}
    plan = sched.build_plan(decode, lambda r: 128, lambda r: ((1, 2),), preempted={"preempted"})
    assert plan.preempted == ("preempted",) and plan.saves == () and plan.step == 2
    assert sched.request_finished("recent") is True  # saved in plan 1 <= 2 + 1 - SAVE_SLACK_STEPS is false
    assert sched.request_finished("short") is False  # never saved
    assert sched.request_finished("preempted") is False  # its saves landed in the preempting step
    plan = sched.build_plan({}, lambda r: 0, lambda r: None)
    assert plan.finished == ("recent",) and plan.idle and plan.step == 3
    while sched._step + 1 - SAVE_SLACK_STEPS < 1:  # plan 1's saves land before the next plan
        sched.build_plan({"old": 1}, lambda r: 128, lambda r: ((1, 2),))
    assert sched.request_finished("old") is False


def test_a_requests_namespace_reaches_its_lookup_load_and_saves():
    hits = FixedHits(128)
    sched = KVConnectScheduler(hits, chunk_tokens=CHUNK)
    req = _view(300, namespace=b"tenant")
    assert sched.num_new_matched_tokens(req, 0) == (128, True)
    sched.after_alloc(req, ((1, 2),), num_computed=0, num_external=128)
    plan = sched.build_plan({"r": 172}, lambda r: 128, lambda r: ((1, 2, 3, 4, 5),))
    assert hits.namespaces == [b"tenant"]
    assert [j.namespace for j in plan.loads] == [b"tenant"] and [j.namespace for j in plan.saves] == [b"tenant"]


def test_worker_keeps_namespaces_apart():
    layout = KVLayout.from_tensors({"l": torch.randn(NB, 2, BS, 16)}, groups=[GroupSpec(block_size=BS)], layout_hints="page")
    worker = _worker(Translation(layout, (0,), 1, ("l",)))
    tokens = np.arange(128, dtype=np.int64)
    _step(worker, StepPlan(saves=(SaveJob("a", tokens, ((1, 2, 3, 4),), 0, b"tenant-a"),)))
    worker.drain()
    assert worker.lookup(tokens, b"tenant-a") == 128
    assert worker.lookup(tokens) == 0 and worker.lookup(tokens, b"tenant-b") == 0
    job = LoadJob("b", tokens, ((5, 6, 7, 8),), present_tokens=0, end_tokens=127, namespace=b"tenant-b")
    _, loaded, _ = _step(worker, StepPlan(loads=(job,)))
    assert loaded == {"b"} and worker.take_load_error_blocks() == {5, 6, 7, 8}  # a miss: recompute
    worker.close()


def test_uncacheable_requests_are_never_saved():
    sched = KVConnectScheduler(FixedHits(0), chunk_tokens=CHUNK)
    req = _view(256, cacheable=False)
    sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, (), num_computed=0, num_external=0)
    assert sched.build_plan({"r": 256}, lambda r: 0, lambda r: ((1,),)).saves == ()


# --- worker ------------------------------------------------------------------------------
NB, BS = 16, 32


@dataclass
class Hybrid:
    """A vLLM-CPU-like hybrid: a window group and a full group of page planes."""

    full: torch.Tensor
    swa: torch.Tensor
    translation: Translation


def _hybrid(window: int = 64) -> Hybrid:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(NB, 2, BS, 16, generator=g)
    swa = torch.randn(NB, 2, BS, 16, generator=g)
    groups = [GroupSpec(block_size=BS, sliding_window=window, restore_window=window - 1), GroupSpec(block_size=BS)]
    layout = KVLayout.from_tensors({"swa": swa, "full": full}, groups=groups, layer_groups={"swa": 0, "full": 1},
                                   layout_hints="page")
    return Hybrid(full, swa, Translation(layout, source_groups=(0, 1), num_vllm_groups=2, layer_names=("swa", "full")))


def _worker(t: Translation) -> KVConnectWorker:
    worker = KVConnectWorker(Config(chunk_size=CHUNK, max_local_cpu_size=0.01), None)
    worker.register(t)
    return worker


def _step(worker: KVConnectWorker, plan: StepPlan, finished=()):
    worker.begin_step(plan)
    worker.load(plan)
    worker.save(plan)
    return worker.transfer_results(set(finished))


def test_worker_saves_windows_and_restores_into_new_blocks():
    h = _hybrid()
    worker = _worker(h.translation)
    tokens = np.arange(256, dtype=np.int64) + 11
    # prefill in two steps; window blocks (group 0) before the window are freed (0) in step 2
    _step(worker, StepPlan(saves=(SaveJob("a", tokens[:128], ((1, 2, 3, 4), (1, 2, 3, 4)), 0),)))
    _step(worker, StepPlan(saves=(SaveJob("a", tokens[:256], ((0, 0, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 5, 6, 7, 8)), 128),)))
    worker.drain()
    assert worker.lookup(tokens) == 256

    full0, swa0 = h.full.clone(), h.swa.clone()
    new_full = (9, 10, 11, 12, 13, 14, 15, 1)
    new_swa = (0, 0, 0, 0, 0, 0, 14, 15)  # vLLM only allocates the window's blocks
    saved, loaded, failed = _step(worker, StepPlan(loads=(LoadJob("b", tokens[:256], (new_swa, new_full), 0, 255),)))
    assert loaded == {"b"} and not failed and not worker.take_load_error_blocks()
    # full group: all 8 pages; window group: the last two pages (tokens 192..255 need 63 back)
    full_src, full_dst = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 1]
    for s, d in zip(full_src, full_dst):
        assert torch.equal(h.full[d], full0[s])
    assert torch.equal(h.swa[14], swa0[7]) and torch.equal(h.swa[15], swa0[8])
    untouched = [b for b in range(NB) if b not in (14, 15)]
    assert torch.equal(h.swa[untouched], swa0[untouched])
    assert worker.stats()["loaded_tokens"] == 256
    worker.close()


def test_worker_never_writes_into_blocks_vllm_already_holds():
    h = _hybrid()
    worker = _worker(h.translation)
    tokens = np.arange(256, dtype=np.int64) + 5
    _step(worker, StepPlan(saves=(SaveJob("a", tokens, ((1, 2, 3, 4, 5, 6, 7, 8),) * 2, 0),)))
    worker.drain()
    # vLLM holds tokens [0, 96) itself (blocks 9..11 of the full group): a chunk boundary is at 64
    full0 = h.full.clone()
    ids_full = (9, 10, 11, 12, 13, 14, 15, 1)
    job = LoadJob("b", tokens, ((0, 0, 0, 0, 0, 0, 14, 15), ids_full), present_tokens=96, end_tokens=255)
    _, loaded, failed = _step(worker, StepPlan(loads=(job,)))
    assert loaded == {"b"} and not failed
    assert torch.equal(h.full[9:12], full0[9:12])  # vLLM's own blocks: untouched
    for s, d in zip([4, 5, 6, 7, 8], [12, 13, 14, 15, 1]):
        assert torch.equal(h.full[d], full0[s])
    worker.close()


def test_failed_loads_are_reported_for_recompute():
    h = _hybrid()
    worker = _worker(h.translation)
    tokens = np.arange(256, dtype=np.int64)
    job = LoadJob("b", tokens, ((0, 0, 0, 0, 0, 0, 14, 15), (9, 10, 11, 12, 13, 14, 15, 1)), 0, 255)
    _, loaded, failed = _step(worker, StepPlan(loads=(job,)))  # nothing stored: a miss
    assert loaded == {"b"} and failed == {"b"}  # two vLLM groups: the request is reported
    assert worker.stats()["load_failures"] == 1
    worker.close()


def test_single_group_failures_name_blocks():
    layout = KVLayout.from_tensors({"l": torch.zeros(NB, 2, BS, 16)}, groups=[GroupSpec(block_size=BS)], layout_hints="page")
    worker = _worker(Translation(layout, (0,), 1, ("l",)))
    job = LoadJob("b", np.arange(128), ((3, 4, 5, 6),), present_tokens=32, end_tokens=127)
    _, loaded, failed = _step(worker, StepPlan(loads=(job,)))
    assert loaded == {"b"} and not failed
    assert worker.take_load_error_blocks() == {4, 5, 6}  # vLLM's own block 3 stays valid
    worker.close()


def test_worker_without_a_layout_answers_misses():
    worker = KVConnectWorker(Config(chunk_size=CHUNK), None)
    assert worker.lookup(np.arange(128)) == 0
    _, loaded, failed = _step(worker, StepPlan(loads=(LoadJob("x", np.arange(128), ((1, 2),), 0, 127),)))
    assert loaded == failed == {"x"}
    assert worker.stats()["enabled"] == 0
    worker.close()


# --- key generations (issue 26, item 6) --------------------------------------------------------
def test_the_channel_carries_the_schedulers_generation_and_refuses_a_bad_one(servers):
    handlers = [FixedHits(128), FixedHits(128)]
    addresses = servers(*handlers)
    client = LookupClient(addresses, timeout_s=5.0)
    gen = b"\x42" * 16
    assert client.clear(gen) and [h.cleared_to for h in handlers] == [[gen]] * 2  # every rank: the same one
    assert client.lookup(np.arange(100), generation=gen) == 128
    assert client.lookup(np.arange(100), generation=b"") == 128
    assert client.lookup(np.arange(100)) == 128
    assert [h.generations for h in handlers] == [[gen, b"", None]] * 2
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addresses[0])
    for bad in (b"x" * 15, b"x" * 17, "a str", 5):
        for op in ("lookup", "clear"):
            sock.send(msgpack.packb({"id": 9, "op": op, "tokens": b"\0" * 8, "gen": bad}))
            assert msgpack.unpackb(sock.recv(), raw=False)["ok"] is False
    sock.close(linger=0)
    ctx.term()
    assert handlers[0].cleared == 1 and len(handlers[0].generations) == 3  # nothing reached the handler
    client.close()


def test_saves_and_loads_name_their_generation_and_a_reset_moves_every_worker_to_the_schedulers():
    layout = KVLayout.from_tensors({"l": torch.randn(NB, 2, BS, 16)}, groups=[GroupSpec(block_size=BS)], layout_hints="page")
    worker = _worker(Translation(layout, (0,), 1, ("l",)))
    tokens = np.arange(128, dtype=np.int64)
    producer_gen, own_gen = b"\x01" * 16, b"\x02" * 16
    worker.clear(own_gen)  # (a reset empties this private pool: store after it)
    assert worker.engine.generation == own_gen
    _step(worker, StepPlan(saves=(SaveJob("p", tokens, ((1, 2, 3, 4),), 0, generation=producer_gen),)))
    worker.drain()
    assert worker.lookup(tokens) == 0  # its own generation: nothing
    assert worker.lookup(tokens, b"", b"") == 0 and worker.lookup(tokens, b"", producer_gen) == 128
    job = LoadJob("d", tokens, ((5, 6, 7, 8),), present_tokens=0, end_tokens=127, generation=producer_gen)
    _, loaded, failed = _step(worker, StepPlan(loads=(job,)))
    assert loaded == {"d"} and not failed and not worker.take_load_error_blocks()
    assert worker.stats()["loaded_tokens"] == 128
    with pytest.raises(Exception, match="key generation"):
        worker.engine.reset(b"short")
    worker.close()
