"""Hybrid GDN / Mamba models on SGLang 0.5.23: kvconnect refuses them, through SGLang's real pools.

SGLang cannot run its Qwen3.5 / Qwen3-Next on CPU (docs/recurrent.md, "SGLang": the GDN
kernels come from sgl_kernel's CPU build, which is not on PyPI), so whether the state SGLang
stores under a page key is the one after exactly that page was not checked on its forward,
and ``KVConnectStorage`` refuses any pool set with a Mamba pool: one warning naming the
release, then every page a miss. Here the pools are SGLang's own classes over CPU "device"
buffers: ``MambaPoolHost`` built from a ``MambaStateBufferInfo`` shaped like the tiny
Qwen3.5's GDN state (conv ``(dim, K-1)`` bf16, recurrent ``(Hv, V, K)`` fp32), registered as
``PoolName.MAMBA`` beside an ``MHATokenToKVPoolHost`` anchor, in the order SGLang's
``HybridCacheController`` registers them. The same anchor without the Mamba pool stores and
hits (the control that the refusal, not a broken setup, makes the misses).
"""

from __future__ import annotations

import logging

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402

from kvconnect.integrations.sglang import KVConnectStorage  # noqa: E402
from kvconnect.integrations.sglang.storage import sglang_release  # noqa: E402
from host_pools import PS, fill, idx, keys, mha_pool, storage_config  # noqa: E402

pytestmark = pytest.mark.sglang

GDN_LAYERS, SLOTS = 3, 8
CONV = (512, 3)  # (conv dim = 2 x 2 key heads x 64 + 4 value heads x 64, kernel 4 - 1)
TEMPORAL = (4, 64, 64)  # (value heads, value dim, key dim)


def mamba_host_pool() -> MambaPoolHost:
    conv = torch.randn(GDN_LAYERS, SLOTS, *CONV).to(torch.bfloat16)
    temporal = torch.randn(GDN_LAYERS, SLOTS, *TEMPORAL)
    info = MambaStateBufferInfo(temporal=temporal, conv=(conv,))
    pool = MambaPoolHost(info, 2.0, 0, device_capacity=SLOTS, pin_memory=False, device="cpu",
                         layout="page_first_direct")
    pool._keep = (conv, temporal)
    return pool


def attach(config, anchor, mamba=None) -> KVConnectStorage:
    b = KVConnectStorage(config, {})
    b.register_mem_pool_host(anchor)
    b.register_mem_host_pool_v2(anchor, PoolName.KV)
    if mamba is not None:
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    return b


def transfers(ks, kv_pages, mamba_slot):
    return [PoolTransfer(name=PoolName.KV, keys=ks, host_indices=idx(kv_pages), hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=torch.tensor([mamba_slot]),
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)]


def test_mamba_pool_is_refused_once_naming_the_release(tmp_path, caplog):
    anchor, mamba = mha_pool("page_first_direct"), mamba_host_pool()
    fill(anchor)
    assert sum(t.numel() for t in mamba.kv_buffer) > 0  # SGLang built its real host state buffers
    ks = keys(4, "gdn")
    with caplog.at_level(logging.WARNING, logger="kvconnect.integrations.sglang.storage"):
        b = attach(storage_config(tmp_path, model="tiny-qwen35"), anchor, mamba)
        t = transfers(ks, [0, 1, 2, 3], 1)
        stored = b.batch_set_v2(t)
        found = b.batch_exists_v2(ks, [t[1]])
        fetched = b.batch_get_v2(t)
        v1 = (b.batch_exists(ks), b.batch_set_v1(ks, idx([0, 1, 2, 3])))
    warnings = [r.getMessage() for r in caplog.records if "Mamba state pool" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"SGLang {sglang_release()}" in warnings[0] and sglang_release() == "0.5.23"
    assert stored == {"kv": [False] * 4, "mamba": [False]}  # nothing stored: SGLang keeps no false belief
    assert (found.kv_hit_pages, found.extra_pool_hit_pages, list(found.restorable_prefix_pages or [])) == (0, {}, [])
    assert fetched == {"kv": [False] * 4, "mamba": [False]}
    assert v1 == (0, [False] * 4)
    assert b.get_stats().backup_pgs == []
    b.close()


def test_the_same_anchor_without_a_mamba_pool_stores_and_hits(tmp_path):
    anchor = mha_pool("page_first_direct")
    fill(anchor)
    b = attach(storage_config(tmp_path, model="tiny-llama"), anchor)
    ks = keys(4, "dense")
    kv = PoolTransfer(name=PoolName.KV, keys=ks, host_indices=idx([0, 1, 2, 3]), hit_policy=PoolHitPolicy.ALL_PAGES)
    assert b.batch_set_v2([kv]) == {"kv": [True] * 4}
    assert b.batch_exists_v2(ks, []).kv_hit_pages == 4
    want = [anchor.get_data_page(p * PS, flat=True).clone() for p in range(4)]
    back = PoolTransfer(name=PoolName.KV, keys=ks, host_indices=idx([8, 9, 10, 11]), hit_policy=PoolHitPolicy.ALL_PAGES)
    assert b.batch_get_v2([back]) == {"kv": [True] * 4}
    assert all(torch.equal(anchor.get_data_page(p * PS, flat=True), w) for p, w in zip([8, 9, 10, 11], want))
    b.close()
