"""KVConnectStorage against SGLang 0.5.23's real host pool classes (no engine start).

Real ``MHATokenToKVPoolHost`` in every MHA layout (layer_first, page_first,
page_first_direct, page_head) and ``MLATokenToKVPoolHost`` (layer_first, page_first,
page_first_direct) are built over CPU "device" buffers; pages go through the backend's v1
and generic APIs and come back into other host pages. Equality is checked with SGLang's own
page accessor (``get_data_page``), so the check does not depend on kvconnect's reading of
the layouts. Also: the replicated-MLA writer rule, key separation between layouts and
ranks, and a v2 query with a logical pool.
"""

from __future__ import annotations

import time

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer  # noqa: E402

from host_pools import MHA_LAYOUTS, MLA_LAYOUTS, PS, backend, fill, idx, keys, mha_pool, mla_pool, page, storage_config  # noqa: E402

pytestmark = pytest.mark.sglang

@pytest.mark.parametrize("make,layout", [(mha_pool, l) for l in MHA_LAYOUTS] + [(mla_pool, l) for l in MLA_LAYOUTS])
def test_v1_round_trip_byte_exact_by_sglangs_own_page_accessor(tmp_path, make, layout):
    pool = make(layout)
    fill(pool)
    b = backend(pool, storage_config(tmp_path, mla=make is mla_pool))
    src, dst = [3, 7, 1, 20], [10, 11, 12, 13]
    ks = keys(4, layout)
    want = [page(pool, p) for p in src]
    untouched = [page(pool, p) for p in (9, 14)]
    assert b.batch_exists(ks) == 0
    assert b.batch_set_v1(ks, idx(src)) == [True] * 4
    assert b.batch_exists(ks + keys(1, "absent")) == 4
    assert b.batch_get_v1(ks, idx(dst)) == [True] * 4
    for w, p in zip(want, dst):
        assert torch.equal(page(pool, p), w)
    assert all(torch.equal(page(pool, p), u) for p, u in zip((9, 14), untouched))
    stats = b.get_stats()
    assert stats.backup_pgs == [4] and stats.prefetch_pgs == [4]
    assert b.get_stats().backup_pgs == []  # drained
    b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_generic_api_round_trip(tmp_path, layout):
    pool = mha_pool(layout)
    fill(pool)
    b = backend(pool, storage_config(tmp_path, interface_v1=0))
    ks = keys(3, "generic" + layout)
    values = [pool.get_data_page(p * PS, flat=True) for p in (2, 4, 6)]
    assert b.batch_set(ks, values)
    targets = [pool.get_dummy_flat_data_page() for _ in ks]
    got = b.batch_get(ks + keys(1, "nope"), targets + [pool.get_dummy_flat_data_page()])
    assert got[-1] is None
    for g, v in zip(got, values):
        assert torch.equal(g, v)
    assert b.batch_exists(ks + keys(1, "nope")) == 3  # SGLang's hit query in generic mode
    b.close()
    v1 = backend(pool, storage_config(tmp_path))  # interface_v1: plane-ordered pages only
    assert v1.batch_exists(ks) == 0
    v1.close()


def test_pages_persist_for_a_fresh_backend_and_stay_apart_across_layouts_and_ranks(tmp_path):
    pool = mha_pool("layer_first")
    fill(pool)
    ks = keys(3, "persist")
    b = backend(pool, storage_config(tmp_path))
    b.batch_set_v1(ks, idx([0, 1, 2]))
    assert b.flush(10)
    b.close()
    assert backend(mha_pool("layer_first"), storage_config(tmp_path)).batch_exists(ks) == 3
    # page_first_direct pieces have other bytes orders: never shared with layer_first
    assert backend(mha_pool("page_first_direct"), storage_config(tmp_path)).batch_exists(ks) == 0
    assert backend(mha_pool("layer_first"), storage_config(tmp_path, tp_rank=1, tp_size=2)).batch_exists(ks) == 0
    assert backend(mha_pool("layer_first"), storage_config(tmp_path, model="other")).batch_exists(ks) == 0
    assert backend(mha_pool("layer_first", torch.bfloat16), storage_config(tmp_path)).batch_exists(ks) == 0


def test_replicated_mla_only_the_writer_rank_stores_and_every_rank_reads(tmp_path):
    pool0, pool1 = mla_pool("page_first_direct"), mla_pool("page_first_direct")
    fill(pool0)
    fill(pool1)
    ks = keys(2, "mla")
    reader = backend(pool1, storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2))
    assert reader.batch_set_v1(ks, idx([0, 1])) == [True, True]  # not a writer: nothing stored
    assert reader.batch_exists(ks) == 0
    writer = backend(pool0, storage_config(tmp_path, mla=True, tp_rank=0, tp_size=2))
    writer.batch_set_v1(ks, idx([0, 1]))
    assert writer.flush(10)
    fresh_reader = backend(mla_pool("page_first_direct"), storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2))
    assert fresh_reader.batch_exists(ks) == 2
    assert fresh_reader.batch_get_v1(ks, idx([5, 6])) == [True, True]
    assert torch.equal(page(fresh_reader.mem_pool_host, 5), page(pool0, 0))


def test_failures_are_misses_never_exceptions(tmp_path):
    pool = mha_pool("layer_first")
    b = backend(pool, storage_config(tmp_path, remote_url="redis://127.0.0.1:1", remote_timeout_s=0.2))
    ks = keys(2, "fail")
    assert b.batch_get_v1(ks, idx([0, 1])) == [False, False]
    assert b.batch_set_v1(ks, idx([0])) == [False, False]  # wrong index count: refused, no exception
    assert b.batch_get_v1(ks, idx([0, 999])) == [False, False]  # page out of range
    result = b.batch_exists_v2(ks, [PoolTransfer(name="unknown", keys=ks[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert result.kv_hit_pages == 0 and result.restorable_prefix_pages == []


def test_redis_tier_shared_by_a_fresh_backend_and_a_killed_server_is_a_miss(tmp_path):
    from support.redis_server import RedisNode, redis_available

    reason = redis_available()
    if reason:
        pytest.skip(reason)
    pool = mha_pool("page_first_direct")
    fill(pool)
    ks = keys(3, "redis")
    with RedisNode(tmp_path / "redis") as node:
        cfg = dict(remote_url=node.url, remote_timeout_s=0.5, local_disk=None)
        b = backend(pool, storage_config(tmp_path, **cfg))
        assert b.batch_set_v1(ks, idx([0, 1, 2])) == [True] * 3
        assert b.flush(10)
        b.close()
        other = mha_pool("page_first_direct")
        fresh = backend(other, storage_config(tmp_path, **cfg))  # no disk: only Redis holds the pages
        assert fresh.batch_exists(ks) == 3
        assert fresh.batch_get_v1(ks, idx([4, 5, 6])) == [True] * 3
        assert all(torch.equal(page(other, 4 + i), page(pool, i)) for i in range(3))
        node.kill()
        third = backend(mha_pool("page_first_direct"), storage_config(tmp_path, **cfg))
        start = time.monotonic()
        assert third.batch_exists(ks) == 0
        assert third.batch_get_v1(ks, idx([4, 5, 6])) == [False] * 3
        assert time.monotonic() - start < 5
