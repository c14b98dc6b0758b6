"""KV replicated over tensor parallelism (MLA) is written once and read by every rank (issue 25).

Layouts come from ``translate`` (the vLLM spec look-alikes of support/vllm_lookalikes.py); each
"rank" is a real ``KVCacheEngine`` over its own tensors holding the same latent rows (as
replicated KV is), sharing a real disk tier directory or a real node cache server. The vLLM
end-to-end proof (two CPU workers, a fresh engine resuming bit-identically from one copy) is
test_vllm_e2e.py::test_mla_kv_replicated_over_tp_is_written_once_and_read_at_other_tp_sizes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading

import numpy as np
import pytest
import torch

from kvconnect import Config, KVCacheEngine
from kvconnect.integrations.vllm.translate import translate_kv_caches
from kvconnect.integrations.vllm.ranks import ParallelRanks
from kvconnect.server import make_pool
from kvconnect.server.server import CacheServer
from kvconnect.layout.spec import DCPSpec
from support.vllm_lookalikes import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, NB, filled

CHUNK = 32
TOKENS = np.arange(4 * CHUNK, dtype=np.int64) + 11  # 4 whole chunks
SRC, DST = (1, 2, 3, 4, 5, 6, 7, 8), (9, 10, 11, 12, 13, 14, 15, 16)


def _mla(tp_rank: int, tp_size: int = 2, seed: int = 4, dcp: DCPSpec = DCPSpec()):
    """One rank's translation of a two-layer CPU-MLA cache (block 16); every rank's tensors
    hold the same rows (``seed``), as MLA's replicated latent does."""
    spec = MLAAttentionSpec(16, 1, 576, torch.float32)
    caches = {f"l{i}": filled((2 * NB + 1, 16, 1, 576), torch.float32, seed + i).permute(0, 2, 1, 3) for i in range(2)}
    config = KVCacheConfig(2 * NB + 1, [KVCacheGroupSpec(list(caches), spec)])
    return translate_kv_caches(config, caches, backend_names=dict.fromkeys(caches, "CPU_MLA"), model_name="m",
                               tp_rank=tp_rank, tp_size=tp_size, dcp=dcp)


def _gqa(tp_rank: int, tp_size: int = 2):
    spec = FullAttentionSpec(16, 2, 32, torch.float16)
    caches = {"l0": filled((NB, 16, 2, 64), torch.float16, 18).permute(0, 2, 1, 3)}
    return translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)]), caches, model_name="m",
                               tp_rank=tp_rank, tp_size=tp_size)


@contextlib.contextmanager
def _node_server():
    """A real node cache server in a thread, on a short /tmp socket path; yields (url, server)."""
    d = tempfile.mkdtemp(prefix="kvc-", dir="/tmp")
    url = f"ipc://{d}/srv"
    server = CacheServer(url, 8 << 20, page_bytes=4096, lease_s=1.0)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), kwargs={"max_seconds": 300}, daemon=True)
    thread.start()
    try:
        yield url, server
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()
        shutil.rmtree(d, ignore_errors=True)


def _entries(engine) -> int:
    """Objects the node server holds (asked over the engine's connection: after its commits)."""
    return engine.pool.stats().extra["server"]["num_entries"]


def _tables(t, blocks):
    return t.block_tables((tuple(blocks),))


def _disk_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kvc"))


def test_mla_ranks_share_one_key_chain_and_gqa_ranks_do_not():
    r0, r1 = _mla(0), _mla(1)
    assert r0.tp_replicated and r1.tp_replicated
    assert r0.layout.fingerprint == r1.layout.fingerprint  # no rank in the key
    # nor the TP size (issue 40 item 0): any TP size reads what any other wrote
    assert _mla(1, tp_size=4).layout.fingerprint == _mla(0, tp_size=1).layout.fingerprint == r1.layout.fingerprint
    assert not _mla(0, tp_size=1).tp_replicated
    g0, g1 = _gqa(0), _gqa(1)
    assert not g0.tp_replicated and g0.layout.fingerprint != g1.layout.fingerprint  # sharded heads: per rank


def test_a_layout_mixing_replicated_and_sharded_groups_keeps_the_rank():
    mla, gqa = MLAAttentionSpec(16, 1, 576, torch.float32), FullAttentionSpec(16, 2, 32, torch.float32)
    caches = {"m": filled((NB, 16, 1, 576), torch.float32, 1).permute(0, 2, 1, 3),
              "g": filled((NB, 16, 2, 64), torch.float32, 2).permute(0, 2, 1, 3)}
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["m"], mla), KVCacheGroupSpec(["g"], gqa)])
    r0, r1 = (translate_kv_caches(config, caches, model_name="m", tp_rank=r, tp_size=2) for r in (0, 1))
    assert not r0.tp_replicated and r0.layout.fingerprint != r1.layout.fingerprint


def test_writers_are_one_rank_per_copy():
    assert [ParallelRanks(tp_rank=r, tp_size=4).writes_shared(True) for r in range(4)] == [True, False, False, False]
    assert all(ParallelRanks(tp_rank=r, tp_size=4).writes_shared(False) for r in range(4))  # rank-keyed: everyone
    # DCP 2 of TP 4 (vLLM's DCP groups are consecutive TP ranks: dcp_rank = tp_rank % 2): one writer per DCP shard
    ranks = [ParallelRanks(tp_rank=r, tp_size=4, dcp=DCPSpec(rank=r % 2, size=2)) for r in range(4)]
    assert [p.writes_shared(True) for p in ranks] == [True, True, False, False]


def test_disk_tier_holds_one_copy_and_a_fresh_replica_restores_from_it(tmp_path):
    disk = str(tmp_path / "disk")
    config = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, local_disk=disk, max_local_disk_size=0.01)
    r0, r1 = _mla(0), _mla(1)
    writer = KVCacheEngine(r0.layout, config)
    replica = KVCacheEngine(r1.layout, config, shared_writer=False)
    try:
        # the replica first (the writer's files would be found, and not stored again, after)
        assert replica.store(TOKENS, _tables(r1, SRC)) == len(TOKENS)  # into its private pool: no failure
        assert writer.store(TOKENS, _tables(r0, SRC)) == len(TOKENS)
        assert replica.stats.stored_chunks == 4 and replica.lookup(TOKENS) == len(TOKENS)
    finally:
        writer.close()
        replica.close()
    files = _disk_files(disk)
    one_chunk = os.path.getsize(files[0])
    assert len(files) == 4 and sum(os.path.getsize(f) for f in files) == 4 * one_chunk  # rank-keyed: 8 files

    fresh = _mla(1, seed=99)  # a restarted rank 1: empty pool, other bytes in its blocks
    engine = KVCacheEngine(fresh.layout, config, shared_writer=False)
    try:
        assert engine.lookup(TOKENS) == len(TOKENS)
        assert engine.retrieve(TOKENS, _tables(fresh, DST)) == len(TOKENS)
    finally:
        engine.close()
    for got, want in zip(fresh.layout.tensors, r0.layout.tensors):
        assert torch.equal(got[list(DST)], want[list(SRC)])  # rank 0's rows, byte for byte
    assert _disk_files(disk) == files  # the replica wrote nothing


def test_a_live_replica_follows_the_writers_disk_directory(tmp_path):
    """Within one run: the replica (started first, empty directory) reads files the writer wrote
    after its start, and stops offering them once the writer removed them."""
    disk = str(tmp_path / "disk")
    config = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, local_disk=disk, max_local_disk_size=0.01)
    r0, r1 = _mla(0), _mla(1, seed=60)
    replica = KVCacheEngine(r1.layout, config, shared_writer=False)
    writer = KVCacheEngine(r0.layout, config)
    try:
        assert replica.lookup(TOKENS) == 0
        assert writer.store(TOKENS, _tables(r0, SRC)) == len(TOKENS)
        assert writer.storage.flush(30)
        assert len(_disk_files(disk)) == 4
        assert replica.lookup(TOKENS) == len(TOKENS)  # found on disk: the replica's pool is empty
        assert replica.retrieve(TOKENS, _tables(r1, DST)) == len(TOKENS)
        for got, want in zip(r1.layout.tensors, r0.layout.tensors):
            assert torch.equal(got[list(DST)], want[list(SRC)])
        replica.pool.clear()  # its private pool forgets: only the disk could serve now
        (disk_tier,) = writer.storage.tiers
        keys = [c.key for c in writer.chunks(TOKENS, include_partial=False)]
        assert disk_tier.delete(keys[2:]) == [True, True]  # the writer evicts the last two chunks
        assert replica.lookup(TOKENS) == 2 * CHUNK  # never a promise of what is gone
        assert replica.retrieve(TOKENS, _tables(r1, DST)) == 2 * CHUNK
    finally:
        writer.close()
        replica.close()
    assert len(_disk_files(disk)) == 2  # the replica removed and wrote nothing


def test_a_replica_without_a_cpu_cache_of_its_own_stores_nothing(tmp_path):
    config = Config(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.01, local_disk=str(tmp_path),
                    max_local_disk_size=0.01)
    t = _mla(1)
    replica = KVCacheEngine(t.layout, config, shared_writer=False)
    try:
        assert replica.store(TOKENS, _tables(t, SRC)) == 0
        assert replica.stats.replica_stores_left == 1 and replica.stats.stored_chunks == 0
    finally:
        replica.close()


def test_a_replica_alone_writes_no_shared_tier_so_a_restart_misses(tmp_path):
    """Exactness: a hit needs the objects; a replica's private pool does not reach the disk."""
    disk = str(tmp_path / "disk")
    config = Config(chunk_size=CHUNK, max_local_cpu_size=0.01, local_disk=disk, max_local_disk_size=0.01)
    t = _mla(1)
    replica = KVCacheEngine(t.layout, config, shared_writer=False)
    try:
        assert replica.store(TOKENS, _tables(t, SRC)) == len(TOKENS)
    finally:
        replica.close()
    assert _disk_files(disk) == []
    again = KVCacheEngine(t.layout, config, shared_writer=False)
    try:
        assert again.lookup(TOKENS) == 0 and again.retrieve(TOKENS, _tables(t, DST)) == 0
    finally:
        again.close()


def test_node_server_holds_one_copy_and_every_rank_reads_it_across_a_common_reset():
    with _node_server() as (url, _):
        if True:
            config = Config(chunk_size=CHUNK, server_url=url)
            r0, r1 = _mla(0), _mla(1, seed=50)  # rank 1's blocks hold other bytes: what it loads is rank 0's
            writer = KVCacheEngine(r0.layout, config, pool_factory=make_pool)
            replica = KVCacheEngine(r1.layout, config, shared_writer=False, pool_factory=make_pool)
            try:
                assert replica.store(TOKENS, _tables(r1, SRC)) == 0 and replica.stats.replica_stores_left == 1
                assert replica.lookup(TOKENS) == 0  # nothing written yet: no promise
                assert writer.store(TOKENS, _tables(r0, SRC)) == len(TOKENS)
                assert _entries(writer) == 4  # one copy for both ranks
                assert replica.lookup(TOKENS) == len(TOKENS)
                assert replica.retrieve(TOKENS, _tables(r1, DST)) == len(TOKENS)
                for got, want in zip(r1.layout.tensors, r0.layout.tensors):
                    assert torch.equal(got[list(DST)], want[list(SRC)])
                # a reset moves both ranks to the generation the scheduler sends them both
                gen = os.urandom(16)
                writer.reset(gen)
                replica.reset(gen)
                assert replica.lookup(TOKENS) == 0  # chunks of before the reset are never served
                assert writer.store(TOKENS, _tables(r0, SRC)) == len(TOKENS)
                assert _entries(writer) == 8  # (after the writer's commits reached the server)
                assert replica.lookup(TOKENS) == len(TOKENS)
                with pytest.raises(ValueError):
                    writer.reset(b"")
            finally:
                writer.close()
                replica.close()
