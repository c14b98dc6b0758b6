"""P/D with different TP sizes on the two sides (issue 40 item 3): what the decode side admits.

A producer's params name its TP size. The decode side waits for them only where every one of
its workers says it can restore what that size stored (``hits.tp_refusal``, one round trip,
remembered once every worker said yes); otherwise the params are refused by name, counted,
and the request does a plain lookup, before anything is probed or loaded.

Three levels, each against the real code below it: the engine's answer (``tp_read_refusal``)
on real ``KVCacheEngine`` layouts; the lookup channel's ``tp_refusal`` between a real
``LookupClient`` and real ``LookupServer`` sockets; ``PDScheduler`` over a stand-in for the
lookup channel (as tests/test_vllm_pd_units.py). The real engine's proof (a TP 1 producer and
a TP 2 decode side behind vLLM's router) is tests/integration/test_vllm_pd_mooncake.py and
test_vllm_pd.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvconnect import Config, KVCacheEngine
from kvconnect.integrations.vllm import pd, roles, transfer_params as tp
from kvconnect.integrations.vllm.lookup_channel import LookupClient, LookupServer, rank_address
from kvconnect.integrations.vllm.metadata import RequestView
from kvconnect.integrations.vllm.scheduler import KVConnectScheduler
from kvconnect.layout.kv_layout import KVLayout
from kvconnect.layout.spec import GroupSpec, TPShard
from kvconnect.restore import other_tp

CHUNK, BLOCK, BS, NB = 64, 32, 16, 8
PROMPT = np.arange(3, 303, dtype=np.int64)  # 300 tokens: 288 stored by the producer (9 blocks)


# -- the engine's answer --------------------------------------------------------------------------
def _layout(tp_rank: int, tp_size: int, *, heads: int = 2, shard=None) -> KVLayout:
    """One GQA layer of ``heads`` global KV heads, this rank's part ([2, NB, BS, h, 8] rows)."""
    shard = shard or TPShard.of_kv_heads(heads, tp_rank=tp_rank, tp_size=tp_size)
    kv = torch.zeros(2, NB, BS, shard.count, 8, dtype=torch.float16)
    return KVLayout.from_tensors({"l0": kv}, groups=[GroupSpec(block_size=BS)], layout_hints="kv_first", model_name="m",
                                 tp_rank=tp_rank, tp_size=tp_size, group_shards=[shard])


def _engine(layout: KVLayout, tmp_path, **kw) -> KVCacheEngine:
    return KVCacheEngine(layout, Config(chunk_size=32, max_local_cpu_size=0.01, local_disk=str(tmp_path),
                                        max_local_disk_size=0.02, pool_prefault=False, **kw))


def test_a_gqa_rank_reads_the_producers_tp_sizes_that_split_its_heads(tmp_path):
    for reader, writer in ((2, 1), (1, 2), (2, 2), (4, 2), (2, 4)):
        engine = _engine(_layout(0, reader, heads=4), tmp_path)
        try:
            assert engine.tp_read_refusal(writer) is None, (reader, writer)
        finally:
            engine.close()
    engine = _engine(_layout(0, 2, heads=4), tmp_path)
    try:
        assert "does not split KV-cache group 0's 4 KV heads" in engine.tp_read_refusal(3)
    finally:
        engine.close()


def test_what_cannot_be_read_across_sizes_is_named(tmp_path):
    ranked = _engine(_layout(0, 2, shard=TPShard.rank(0, 2)), tmp_path)  # a group kvconnect keys by rank
    off = _engine(_layout(0, 2), tmp_path, read_tp_sizes="4")  # reads across sizes limited to TP 4
    no_tier = KVCacheEngine(_layout(1, 2), Config(chunk_size=32, max_local_cpu_size=0.01, pool_prefault=False))
    try:
        assert "split over TP ranks in a way kvconnect keys by rank" in ranked.tp_read_refusal(1)
        assert ranked.tp_read_refusal(2) is None  # its own size: its own objects
        assert "read_tp_sizes (KVCONNECT_READ_TP_SIZES) does not list TP 1" in off.tp_read_refusal(1)
        assert "no node server or lower tier" in no_tier.tp_read_refusal(1)
    finally:
        for e in (ranked, off, no_tier):
            e.close()


def test_layout_level_refusals():
    assert other_tp.refusal(_layout(0, 2), 2) is None
    assert other_tp.refusal(_layout(1, 2), 1) is None
    # one KV head at TP 2: both ranks hold head 0, the objects of a TP 1 writer are each rank's own
    one_head = _layout(1, 2, heads=1)
    assert other_tp.refusal(one_head, 1) is None and other_tp.sources_at(one_head, 1) is None
    replicated = KVLayout.from_tensors({"mla": torch.zeros(NB, BS, 72, dtype=torch.uint8)}, groups=[GroupSpec(block_size=BS)],
                                       model_name="mla", tp_rank=0, tp_size=2, group_shards=[TPShard.replicated()])
    assert other_tp.refusal(replicated, 8) is None  # TP-free objects: the same name at every size


# -- the lookup channel -----------------------------------------------------------------------------
class Worker:
    """A worker's answer to ``tp_refusal``: ``refuses`` maps TP sizes to its reason."""

    def __init__(self, refuses: dict) -> None:
        self.refuses, self.asked = refuses, []

    def lookup(self, tokens, namespace=b"", generation=None, media=()):
        return 0

    def stats(self):
        return {}

    def clear(self, generation=None, retire=None):
        pass

    def retired(self, generation):
        return False

    def tp_refusal(self, tp_size):
        self.asked.append(tp_size)
        return self.refuses.get(tp_size, "")


def test_the_channel_names_the_first_worker_that_cannot_read_a_size(tmp_path):
    base = f"ipc://{tmp_path}/kvc"
    workers = [Worker({}), Worker({4: "TP 4 does not split KV-cache group 0's 2 KV heads" + "!" * 400})]
    servers = [LookupServer(rank_address(base, i), w) for i, w in enumerate(workers)]
    client = LookupClient([rank_address(base, i) for i in range(2)], timeout_s=5.0)
    try:
        assert client.tp_refusal(1) is None
        why = client.tp_refusal(4)
        assert why.startswith("worker 1: TP 4 does not split") and len(why) < 300  # clipped under the wire's cap
        assert [w.asked for w in workers] == [[1, 4], [1, 4]]
        client.timeout_s = 0.2
        servers[1].close()
        servers.pop()
        assert client.tp_refusal(1) == "worker 1 did not answer whether it reads TP 1's chunks"
    finally:
        client.close()
        for s in servers:
            s.close()


# -- the decode side's admission ------------------------------------------------------------------
class TierHits:
    """The lookup channel over a shared tier holding the producer's chunks of PROMPT up to
    ``restorable`` (read across TP sizes by the workers, as their engines do), and the workers'
    answer to ``tp_refusal``."""

    def __init__(self) -> None:
        self.restorable = 0
        self.refusal = None
        self.lookups: list[tuple[int, bool]] = []
        self.tp_asked: list[int] = []

    def lookup(self, tokens, namespace=b"", *, count=True, generation=None, media=()):
        self.lookups.append((len(tokens), count))
        self.clock.t += 1.0
        return min(self.restorable, len(tokens))

    def clear(self, generation=None, retire=None):
        return True

    def retired(self, generation):
        return False

    def tp_refusal(self, tp_size):
        self.tp_asked.append(tp_size)
        return self.refusal

    def close(self):
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _decode_side(tp_size: int):
    policy = roles.role_policy("kv_consumer", Config(server_url="ipc:///tmp/kvc-unit.sock"))
    hits = TierHits()
    sched = KVConnectScheduler(hits, chunk_tokens=CHUNK, min_load_tokens=CHUNK, role=policy, tail_align_tokens=BLOCK)
    clock = Clock()
    server = pd.PDScheduler(sched, policy, pd.ServerIdentity(chunk_tokens=CHUNK, tp_size=tp_size, model="m"),
                            wait_timeout_s=5.0, poll_interval_s=0.01, clock=clock)
    hits.clock = clock  # every probe comes a second later (the tests never wait out a probe interval)
    return server, hits


def _params(producer_tp: int) -> dict:
    return tp.StoredPrefill(tokens=288, chunk_tokens=CHUNK, tp_size=producer_tp, prompt_digest=tp.prompt_digest(PROMPT),
                            model="m", engine_id="p").to_params()


def test_a_tp2_decode_side_waits_for_and_loads_a_tp1_producers_prompt():
    server, hits = _decode_side(2)
    req = RequestView("r1", PROMPT, len(PROMPT))
    assert server.num_new_matched_tokens(req, 0, _params(1)) == (None, False)  # asked, then a probe: not landed yet
    assert hits.tp_asked == [1] and hits.lookups == [(288, False)]
    hits.restorable = 288  # every head range each rank needs is there (the workers' gate)
    assert server.num_new_matched_tokens(req, 0, _params(1)) == (288, True)
    assert server.counters["remote_prefill_other_tp"] == 1 == server.counters["remote_prefill_ready"]
    assert server.counters["remote_prefill_rejected"] == 0
    # the size is remembered: the next request's admission asks nothing
    assert server.num_new_matched_tokens(RequestView("r2", PROMPT, len(PROMPT)), 0, _params(1)) == (288, True)
    assert hits.tp_asked == [1] and server.counters["remote_prefill_other_tp"] == 2


def test_the_reverse_and_equal_sizes_by_the_same_code():
    server, hits = _decode_side(1)
    hits.restorable = 288
    assert server.num_new_matched_tokens(RequestView("r", PROMPT, len(PROMPT)), 0, _params(2)) == (288, True)
    assert hits.tp_asked == [2] and server.counters["remote_prefill_other_tp"] == 1
    same, hits = _decode_side(2)
    hits.restorable = 288
    assert same.num_new_matched_tokens(RequestView("r", PROMPT, len(PROMPT)), 0, _params(2)) == (288, True)
    assert hits.tp_asked == [] and same.counters["remote_prefill_other_tp"] == 0  # equal sizes: nothing to ask


def test_a_size_the_workers_cannot_read_is_refused_by_name_before_anything_is_probed(caplog):
    server, hits = _decode_side(2)
    hits.refusal = "worker 0: KV-cache group(s) [1] are split over TP ranks in a way kvconnect keys by rank"
    hits.restorable = 0  # what a plain lookup finds on workers that cannot read the producer's objects
    req = RequestView("r", PROMPT, len(PROMPT))
    with caplog.at_level(logging.WARNING, logger="kvconnect"):
        assert server.num_new_matched_tokens(req, 0, _params(1)) == (0, False)  # the plain lookup's answer
    assert hits.lookups == [(len(PROMPT), True)]  # one plain lookup, no probe of the producer's prefix
    assert server.counters["remote_prefill_rejected"] == 1 and server.counters["remote_prefills"] == 0
    assert server.num_waiting == 0
    message = caplog.records[-1].getMessage()
    assert "the producer runs TP 1, this server TP 2" in message and "keys by rank" in message
    # a refusal is not remembered (a silent worker may answer next time): asked again
    server.num_new_matched_tokens(RequestView("r2", PROMPT, len(PROMPT)), 0, _params(1))
    assert hits.tp_asked == [1, 1] and server.counters["remote_prefill_rejected"] == 2


def test_params_naming_another_model_are_refused_without_asking_about_tp():
    server, hits = _decode_side(2)
    params = _params(1)
    params["kvconnect"]["model"] = "other"
    server.num_new_matched_tokens(RequestView("r", PROMPT, len(PROMPT)), 0, params)
    assert hits.tp_asked == [] and server.counters["remote_prefill_rejected"] == 1


@pytest.mark.parametrize("producer_tp", [1, 2, 4])
def test_stored_prefill_keeps_naming_the_producers_tp_size(producer_tp):
    assert tp.remote_prefill(_params(producer_tp)).tp_size == producer_tp
