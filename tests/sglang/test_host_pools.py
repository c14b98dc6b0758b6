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

import hashlib
import sys
import time
from pathlib import Path

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

from kvconnect.integrations.sglang import KVConnectStorage  # noqa: E402

pytestmark = pytest.mark.sglang

L, H, D, PS, N = 2, 2, 8, 4, 64
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def keys(n, salt="k"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def _ptrs(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def mha_pool(layout, dtype=torch.float32):
    k = [torch.zeros(N, H, D, dtype=dtype) for _ in range(L)]
    v = [torch.zeros(N, H, D, dtype=dtype) for _ in range(L)]
    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PS, head_num=H, head_dim=D, v_head_dim=D, dtype=dtype, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu", device_capacity_tokens=N,
                                start_layer=0, end_layer=L)
    pool._keep = (k, v)
    return pool


def mla_pool(layout):
    bufs = [torch.zeros(N, 1, 48) for _ in range(L)]
    info = MLABufferInfo(buffers=tuple(bufs), data_ptrs=_ptrs(bufs), layer_indices=tuple(range(L)), device_layer_num=L,
                         page_size=PS, kv_lora_rank=32, qk_rope_head_dim=16, kv_cache_dim=48, dtype=torch.float32,
                         device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu", device_capacity_tokens=N,
                                start_layer=0, end_layer=L, target_layer_num=L)
    pool._keep = bufs
    return pool


def storage_config(tmp_path, *, mla=False, tp_rank=0, tp_size=1, model="tiny", **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=True, is_page_first_layout=False, model_name=model,
        extra_config={"backend_name": "kvconnect", "module_path": "kvconnect.integrations.sglang",
                      "class_name": "KVConnectStorage", "interface_v1": 1, "max_local_cpu_size": 0.01,
                      "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05, **extra},
    )


def backend(pool, config):
    b = KVConnectStorage(config, {})
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(pool, "kv")
    b.on_host_pools_registered()
    return b


def fill(pool):
    if getattr(pool, "kv_buffer", None) is not None:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))


def idx(pages):
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def page(pool, p):
    return pool.get_data_page(p * PS, flat=True).clone()


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
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))
    from redis_server import RedisNode, redis_available

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
