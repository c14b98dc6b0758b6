"""Hybrid GDN / Mamba / short-conv models on SGLang: which (release, strategy) kvconnect serves, through SGLang's real pools.

kvconnect serves SGLang's Mamba state pool (``PoolName.MAMBA``) only on the (SGLang release,
Mamba radix-cache strategy) pairs in ``storage.MAMBA_VERIFIED``: SGLang 0.5.23 with
``no_buffer``, where the state stored under each page key was checked on the real engine to be
the state after exactly that page and L3 restores bit-exact (on CPU: tests/sglang/test_sglang_mamba.py,
LFM2; tests/sglang/test_sglang_gdn.py, Qwen3.5's Gated DeltaNet). Any other pair is refused: one warning naming the release and the strategy, then
every page a miss. Here the pools are SGLang's own classes over CPU "device" buffers:
``MambaPoolHost`` built from a ``MambaStateBufferInfo`` shaped like the tiny Qwen3.5's GDN
state (conv ``(dim, K-1)`` bf16, recurrent ``(Hv, V, K)`` fp32), registered as
``PoolName.MAMBA`` beside an ``MHATokenToKVPoolHost`` anchor, in the order SGLang's
``HybridCacheController`` registers them. The strategy is what SGLang's scheduler publishes
(``runtime.mamba_radix_cache_strategy``); these backends are built outside a scheduler, where
there is none (refused: unknown), so the tests that need one name it. The same anchor without
the Mamba pool stores and hits (the control that the refusal, not a broken setup, makes the
misses).
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

from kvconnect.integrations.sglang import KVConnectStorage, runtime, storage  # noqa: E402
from kvconnect.integrations.sglang.storage import refusal, sglang_release  # noqa: E402
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


def run_refused(config, caplog):
    """Store, query and fetch through a refused backend; the warnings and what it answered."""
    anchor, mamba = mha_pool("page_first_direct"), mamba_host_pool()
    fill(anchor)
    assert sum(t.numel() for t in mamba.kv_buffer) > 0  # SGLang built its real host state buffers
    ks = keys(4, "gdn")
    with caplog.at_level(logging.WARNING, logger="kvconnect.integrations.sglang.storage"):
        b = attach(config, anchor, mamba)
        t = transfers(ks, [0, 1, 2, 3], 1)
        stored = b.batch_set_v2(t)
        found = b.batch_exists_v2(ks, [t[1]])
        fetched = b.batch_get_v2(t)
        v1 = (b.batch_exists(ks), b.batch_set_v1(ks, idx([0, 1, 2, 3])))
    warnings = [r.getMessage() for r in caplog.records if "Mamba state pool" in r.getMessage()]
    assert stored == {"kv": [False] * 4, "mamba": [False]}  # nothing stored: SGLang keeps no false belief
    assert (found.kv_hit_pages, found.extra_pool_hit_pages, list(found.restorable_prefix_pages or [])) == (0, {}, [])
    assert fetched == {"kv": [False] * 4, "mamba": [False]}
    assert v1 == (0, [False] * 4)
    assert b.get_stats().backup_pgs == []
    b.close()
    return warnings


def test_the_verified_pair_is_sglang_0523_with_no_buffer():
    assert storage.MAMBA_VERIFIED == frozenset({("0.5.23", "no_buffer")})
    assert refusal(["kv", "mamba"], "0.5.23", "no_buffer") is None
    assert refusal(["kv"], "0.5.22", "extra_buffer") is None  # no Mamba pool: nothing to verify
    for release, strategy in (("0.5.22", "no_buffer"), ("0.5.23", "extra_buffer"), ("0.5.23", "extra_buffer_lazy")):
        why = refusal(["kv", "mamba"], release, strategy)
        assert f"SGLang {release} with mamba_radix_cache_strategy {strategy}" in why, why
        assert "verified on its real engine only for SGLang 0.5.23 with no_buffer" in why, why


def test_an_unverified_release_is_refused_once_naming_it(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(storage, "sglang_release", lambda: "0.5.22")
    monkeypatch.setattr(runtime, "mamba_radix_cache_strategy", lambda: "no_buffer")
    warnings = run_refused(storage_config(tmp_path, model="tiny-qwen35"), caplog)
    assert len(warnings) == 1, warnings
    assert "SGLang 0.5.22 with mamba_radix_cache_strategy no_buffer" in warnings[0]


def test_extra_buffer_is_refused_on_the_verified_release(tmp_path, caplog, monkeypatch):
    """SGLang's ``extra_buffer`` picks the state to back up from its ping-pong track buffers; it
    runs only on GPU / NPU platforms, so it was never checked: refused."""
    monkeypatch.setattr(runtime, "mamba_radix_cache_strategy", lambda: "extra_buffer")
    warnings = run_refused(storage_config(tmp_path, model="tiny-qwen35"), caplog)
    assert len(warnings) == 1, warnings
    assert f"SGLang {sglang_release()} with mamba_radix_cache_strategy extra_buffer" in warnings[0]
    assert sglang_release() == "0.5.23"


def test_outside_a_scheduler_the_strategy_is_unknown_and_refused(tmp_path, caplog):
    assert runtime.mamba_radix_cache_strategy() is None  # no server arguments published here
    warnings = run_refused(storage_config(tmp_path, model="tiny-qwen35"), caplog)
    assert len(warnings) == 1 and "mamba_radix_cache_strategy (unknown)" in warnings[0], warnings


def test_the_verified_pair_stores_and_gates_on_the_trailing_mamba_page(tmp_path, caplog, monkeypatch):
    """SGLang 0.5.23 with no_buffer: KV pages and the node end's state are stored; a prefix is
    restorable only where its trailing Mamba page is stored; the state comes back byte-exact."""
    monkeypatch.setattr(runtime, "mamba_radix_cache_strategy", lambda: "no_buffer")
    anchor, mamba = mha_pool("page_first_direct"), mamba_host_pool()
    fill(anchor)
    ks = keys(4, "gdn-served")
    with caplog.at_level(logging.WARNING, logger="kvconnect.integrations.sglang.storage"):
        b = attach(storage_config(tmp_path, model="tiny-qwen35"), anchor, mamba)
        stored = b.batch_set_v2(transfers(ks, [0, 1, 2, 3], 1))  # the state of the node ending at page 4
    assert not [r for r in caplog.records if "Mamba state pool" in r.getMessage()]
    assert stored == {"kv": [True] * 4, "mamba": [True]}
    query = [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    found = b.batch_exists_v2(ks, query)
    assert (found.kv_hit_pages, list(found.restorable_prefix_pages)) == (4, [4])
    assert b.batch_exists_v2(ks[:3], query).kv_hit_pages == 0  # KV for 3 pages, no state at page 3: no hit
    want = mamba.get_data_page(1, flat=True).clone()
    back = [PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=torch.tensor([5]), hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert b.batch_get_v2(back) == {"mamba": [True]}
    assert torch.equal(mamba.get_data_page(5, flat=True), want)
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


@pytest.mark.parametrize("asked", ["auto", "no_buffer"])
def test_the_strategy_read_is_sglangs_resolved_one(tmp_path, asked):
    """Under SGLang's own runtime context (as its scheduler builds the backend) kvconnect reads
    the strategy SGLang resolved: ``auto`` for LFM2 at page size 1 without the overlap schedule
    is ``no_buffer`` (the raw server argument still says ``auto``)."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    from support import tiny_models

    model = tiny_models.make_lfm2(str(tmp_path / "lfm2"))
    args = ServerArgs(model_path=model, device="cpu", dtype="float32", skip_tokenizer_init=True,
                      attention_backend="torch_native", page_size=1, disable_overlap_schedule=True,
                      mamba_radix_cache_strategy=asked)
    with use_context(create_context(args, role="scheduler")):
        assert runtime.mamba_radix_cache_strategy() == "no_buffer"
        assert refusal(["kv", "mamba"]) is None
    assert args.mamba_radix_cache_strategy == asked
