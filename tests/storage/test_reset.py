"""KVCacheEngine.reset: nothing stored before a reset is served after it, from any tier; other
engines on a shared tier keep their hits; a restart starts from the checkpoint's generation."""

from __future__ import annotations


import numpy as np
import pytest

import kv_rig
from kvconnect import Config, KVCacheEngine
from kvconnect.chunks.keys import ChunkKeyer
from kvconnect.chunks.page_keys import PageKeyFolder
from kvconnect.server import make_pool
from support.redis_server import RedisNode, redis_available
from support.server_rig import socket_dir, server_thread  # noqa: E402

HANG_GUARD_S = 30.0
N = 4 * kv_rig.CHUNK_TOKENS


def test_generation_changes_every_key_and_no_generation_keeps_todays_keys():
    fp = b"\x01" * 32
    tokens = np.arange(N)
    bounds = [(i, i + 32) for i in range(0, N, 32)]
    plain = ChunkKeyer(fp, 32).keys(tokens, bounds)
    assert ChunkKeyer(fp, 32, generation=b"").keys(tokens, bounds) == plain
    # today's keys, pinned: stored chunks from before this change keep hitting
    assert bytes(plain[0]).hex() == bytes(ChunkKeyer(fp, 32).keys(tokens, bounds[:1])[0]).hex()
    for gen in (b"a", b"b" * 16):
        other = ChunkKeyer(fp, 32, generation=gen).keys(tokens, bounds)
        assert not set(map(bytes, other)) & set(map(bytes, plain))
    assert ChunkKeyer(fp, 32, generation=b"a").keys(tokens, bounds) != ChunkKeyer(fp, 32, generation=b"b").keys(tokens, bounds)
    # page keys (SGLang) follow the same rule
    assert PageKeyFolder(fp, 16).fold(["k"]) == PageKeyFolder(fp, 16, generation=b"").fold(["k"])
    assert PageKeyFolder(fp, 16).fold(["k"]) != PageKeyFolder(fp, 16, generation=b"g").fold(["k"])


def _reset_cycle(eng: KVCacheEngine, seed: int) -> None:
    """Stored -> hit; reset -> miss in every tier; stored again -> hit again (bytes checked)."""
    toks = kv_rig.tokens(seed, N)
    assert kv_rig.store_prompt(eng, seed, N) == N
    assert eng.storage.flush(HANG_GUARD_S)
    assert eng.lookup(toks) == N
    eng.reset()
    assert eng.lookup(toks) == 0
    assert kv_rig.retrieve_prompt(eng, seed, N) == 0
    eng.pool.clear()  # only the lower tiers could answer now: they must not either
    assert eng.lookup(toks) == 0
    assert kv_rig.store_prompt(eng, seed, N) == N
    assert eng.storage.flush(HANG_GUARD_S)
    eng.pool.clear()  # served from below the pool: the new generation reached every tier
    assert kv_rig.retrieve_prompt(eng, seed, N) == N


def test_reset_reaches_pool_and_disk_and_a_restart_serves_the_checkpoints_chunks(tmp_path):
    layout = kv_rig.mla_layout()
    cfg = dict(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    first = kv_rig.make_engine(layout, **cfg)
    assert kv_rig.store_prompt(first, 1, N) == N  # generation 0: the checkpoint's weights
    first.storage.flush(HANG_GUARD_S)
    _reset_cycle(first, 2)
    used = first.pool.stats().used_slots
    first.reset()
    assert first.pool.stats().used_slots < used  # the private pool is emptied at once
    first.close()
    # a new process on the same disk: no generation, so the checkpoint's chunks hit again and
    # the reset generations' never do
    again = kv_rig.make_engine(layout, **cfg)
    assert again.lookup(kv_rig.tokens(1, N)) == N
    assert again.lookup(kv_rig.tokens(2, N)) == N  # seed 2 was stored before the first reset too
    assert kv_rig.retrieve_prompt(again, 1, N) == N
    again.close()


@pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))
def test_reset_reaches_redis(tmp_path):
    with RedisNode(tmp_path / "redis") as node:
        eng = kv_rig.make_engine(kv_rig.mla_layout(), remote_url=node.url)
        _reset_cycle(eng, 3)
        eng.close()


def test_reset_on_a_shared_node_server_leaves_other_engines_hits():
    layout = kv_rig.mla_layout()
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", size_bytes=8 << 20) as server:
        url = f"ipc://{d}/kvc.sock"
        cfg = Config(chunk_size=kv_rig.CHUNK_TOKENS, num_threads=1, server_url=url, remote_timeout_s=5.0)
        updated, old = KVCacheEngine(layout, cfg, pool_factory=make_pool), KVCacheEngine(layout, cfg, pool_factory=make_pool)
        toks = kv_rig.tokens(5, N)
        assert kv_rig.store_prompt(updated, 5, N) == N
        # commits to the node server are sent without waiting; the writer's next call orders them
        assert updated.lookup(toks) == N and old.lookup(toks) == N
        updated.reset()
        assert updated.lookup(toks) == 0
        assert old.lookup(toks) == N  # still on the old weights: its hits stay
        assert kv_rig.retrieve_prompt(old, 5, N) == N
        assert kv_rig.store_prompt(updated, 5, N) == N
        assert updated.lookup(toks) == N
        updated.close()
        old.close()


def test_a_producers_reset_leaves_a_marker_every_engine_on_the_tier_reads():
    """Issue 39 item 1: a reset told to retire a generation leaves its marker in the shared tier,
    so a decode server knows the generation is stale from the tier, not from the loads it saw:
    one that saw nothing of it, and one started after the reset, both read it. The marker is no
    chunk of any prompt: lookups of every generation still see only their own chunks."""
    layout = kv_rig.mla_layout()
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", size_bytes=8 << 20):
        cfg = Config(chunk_size=kv_rig.CHUNK_TOKENS, num_threads=1, server_url=f"ipc://{d}/kvc.sock", remote_timeout_s=5.0)
        producer, decode = KVCacheEngine(layout, cfg, pool_factory=make_pool), KVCacheEngine(layout, cfg, pool_factory=make_pool)
        old = b"\x0a" * 16
        producer.reset(old)
        assert kv_rig.store_prompt(producer, 6, N) == N
        assert not decode.generation_retired(old) and not decode.generation_retired(b"")
        producer.reset(retire=old)
        new = producer.generation
        # the marker is written behind, like any chunk, and its commit to the node server is sent
        # without a reply: the producer's queue drained, then its own next call orders it
        assert producer.storage.flush(30)
        assert producer.generation_retired(old) and decode.generation_retired(old)
        assert not decode.generation_retired(new) and not decode.generation_retired(b"")
        toks = kv_rig.tokens(6, N)
        assert decode.lookup(toks, generation=old) == N  # still there: refusing them is the decode side's part
        assert decode.lookup(toks, generation=new) == 0 and decode.lookup(toks) == 0
        decode.close()
        restarted = KVCacheEngine(layout, cfg, pool_factory=make_pool)  # a decode server started after the reset
        assert restarted.generation_retired(old) and not restarted.generation_retired(new)
        restarted.close()
        producer.close()


def test_the_retirement_marker_is_reachable_by_no_chain():
    fp = b"\x01" * 32
    for gen in (b"", b"\x0a" * 16):
        keyer = ChunkKeyer(fp, 32, generation=gen)
        marker = keyer.retirement_key()
        assert bytes(marker) != keyer.seed()[:16]
        assert marker not in keyer.keys(np.arange(N), [(i, i + 32) for i in range(0, N, 32)])
    assert ChunkKeyer(fp, 32).retirement_key() != ChunkKeyer(fp, 32, generation=b"\x0a" * 16).retirement_key()


@pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))
def test_the_retirement_marker_reaches_redis_through_the_write_behind(tmp_path):
    with RedisNode(tmp_path / "redis") as node:
        producer = kv_rig.make_engine(kv_rig.mla_layout(), remote_url=node.url)
        producer.reset(retire=b"")  # the checkpoint's generation left behind
        assert producer.storage.flush(HANG_GUARD_S)
        producer.pool.clear()
        decode = kv_rig.make_engine(kv_rig.mla_layout(), remote_url=node.url)
        assert decode.generation_retired(b"") and producer.generation_retired(b"")
        assert not decode.generation_retired(producer.generation)
        decode.close()
        producer.close()
