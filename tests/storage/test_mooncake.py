"""The Mooncake tier against a real ``mooncake_master`` on loopback, with data in other processes.

Every test starts its own master (tests/support/mooncake_master.py). Segments are held by
separate processes (tests/storage/mooncake_peer.py): an engine that stored a hybrid
prompt, or kvconnect's node-level holder, so reads in this process cross the transfer
engine as they would between machines.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvconnect.chunks import chunk_format
from support import zoo
from support.mooncake_master import MooncakeMaster, NodeHolder, client_env, mooncake_available
from mooncake_peer import HYBRID_CHUNK, HYBRID_TOKENS, hybrid_case, hybrid_engine, wait_connected
from mooncake_rig import SEED, SEGMENT, Peer, master, reader, stored, tier_of  # noqa: F401 (fixtures)

_REASON = mooncake_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
os.environ.update({k: v for k, v in client_env().items() if k.startswith(("MC_", "GLOG_"))})

def test_hybrid_layout_round_trips_byte_exact_between_processes(stored, master, tmp_path):
    case, dst, engine, tokens, bounds, src_tables, rng = reader(master, tmp_path)
    try:
        boundary = engine.lookup(tokens)
        assert boundary == 3 * HYBRID_CHUNK
        dst_tables = zoo.random_tables(case, HYBRID_TOKENS, rng, keep=zoo.restore_keep(case, boundary))
        expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, boundary)
        assert engine.retrieve(tokens, dst_tables) == boundary
        assert dst.first_difference(expected) is None
        stats = tier_of(engine).stats()
        # 3 prefix parts and the window pieces of the one restore point used (kvconnect/restore/parts.py)
        assert engine.stats.window_pieces_retrieved > 0
        assert stats.get_hits == 3 + engine.stats.window_pieces_retrieved and stats.corrupt == 0 and stats.errors == 0
        assert tier_of(engine).counters["registered_bytes"] >= engine.pool.num_slots * engine.pool.slot_bytes
        # masks come from the header objects: identical to what the storing engine recorded
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        assert all(m is not None and m > 0 for m in tier_of(engine).masks(keys))
    finally:
        engine.close()


def test_get_returns_the_chunks_a_peer_stored_and_removes_nothing(stored, master, tmp_path):
    """``get`` (what a rank of another TP size reads a writer's objects with, restore/other_tp_reads.py)
    reads the header object apart from its payload: it returns each whole encoded chunk, verified,
    and a read never counts it corrupt nor removes it (it once parsed the header object as a whole
    chunk, called every chunk corrupt and removed the writer's objects)."""
    _, _, engine, tokens, *_ = reader(master, tmp_path)
    tier = tier_of(engine)
    try:
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        got = tier.get(keys)
        assert all(d is not None for d in got)
        for key, data in zip(keys, got):
            header, payload = chunk_format.decode(data, fingerprint=tier.fingerprint, key=key)
            assert header.payload_bytes == len(payload) > 0
        stats = tier.stats()
        assert stats.get_hits == len(keys) and stats.corrupt == 0 and stats.errors == 0
        assert all(m is not None for m in tier.masks(keys))  # still there
    finally:
        engine.close()


def test_another_model_identity_misses(stored, master, tmp_path):
    _, _, engine, tokens, *_ = reader(master, tmp_path, model="another-model")
    try:
        assert engine.lookup(tokens) == 0
        assert tier_of(engine).stats().lookup_hits == 0
    finally:
        engine.close()


def test_foreign_values_under_kvconnect_names_are_misses(stored, master, tmp_path):
    _, _, engine, tokens, *_ = reader(master, tmp_path)
    tier = tier_of(engine)
    try:
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        header0, _ = tier.object_keys(keys[0])
        _, payload1 = tier.object_keys(keys[1])
        for name, size in ((header0, 200), (payload1, 4096)):
            assert Peer("put-foreign", master.address, name, str(size)).result["rc"] == 0
        masks = tier.masks(keys)
        assert masks[0] is None and masks[1] is not None and masks[2] is not None
        out = memoryview(engine.pool.slot_view(0).numpy())
        assert tier.read_into(keys[1], out) is None  # right header, foreign payload: checksum
        assert tier.stats().corrupt == 2
        assert tier.masks(keys)[:2] == [None, None]  # both removed, the third chunk untouched
        assert engine.lookup(tokens) == 0  # the prefix breaks at chunk 0
    finally:
        engine.close()


def test_a_followers_reads_remove_nothing(stored, master, tmp_path):
    """A follower (a TP replica, a rank reading another TP size's objects: ``removes=False``)
    counts a foreign value a miss and leaves it in place; the writer's own tier removes it."""
    from kvconnect.storage.mooncake.tier import MooncakeTier

    _, _, engine, tokens, *_ = reader(master, tmp_path)
    tier = tier_of(engine)
    follower = MooncakeTier(tier.spec, tier.fingerprint, timeout_s=5.0, removes=False)
    try:
        assert wait_connected(follower)
        key = engine.chunks(tokens, include_partial=False)[1].key
        assert Peer("put-foreign", master.address, tier.object_keys(key)[1], "4096").result["rc"] == 0
        assert follower.get([key]) == [None]
        assert follower.stats().corrupt == 1
        assert follower.masks([key])[0] is not None  # still there
        assert tier.read_into(key, memoryview(engine.pool.slot_view(0).numpy())) is None
        assert tier.masks([key]) == [None]  # the writer's tier removed it
    finally:
        follower.close()
        engine.close()


def test_killed_master_costs_misses_not_exceptions(stored, master, tmp_path):
    """A killed master: lookups miss within the timeout, then at once (breaker); nothing raises.
    Restarted (every key lost), the clients re-register by themselves and the tier serves again."""
    case, _, engine, tokens, bounds, src_tables, rng = reader(master, tmp_path, timeout_s=2.0)
    try:
        assert engine.lookup(tokens) == 3 * HYBRID_CHUNK
        master.kill()
        start = time.monotonic()
        fresh = zoo.random_tokens(np.random.default_rng(99), HYBRID_TOKENS)
        assert engine.lookup(fresh) == 0
        first = time.monotonic() - start
        assert first < 2.0 + 1.0  # remote_timeout_s bounds the lookup on the step path
        start = time.monotonic()
        for _ in range(5):
            assert engine.lookup(fresh) == 0  # the breaker skips the tier: no timeout each time
        assert time.monotonic() - start < 1.0
        tier = tier_of(engine)
        assert tier.counters["timeouts"] + tier.counters["rpc_failures"] + tier.counters["rpc_timeouts"] >= 1
        assert not tier.healthy()
        assert engine.store(fresh, src_tables) == 3 * HYBRID_CHUNK  # into the pool; the tier write fails
        assert engine.storage.flush(30)

        master.start()  # same port, empty
        deadline = time.monotonic() + 120.0  # re-registration took over 60 s with engines loading both cores
        hit = 0
        while hit == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            engine.storage.pool.clear()
            engine.store(fresh, src_tables)
            engine.storage.flush(30)
            engine.storage.pool.clear()
            hit = engine.lookup(fresh)
        assert hit == 3 * HYBRID_CHUNK  # written to the store again and found there
        assert tier.healthy()
    finally:
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 15.0


def test_stalled_master_bounds_the_step(stored, master, tmp_path):
    """A master that accepts but never answers (SIGSTOP): each lookup returns within
    remote_timeout_s, then the breaker skips the tier; resumed, the tier serves again."""
    _, _, engine, tokens, *_ = reader(master, tmp_path, timeout_s=2.0)
    tier = tier_of(engine)
    try:
        engine.storage.pool.clear()
        assert engine.lookup(tokens) == 3 * HYBRID_CHUNK
        engine.storage.pool.clear()
        master.pause()
        fresh = zoo.random_tokens(np.random.default_rng(7), HYBRID_TOKENS)
        start = time.monotonic()
        for _ in range(6):
            t0 = time.monotonic()
            assert engine.lookup(fresh) == 0
            assert time.monotonic() - t0 < 2.0 + 1.0  # at most remote_timeout_s on the step path
        assert time.monotonic() - start < 2.0 + 1.5  # one lookup pays the timeout, the breaker spares the rest
        # abandoned by the tier (timeouts) or answered -901 by Mooncake's own RPC bound (rpc_timeouts)
        assert tier.counters["timeouts"] + tier.counters["rpc_timeouts"] >= 1
        master.resume()
        deadline = time.monotonic() + 60.0
        while engine.lookup(tokens) == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert engine.lookup(tokens) == 3 * HYBRID_CHUNK
    finally:
        master.resume()
        engine.close()


def test_absent_master_start_is_immediate_and_joins_later(tmp_path):
    from support.redis_server import free_port

    master = MooncakeMaster(tmp_path / "master", port=free_port())
    case, tokens, *_ = hybrid_case(SEED)
    start = time.monotonic()
    engine = hybrid_engine(case.clone(fill=0), master.url, SEGMENT, str(tmp_path), timeout_s=2.0)
    assert time.monotonic() - start < 5.0
    tier = tier_of(engine)
    try:
        start = time.monotonic()
        assert engine.lookup(tokens) == 0 and not tier.connected and not tier.healthy()
        assert tier.put([]) == [] and tier.delete([]) == []
        assert time.monotonic() - start < 1.0
        master.start()  # the master appears: the tier joins without a restart
        assert wait_connected(tier, 120.0)
        assert tier.healthy()
    finally:
        engine.close()
        master.stop()


def test_killed_segment_owner_is_a_miss(stored, master, tmp_path):
    """The process holding the data dies: reads fail at once (a miss, nothing written into the
    engine's memory); the master drops its keys a few seconds later and lookups say so."""
    case, dst, engine, tokens, bounds, src_tables, rng = reader(master, tmp_path)
    try:
        assert engine.lookup(tokens) == 3 * HYBRID_CHUNK
        stored.kill()
        before = dst.snapshot()
        tables = zoo.random_tables(case, HYBRID_TOKENS, rng, keep=zoo.restore_keep(case, 3 * HYBRID_CHUNK))
        start = time.monotonic()
        assert engine.retrieve(tokens, tables) == 0
        assert time.monotonic() - start < 3.0
        assert dst.same_bytes(before)
        assert tier_of(engine).counters["transfer_failures"] >= 1
        deadline = time.monotonic() + 40.0
        while engine.lookup(tokens) and time.monotonic() < deadline:  # the lookup's hint clears too
            time.sleep(0.5)
        assert engine.lookup(tokens) == 0
    finally:
        engine.close()


def test_node_server_holds_the_cache_across_engine_restarts(master, tmp_path):
    """``kvconnect server --mooncake-segment-gb`` holds the segment; an engine that contributes
    nothing stores and exits; a fresh engine hits every chunk."""
    holder = NodeHolder(master, tmp_path / "node", 0.25)
    try:
        assert any("holds a 0.25 GB Mooncake segment" in line for line in holder.lines), holder.lines
        writer = Peer("store-hybrid", master.address, "0", str(SEED))  # contributes no segment
        assert writer.result["flushed"] and writer.result["written"] == 3 + writer.result["window_pieces"] > 3, writer.result
        writer.finish()  # the storing engine exits
        case, dst, engine, tokens, bounds, src_tables, rng = reader(master, tmp_path)
        try:
            assert engine.lookup(tokens) == 3 * HYBRID_CHUNK
            dst_tables = zoo.random_tables(case, HYBRID_TOKENS, rng, keep=zoo.restore_keep(case, 3 * HYBRID_CHUNK))
            expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, 3 * HYBRID_CHUNK)
            assert engine.retrieve(tokens, dst_tables) == 3 * HYBRID_CHUNK
            assert dst.first_difference(expected) is None
        finally:
            engine.close()
    finally:
        holder.stop()


def test_a_retirement_marker_reaches_mooncake(master, tmp_path):
    """Issue 39 item 1: the marker a P/D producer's reset leaves is an object like any chunk's."""
    _, _, producer, *_ = reader(master, tmp_path, segment=SEGMENT)  # holds the segment the marker lands in
    try:
        producer.reset(retire=b"")
        assert producer.storage.flush(30.0)
        _, _, decode, *_ = reader(master, tmp_path)
        try:
            assert decode.generation_retired(b"") and not decode.generation_retired(producer.generation)
            assert tier_of(producer).stats().errors == 0
        finally:
            decode.close()
    finally:
        producer.close()
