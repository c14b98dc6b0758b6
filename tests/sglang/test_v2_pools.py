"""The v2 pool API with SGLang 0.5.23's real DeepSeek V4 host pool classes.

DeepSeek V4's KV anchor is SGLang's ``LogicalHostPool`` (``kv_buffer`` None: no data); the
data lives in sidecar pools: ``DeepSeekV4PagedHostPool`` (SWA, TRAILING_PAGES; C4 and C128
compressed KV, ALL_PAGES; layer_first / page_first / page_first_direct) and
``DeepSeekV4StateHostPool`` (C4 compressor state, TRAILING_PAGES). All host pool classes are
SGLang's; the only stand-in is the *device* compress-state pool the state host pool mirrors
(an object with ``kv_score_buffer.kv_score`` and ``ring_size``), since no DSv4 device pool
runs on CPU.

DeepSeek V4.1 (SGLang 0.5.23, ``hybrid_pool_assembler._dsv4_low_ratio_entries``): its
layers compress at ratio 1 or 2 (or not at all); SGLang mirrors the ratio-1 and ratio-2 KV and
their indexer payload / scale buffers into ``DeepSeekV4PagedHostPool``s built with
``page_aligned_only=True`` (``DEEPSEEK_V4_C1`` / ``C1_INDEXER`` / ``C1_INDEXER_SCALE`` and the
same for C2, ALL_PAGES beside the KV anchor), and keeps no ratio-2 compressor state: a page
edge is a multiple of 2 tokens, where that state is empty and SGLang rebuilds it. Both pool
sets are checked below.

Checked: the backend attaches (Mooncake's fails on the logical anchor, sglang issue 26647);
pages round-trip byte-exact by SGLang's own ``get_data_page``; and ``batch_exists_v2`` gives
the same ``restorable_prefix_pages`` and ``kv_hit_pages`` as SGLang's own ``HiCacheFile``
backend for random patterns of stored pages (its rules, run side by side).
"""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool, LogicalHostPool  # noqa: E402

from kvconnect.integrations.sglang import KVConnectStorage  # noqa: E402
from host_pools import storage_config  # noqa: E402

pytestmark = pytest.mark.sglang

PS, PAGES, W = 4, 16, 2  # tokens per page, host pages, SWA / state pages needed at a boundary
ALL, TRAIL = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


def keys(n, salt):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def dsv4_pools(layout):
    def paged(name, layers, item_bytes):
        return DeepSeekV4PagedHostPool(name, [torch.zeros(8, item_bytes, dtype=torch.uint8) for _ in range(layers)],
                                       item_bytes, PAGES, PS, layout=layout, pin_memory=False)

    state_device = [SimpleNamespace(ring_size=2, kv_score_buffer=SimpleNamespace(kv_score=torch.zeros(8, 6, dtype=torch.float32)))
                    for _ in range(2)]
    state = DeepSeekV4StateHostPool(str(PoolName.DEEPSEEK_V4_C4_STATE), state_device, PAGES, PS, layout=layout, pin_memory=False)
    pools = {
        PoolName.SWA: (paged(str(PoolName.SWA), 3, 64), TRAIL),
        PoolName.DEEPSEEK_V4_C4: (paged(str(PoolName.DEEPSEEK_V4_C4), 2, 40), ALL),
        PoolName.DEEPSEEK_V4_C128: (paged(str(PoolName.DEEPSEEK_V4_C128), 2, 24), ALL),
        PoolName.DEEPSEEK_V4_C4_STATE: (state, TRAIL),
    }
    for pool, _ in pools.values():
        buf = pool.kv_buffer
        for t in buf if isinstance(buf, list) else [buf]:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    return LogicalHostPool(PAGES * PS, PS, layout=layout), pools


def dsv41_pools(layout):
    """DeepSeek V4.1's pool set: the logical anchor, SWA (TRAILING_PAGES) and the page-aligned
    ratio-1 / ratio-2 KV and indexer pools (ALL_PAGES), each SGLang's own class as its
    assembler builds them (item bytes here are small stand-ins for the model's row sizes)."""
    def paged(name, layers, item_bytes, aligned=True):
        return DeepSeekV4PagedHostPool(name, [torch.zeros(8, item_bytes, dtype=torch.uint8) for _ in range(layers)],
                                       item_bytes, PAGES, PS, layout=layout, pin_memory=False, page_aligned_only=aligned)

    pools = {PoolName.SWA: (paged(str(PoolName.SWA), 3, 64, aligned=False), TRAIL)}
    for names, layers, kv_bytes in (((PoolName.DEEPSEEK_V4_C1, PoolName.DEEPSEEK_V4_C1_INDEXER,
                                      PoolName.DEEPSEEK_V4_C1_INDEXER_SCALE), 2, 48),
                                     ((PoolName.DEEPSEEK_V4_C2, PoolName.DEEPSEEK_V4_C2_INDEXER,
                                       PoolName.DEEPSEEK_V4_C2_INDEXER_SCALE), 1, 24)):
        for name, item_bytes in zip(names, (kv_bytes, 16, 4)):
            pools[name] = (paged(str(name), layers, item_bytes), ALL)
    for pool, _ in pools.values():
        buf = pool.kv_buffer
        for t in buf if isinstance(buf, list) else [buf]:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    return LogicalHostPool(PAGES * PS, PS, layout=layout), pools


POOL_SETS = {"dsv4": dsv4_pools, "dsv4.1": dsv41_pools}


def attach(backend, anchor, pools):
    backend.register_mem_pool_host(anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    for name, (pool, _) in pools.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def idx(pages):
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages]) if pages else torch.zeros(0, dtype=torch.int64)


def transfers(pools, ks, pages, stored):
    """Per pool: the pages ``stored[name]`` (indices into ks) at host pages ``pages``."""
    out = []
    for name, (_, policy) in pools.items():
        sel = stored[name]
        out.append(PoolTransfer(name=name, keys=[ks[i] for i in sel], host_indices=idx([pages[i] for i in sel]), hit_policy=policy))
    return out


def queries(pools, ks):
    return [PoolTransfer(name=name, keys=ks[-W:] if policy == TRAIL else ks, hit_policy=policy) for name, (_, policy) in pools.items()]


@pytest.mark.parametrize("model", list(POOL_SETS))
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_dsv4_pools_round_trip_byte_exact(tmp_path, layout, model):
    anchor, pools = POOL_SETS[model](layout)
    b = attach(KVConnectStorage(storage_config(tmp_path), {}), anchor, pools)
    assert b._logical == {"kv"} and set(b._groups) == {str(name) for name in pools}
    ks = keys(4, layout)
    src, dst = [0, 5, 2, 9], [12, 13, 14, 15]
    want = {name: [pool.get_data_page(p * PS, flat=True).clone() for p in src] for name, (pool, _) in pools.items()}
    assert b.batch_set_v1(ks, idx(src)) == [True] * 4  # the logical anchor: nothing to store
    everything = {name: list(range(4)) for name in pools}
    assert all(all(v) for v in b.batch_set_v2(transfers(pools, ks, src, everything)).values())
    result = b.batch_exists_v2(ks, queries(pools, ks))
    assert result.kv_hit_pages == 4 and result.restorable_prefix_pages == [1, 2, 3, 4]
    got = b.batch_get_v2(transfers(pools, ks, dst, everything))
    assert all(got[str(name)] == [True] * 4 for name in pools)
    for name, (pool, _) in pools.items():
        for w, p in zip(want[name], dst):
            assert torch.equal(pool.get_data_page(p * PS, flat=True), w), name
    b.close()


@pytest.mark.parametrize("model", list(POOL_SETS))
def test_restorable_prefixes_agree_with_sglangs_file_backend(tmp_path, model):
    """Random patterns of stored sidecar pages; kvconnect's gate vs HiCacheFile's rules."""
    rng = random.Random(7)
    anchor, pools = POOL_SETS[model]("page_first")
    ours = attach(KVConnectStorage(storage_config(tmp_path), {}), anchor, pools)
    for trial in range(25):
        n = rng.randint(1, 8)
        ks = keys(n, f"trial{trial}")
        pages = list(range(n))
        stored = {name: [i for i in range(n) if rng.random() < (0.8 if policy == ALL else 0.6)]
                  for name, (_, policy) in pools.items()}
        sglang_file = attach(HiCacheFile(storage_config(tmp_path / f"file{trial}"), file_path=str(tmp_path / f"file{trial}")),
                             anchor, pools)
        for backend in (ours, sglang_file):
            backend.batch_set_v2(transfers(pools, ks, pages, stored))
        # HiCacheFile keeps the (logical) anchor's KV page as a file of its own: store it too
        for k in ks:
            sglang_file.set(k, torch.zeros(1, dtype=torch.uint8))
        want = sglang_file.batch_exists_v2(ks, queries(pools, ks))
        got = ours.batch_exists_v2(ks, queries(pools, ks))
        assert got.restorable_prefix_pages == sorted(want.restorable_prefix_pages), (stored, want, got)
        assert got.kv_hit_pages == want.kv_hit_pages
    ours.close()


def test_dsv41_hit_is_the_intersection_of_every_pools_legal_ends_not_the_minimum(tmp_path):
    """SWA's window is stored at node ends 2 and 5 (pages 0, 1, 3, 4), C2 only for pages
    0-3: the longest run of each is 5 and 4, and their minimum, 4, needs SWA pages 2 and 3
    (page 2 is missing): restoring there would leave the window's KV wrong. The ends every
    pool allows are 1 and 2."""
    anchor, pools = dsv41_pools("page_first_direct")
    b = attach(KVConnectStorage(storage_config(tmp_path), {}), anchor, pools)
    ks = keys(5, "intersect")
    stored = {name: list(range(5)) for name in pools}
    stored[PoolName.SWA] = [0, 1, 3, 4]
    stored[PoolName.DEEPSEEK_V4_C2] = [0, 1, 2, 3]
    b.batch_set_v2(transfers(pools, ks, list(range(5)), stored))
    result = b.batch_exists_v2(ks, queries(pools, ks))
    assert result.restorable_prefix_pages == [1, 2] and result.kv_hit_pages == 2
    assert result.extra_pool_hit_pages[str(PoolName.SWA)] == 5
    assert result.extra_pool_hit_pages[str(PoolName.DEEPSEEK_V4_C2)] == 4
    # after a prefetch of 2 pages every pool's pages come back (SGLang asks by the hit's keys)
    got = b.batch_get_v2(transfers(pools, ks[:2], [8, 9], {name: [0, 1] for name in pools}))
    assert all(v == [True, True] for v in got.values()), got
    b.close()


@pytest.fixture
def mamba_verified(monkeypatch):
    """The page mechanics under the verified pair: kvconnect serves Mamba pools only on the
    (SGLang release, Mamba radix-cache strategy) pairs in ``MAMBA_VERIFIED`` (SGLang 0.5.23 with
    ``no_buffer``, tests/sglang/test_sglang_mamba.py); a backend built outside a scheduler reads
    no strategy (tests/sglang/test_mamba_pool.py), so these tests name the verified one."""
    from kvconnect.integrations.sglang import runtime

    monkeypatch.setattr(runtime, "mamba_radix_cache_strategy", lambda: "no_buffer")


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mamba_hybrid_state_pages_and_gate(tmp_path, layout, mamba_verified):
    """A Mamba hybrid: SGLang's MHA host pool (KV anchor, 4 tokens per page) and its real
    ``MambaPoolHost`` (one state slot per page, TRAILING_PAGES)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    from host_pools import mha_pool

    kv = mha_pool("page_first_direct")
    kv.kv_buffer.copy_(torch.randn(kv.kv_buffer.shape))
    info = MambaStateBufferInfo(temporal=torch.zeros(3, 9, 4, 8), conv=(torch.zeros(3, 9, 2, 16, dtype=torch.bfloat16),))
    mamba = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, layout=layout)
    mamba.temporal_buffer.copy_(torch.randn(mamba.temporal_buffer.shape))
    for buf in mamba.conv_buffer:
        buf.copy_(torch.randn(buf.shape))
    b = KVConnectStorage(storage_config(tmp_path), {})
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    ks = keys(5, "mamba" + layout)
    assert b.batch_set_v1(ks, idx([0, 1, 2, 3, 4])) == [True] * 5
    # SGLang backs up the state of the node's last page only (here: pages 2 and 4)
    for page, slot in ((2, 3), (4, 7)):
        t = PoolTransfer(name=PoolName.MAMBA, keys=[ks[page]], host_indices=torch.tensor([slot]), hit_policy=TRAIL)
        assert b.batch_set_v2([t]) == {"mamba": [True]}
    q = [PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], hit_policy=TRAIL)]
    result = b.batch_exists_v2(ks, q)
    assert result.restorable_prefix_pages == [3, 5] and result.kv_hit_pages == 5
    want = mamba.get_data_page(7, flat=True).clone()
    got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=[ks[4]], host_indices=torch.tensor([1]), hit_policy=TRAIL)])
    assert got == {"mamba": [True]}
    assert torch.equal(mamba.get_data_page(1, flat=True), want)
    b.close()


def test_mla_hybrid_non_writer_rank_still_writes_its_tp_sharded_mamba_state(tmp_path, mamba_verified):
    """SGLang's rule (as its file backend): MLA KV is replicated (only writer ranks store it),
    Mamba state stays TP-sharded (every rank stores and reads its own)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    from host_pools import mla_pool

    kv = mla_pool("page_first_direct")
    info = MambaStateBufferInfo(temporal=torch.zeros(3, 9, 4, 8), conv=(torch.zeros(3, 9, 2, 16, dtype=torch.bfloat16),))
    mamba = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, layout="page_first")
    b = KVConnectStorage(storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2), {})
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    ks = keys(2, "mla-mamba")
    assert b.batch_set_v1(ks, idx([0, 1])) == [True, True]
    assert b.batch_exists(ks) == 0  # rank 1 is not the KV writer
    t = PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=torch.tensor([3]), hit_policy=TRAIL)
    assert b.batch_set_v2([t]) == {"mamba": [True]}
    assert b.batch_exists_v2(ks, [t]).extra_pool_hit_pages == {}  # no KV: nothing restorable here
    assert b._store.present(b._groups["mamba"], ks[-1:]).tolist() == [True]
    b.close()
