"""Mooncake faults that must never lose or mix shared data, against a real ``mooncake_master``.

Each test drives the fault at the point where it used to do harm: a master stalled (SIGSTOP)
after a lookup answered and before the read; one of a chunk's two objects evicted (removed
by another client, as Mooncake's eviction does, on demand so the test is deterministic);
an engine's model name from its Config; a tier closed after lookups. Every Mooncake RPC is
bounded at 2 s here (``MC_RPC_TIMEOUT_MS``, mooncake_master.CLIENT_ENV), so a stall costs
seconds, not Mooncake's default 30 s.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref

import numpy as np
import pytest

from support import zoo
from support.mooncake_master import client_env, mooncake_available
from mooncake_peer import HYBRID_CHUNK, HYBRID_TOKENS, hybrid_case, hybrid_engine, wait_connected
from mooncake_rig import SEED, SEGMENT, Peer, master, reader, stored, tier_of  # noqa: F401 (fixtures)

from kvconnect import KVCacheEngine

_REASON = mooncake_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
os.environ.update({k: v for k, v in client_env().items() if k.startswith(("MC_", "GLOG_"))})

RPC_BOUND_S = 2.0  # MC_RPC_TIMEOUT_MS of the tests


def _slots(engine, n: int) -> list[memoryview]:
    return [memoryview(engine.pool.slot_view(i).numpy()) for i in range(n)]


def _wait_healthy(tier, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not tier.healthy():
        assert time.monotonic() < deadline, "the tier did not recover"
        time.sleep(0.1)


def test_master_stalled_between_lookup_and_read_removes_nothing(stored, master, tmp_path):
    """The lookup answered, then the master stopped: the read returns within the RPC bound
    (not 30 s), is a miss, opens the breaker, and every chunk is still there afterwards."""
    _, _, engine, tokens, *_ = reader(master, tmp_path, timeout_s=1.0)
    tier = tier_of(engine)
    try:
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        assert all(m is not None for m in tier.masks(keys))  # the lookup answered
        master.pause()
        try:
            start = time.monotonic()
            headers = tier.read_many_into(keys, _slots(engine, len(keys)))
            elapsed = time.monotonic() - start
        finally:
            master.resume()
        assert elapsed < RPC_BOUND_S + 2.0, elapsed
        # Mooncake's client may serve a read it has just looked up without asking the master
        # (seen once in ~10 runs): a verified hit is fine; every miss must be a counted failure
        if any(h is None for h in headers):
            assert tier.counters["rpc_timeouts"] + tier.counters["rpc_failures"] + tier.counters["transfer_failures"] >= 1
        assert tier.stats().corrupt == 0  # a timeout says nothing about the bytes
        assert tier.counters["parts_missing"] == 0
        _wait_healthy(tier)
        headers = tier.read_many_into(keys, _slots(engine, len(keys)))
        assert all(h is not None for h in headers), headers  # every chunk survived, verified
        assert engine.lookup(tokens) == 3 * HYBRID_CHUNK
    finally:
        master.resume()
        engine.close()


def test_a_large_read_stops_at_its_deadline_when_the_master_stalls(stored, master, tmp_path):
    """A read of many batches meets a stalled master: it ends after one RPC bound (the breaker
    opened), not one bound per batch."""
    _, _, engine, tokens, *_ = reader(master, tmp_path, timeout_s=1.0)
    tier = tier_of(engine)
    try:
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        rng = np.random.default_rng(3)
        many = [type(keys[0])(rng.bytes(len(bytes(keys[0])))) for _ in range(4 * 64)]  # four batches
        out = _slots(engine, 1) * len(many)  # nothing is read into them: every key misses
        master.pause()
        try:
            start = time.monotonic()
            headers = tier.read_many_into(many, out)
            elapsed = time.monotonic() - start
        finally:
            master.resume()
        assert headers == [None] * len(many)
        assert elapsed < RPC_BOUND_S + 2.0, elapsed  # four batches would take four bounds
        assert tier.counters["cut_short"] >= 1
        _wait_healthy(tier)
        assert all(m is not None for m in tier.masks(keys))
    finally:
        master.resume()
        engine.close()


def test_a_chunk_whose_payload_was_evicted_is_no_longer_offered(stored, master, tmp_path):
    """Header and payload are two objects, evicted independently. A lookup checks both, and a
    read that finds the payload gone removes the header too: lookups stop at that chunk
    instead of offering it forever (a false hit every time)."""
    case, dst, engine, tokens, bounds, src_tables, rng = reader(master, tmp_path)
    tier = tier_of(engine)
    try:
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        assert all(m is not None for m in tier.masks(keys))
        _, payload1 = tier.object_keys(keys[1])
        assert Peer("remove", master.address, payload1).result["rc"] == [0]
        # a lookup checks both parts (and so leases both): it stops at chunk 1 at once
        assert engine.lookup(tokens) == HYBRID_CHUNK
        headers = tier.read_many_into(keys, _slots(engine, len(keys)))
        assert headers[0] is not None and headers[1] is None and headers[2] is not None
        assert tier.counters["parts_missing"] == 1 and tier.stats().corrupt == 0
        engine.storage.pool.clear()
        assert engine.lookup(tokens) == HYBRID_CHUNK  # chunk 1 is gone for every reader now
        header1, _ = tier.object_keys(keys[1])
        assert Peer("remove", master.address, header1).result["rc"] == [-704]  # removed by the read
        # the restore stops at the chunk before the evicted one, with the right bytes
        dst_tables = zoo.random_tables(case, HYBRID_TOKENS, rng, keep=zoo.restore_keep(case, HYBRID_CHUNK))
        expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, HYBRID_CHUNK)
        assert engine.retrieve(tokens, dst_tables) == HYBRID_CHUNK
        assert dst.first_difference(expected) is None
    finally:
        engine.close()


def test_a_chunk_whose_header_was_evicted_leaves_no_payload_behind(stored, master, tmp_path):
    _, _, engine, tokens, *_ = reader(master, tmp_path)
    tier = tier_of(engine)
    try:
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        assert all(m is not None for m in tier.masks(keys))  # masks remembered from the headers
        header2, payload2 = tier.object_keys(keys[2])
        assert Peer("remove", master.address, header2).result["rc"] == [0]
        headers = tier.read_many_into(keys, _slots(engine, len(keys)))
        assert headers[2] is None and tier.counters["parts_missing"] == 1
        assert Peer("remove", master.address, payload2).result["rc"] == [-704]  # removed by the read
        assert tier.masks(keys)[2] is None
    finally:
        engine.close()


def test_config_model_name_keeps_models_apart_on_the_shared_tier(master, tmp_path):
    """KVCONNECT_MODEL_NAME (Config.model_name) on the Python API: a fine-tune never reads the
    base model's chunks from the shared store, the base model does."""
    case, tokens, bounds, tables, _ = hybrid_case(SEED)
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"global_segment_size": SEGMENT, "protocol": "tcp"}))

    def engine(model: str) -> KVCacheEngine:
        config = zoo.small_config(HYBRID_CHUNK, remote_url=master.url, mooncake_config_path=str(path),
                                  remote_timeout_s=5.0, model_name=model)
        e = KVCacheEngine(case.clone(fill=0).layout(), config)
        assert wait_connected(e.storage.tiers[0])
        return e

    base = engine("base-model")
    try:
        assert base.store(tokens, tables) == 3 * HYBRID_CHUNK
        assert base.storage.flush(60)
        tuned, again = engine("finetuned-model"), engine("base-model")
        try:
            assert tuned.layout.fingerprint != base.layout.fingerprint
            assert tuned.lookup(tokens) == 0
            assert again.lookup(tokens) == 3 * HYBRID_CHUNK
        finally:
            tuned.close()
            again.close()
    finally:
        base.close()


def test_closing_the_tier_stops_its_threads_and_frees_it(master, tmp_path):
    """Create, look up, close, four times: no lookup or connect thread survives, and neither
    the tier nor its engine's pool stays reachable."""
    case, tokens, *_ = hybrid_case(SEED)

    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("kvconnect-mooncake")]

    assert ours() == []
    refs = []
    for i in range(4):
        engine = hybrid_engine(case.clone(fill=0), master.url, 0, str(tmp_path), timeout_s=2.0)
        tier = tier_of(engine)
        assert wait_connected(tier)
        rng = np.random.default_rng(i)
        fresh = zoo.random_tokens(rng, HYBRID_TOKENS)
        # several lookups at once so that more than one worker thread starts
        workers = [threading.Thread(target=engine.lookup, args=(fresh,)) for _ in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        refs.append((weakref.ref(tier), weakref.ref(engine.pool.buffer)))
        engine.close()
        del engine, tier, workers
    deadline = time.monotonic() + 10.0
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == []
    gc.collect()
    assert all(tier() is None and buffer() is None for tier, buffer in refs)


def test_writes_refused_while_the_master_stalls_are_retried_not_dropped(master, tmp_path):
    """A producer stores while the master is stalled: its write-behind puts fail (the breaker
    opens) and are queued again, still pinned; once the master answers they land, and a reader
    in another engine finds every chunk. Mooncake's own failure kinds reach the metrics."""
    from kvconnect.metrics.figures import engine_figures

    case, tokens, bounds, tables, _ = hybrid_case(SEED)
    producer = hybrid_engine(case, master.url, SEGMENT, str(tmp_path), timeout_s=1.0)
    tier = tier_of(producer)
    assert wait_connected(tier)
    writer = producer.storage.writers[0]
    try:
        master.pause()
        try:
            assert producer.store(tokens, tables) == 3 * HYBRID_CHUNK  # into the pool at once
            deadline = time.monotonic() + 20.0
            while writer.stats().retried == 0:  # the first put failed on the stalled master
                assert time.monotonic() < deadline, writer.stats()
                time.sleep(0.05)
        finally:
            master.resume()
        assert producer.storage.flush(30)
        stats = writer.stats()
        # every object the store queued landed: 3 prefix parts plus the window part's pieces at the
        # prompt's end (a restore point, docs/design.md)
        assert stats.submitted >= 3 and stats.written == stats.submitted, stats
        assert stats.failed == 0 and stats.retried >= 1, stats
        failures = tier.failure_counts()
        assert sum(failures.values()) >= 1, failures
        figures = engine_figures(producer)
        assert figures.get("kvconnect_write_retries_total", "mooncake") == stats.retried
        assert all(figures.get("kvconnect_tier_failures_total", "mooncake", kind) == n for kind, n in failures.items())
        reader = hybrid_engine(case.clone(fill=0), master.url, 0, str(tmp_path), timeout_s=5.0)
        try:
            assert wait_connected(tier_of(reader))
            assert reader.lookup(tokens) == 3 * HYBRID_CHUNK
        finally:
            reader.close()
    finally:
        master.resume()
        producer.close()


def test_an_overfilled_segment_leaves_no_chunk_offered_that_cannot_be_read(master, tmp_path):
    """Real evictions: ~105 MB of chunks into a 32 MiB segment. Mooncake evicts header and
    payload objects independently and refuses writes once full; whatever survives, a chunk a
    lookup offers after one read pass is a chunk that reads back whole and verified."""
    case, _, _, tables, _ = hybrid_case(SEED)
    engine = hybrid_engine(case, master.url, 32 << 20, str(tmp_path), timeout_s=5.0)
    tier = tier_of(engine)
    assert wait_connected(tier)
    try:
        keys = []
        for i in range(40):
            prompt = zoo.random_tokens(np.random.default_rng(100 + i), HYBRID_TOKENS)
            engine.store(prompt, tables)
            assert engine.storage.flush(30)
            keys += [c.key for c in engine.chunks(prompt, include_partial=False)]
            engine.storage.pool.clear()

        def offered() -> list:
            return [k for k, m in zip(keys, tier.masks(keys)) if m is not None]

        def read(batch: list) -> list:
            out = []
            for start in range(0, len(batch), 8):
                part = batch[start : start + 8]
                out += tier.read_many_into(part, _slots(engine, len(part)))
            return out

        first = offered()
        assert len(first) < len(keys)  # the segment could not hold them all
        # Which parts Mooncake evicted depends on timing: on a quiet machine it may have taken
        # both parts of every chunk it dropped. One offered chunk loses its payload here as an
        # eviction would, so the read pass meets at least one half-evicted chunk whatever the timing.
        planted = first[len(first) // 2]
        assert Peer("remove", master.address, tier.object_keys(planted)[1]).result["rc"] in ([0], [-704])  # -704: evicted already
        read(first)  # finds the chunks with a part evicted, and removes them
        assert tier.counters["parts_missing"] >= 1, tier.counters
        second = offered()
        assert second, "some chunks must survive"
        assert planted not in second
        headers = read(second)
        assert all(h is not None for h in headers), (sum(h is None for h in headers), len(second), tier.counters)
        assert tier.stats().corrupt == 0
    finally:
        engine.close()
