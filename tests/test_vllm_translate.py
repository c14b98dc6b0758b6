"""translate.py: vLLM / vLLM-Ascend KV-cache configs and tensors -> kvconnect layouts.

No vLLM needed: the spec classes below are look-alikes with vLLM's class names and fields
(translate reads specs by class name and attribute). Tensors are CPU tensors shaped and
strided the way each engine registers them. Every layout is checked by geometry and by a
byte-exact store/retrieve round trip through KVCacheEngine into other blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch

from kvconnect import BlockTableError, Config, GroupSpec, KVCacheEngine, LayoutError
from kvconnect.integrations.vllm import engine_tables, request_reads, tensors, translate
from kvconnect.errors import UnsupportedLayoutError
from kvconnect.integrations.vllm.specs import group_spec_of
from kvconnect.integrations.vllm.translate import translate_kv_caches
from support.vllm_lookalikes import (  # the vLLM look-alikes
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    MambaSpec,
    ChunkedLocalAttentionSpec,
    RSWASpec,
    UniformTypeKVCacheSpecs,
    AscendMLAAttentionSpec,
    AscendSFAIndexerCacheSpec,
    KVCacheGroupSpec,
    KVCacheConfig,
    LegacyKVCacheConfig,
    NB,
    filled,
)


def _roundtrip(t: translate.Translation, num_tokens: int, src: list[int], dst: list[int], chunk: int) -> None:
    """Store tokens from blocks ``src`` (every vLLM group), retrieve into ``dst``, compare bytes.

    Block 0 is vLLM's null block, so it is never a source or a target.
    """
    engine = KVCacheEngine(t.layout, Config(chunk_size=chunk, max_local_cpu_size=0.01))
    tokens = np.arange(num_tokens, dtype=np.int64) + 7
    ids = tuple([tuple(src)] * t.num_vllm_groups)
    assert engine.store(tokens, t.block_tables(ids)) == num_tokens
    before = [p.clone() for p in t.layout.tensors]
    assert engine.retrieve(tokens, t.block_tables(tuple([tuple(dst)] * t.num_vllm_groups))) == num_tokens
    for plane, tensor, old in zip(t.layout.planes, t.layout.tensors, before):
        for s, d in zip(src, dst):  # whole blocks: the tokens fill the source blocks
            assert torch.equal(tensor[d], old[s]), f"{plane.name}: block {s} -> {d}"
        untouched = [b for b in range(plane.num_blocks) if b not in dst]
        assert torch.equal(tensor[untouched], old[untouched]), f"{plane.name}: bytes outside the target moved"


# --- specs -------------------------------------------------------------------------------
def test_group_specs_follow_vllm_rules():
    assert group_spec_of(FullAttentionSpec(16, 8, 128, torch.bfloat16)) == GroupSpec(block_size=16)
    # hybrid allocator off: a sliding layer under a FullAttentionSpec keeps every block
    assert group_spec_of(FullAttentionSpec(16, 8, 128, torch.bfloat16, sliding_window=128)) == GroupSpec(block_size=16)
    swa = group_spec_of(SlidingWindowSpec(32, 2, 64, torch.float32, sliding_window=64))
    assert (swa.sliding_window, swa.restore_window) == (64, 63)  # vLLM keeps the last W - 1 tokens
    assert group_spec_of(MLAAttentionSpec(256, 1, 584, torch.uint8, tokens_per_state=4)).compress_ratio == 4
    assert group_spec_of(AscendMLAAttentionSpec(512, 1, 512, torch.bfloat16, compress_ratio=4)).rows_per_block == 128


@pytest.mark.parametrize("spec", [
    MambaSpec(16),
    ChunkedLocalAttentionSpec(16, 8, 128, torch.bfloat16),
    FullAttentionSpec(16, 8, 128, torch.bfloat16, tokens_per_state=Fraction(1, 2)),
])
def test_unsupported_specs_keep_the_connector_off(spec):
    with pytest.raises(UnsupportedLayoutError):
        group_spec_of(spec)


def test_a_mamba_group_without_prefix_caching_turns_the_whole_model_off():
    attn = FullAttentionSpec(16, 2, 64, torch.float32)
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["a"], attn), KVCacheGroupSpec(["m"], MambaSpec(16))])
    caches = {"a": torch.zeros(NB, 16, 2, 64).permute(0, 2, 1, 3), "m": torch.zeros(1024, dtype=torch.int8)}
    with pytest.raises(UnsupportedLayoutError, match="mamba_cache_mode 'none'"):
        translate_kv_caches(config, caches)


# --- vLLM tensors ------------------------------------------------------------------------
def test_cpu_backend_pages(rng):
    """vLLM CPU: [B, H, N, 2D] with K transposed inside a (block, head) page -> one page per block."""
    spec = FullAttentionSpec(32, 2, 64, torch.float32)
    backing = filled((2, NB, 2, 32, 128), torch.float32, 1)  # all layers views of one allocation
    caches = {"l0": backing[0], "l1": backing[1]}
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["l0", "l1"], spec)], kv_cache_layout="LBHNC")
    t = translate_kv_caches(config, caches, backend_names={"l0": "CPU_ATTN", "l1": "CPU_ATTN"})
    assert [p.is_page for p in t.layout.planes] == [True, True]
    assert t.layout.planes[0].row_bytes == 2 * 32 * 128 * 4
    assert t.layout.groups == (GroupSpec(block_size=32),)
    _roundtrip(t, 64, src=[1, 2], dst=[5, 6], chunk=64)


def test_logical_view_with_token_rows():
    """vLLM >= 0.32 on GPU (LBNHC): a [B, H, N, C] view of [B, N, H, C] memory -> rows of H*C."""
    spec = FullAttentionSpec(16, 4, 32, torch.bfloat16)
    physical = filled((NB, 16, 4, 64), torch.bfloat16, 2)
    caches = {"l0": physical.permute(0, 2, 1, 3)}
    t = translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)]), caches, backend_names={"l0": "FLASH_ATTN"})
    (plane,) = t.layout.planes
    assert (plane.rows_per_block, plane.row_bytes, plane.is_page) == (16, 4 * 64 * 2, False)
    _roundtrip(t, 32, src=[3, 4], dst=[1, 7], chunk=16)


def test_logical_view_hnd_splits_heads():
    spec = FullAttentionSpec(16, 2, 32, torch.float16)
    caches = {"l0": filled((NB, 2, 16, 64), torch.float16, 3)}  # LBHNC memory, not a page backend
    t = translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)], kv_cache_layout="LBHNC"), caches)
    assert len(t.layout.planes) == 2 and t.layout.planes[0].row_bytes == 64 * 2
    _roundtrip(t, 16, src=[2], dst=[6], chunk=16)


def test_cpu_mla_view():
    """vLLM CPU MLA registers [NB, 1, 16, 576]: one token row of 576 per slot."""
    spec = MLAAttentionSpec(16, 1, 576, torch.bfloat16)
    caches = {"l0": filled((NB, 16, 1, 576), torch.bfloat16, 4).permute(0, 2, 1, 3),
              "l1": filled((NB, 16, 1, 576), torch.bfloat16, 5).permute(0, 2, 1, 3)}
    t = translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["l0", "l1"], spec)]), caches,
                            backend_names={"l0": "CPU_MLA", "l1": "CPU_MLA"})
    assert [(p.rows_per_block, p.row_bytes) for p in t.layout.planes] == [(16, 1152), (16, 1152)]
    _roundtrip(t, 32, src=[1, 3], dst=[4, 5], chunk=32)


def test_legacy_flash_layout():
    spec = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    caches = {"l0": filled((2, NB, 16, 2, 64), torch.bfloat16, 6)}  # [2, NB, BS, H, D]
    t = translate_kv_caches(LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)]), caches)
    assert len(t.layout.planes) == 2  # K and V
    _roundtrip(t, 16, src=[5], dst=[2], chunk=16)


# --- vLLM-Ascend tuples ------------------------------------------------------------------
def test_ascend_mla_nope_rope_and_indexer_scale():
    """One UniformType group: MLA layers as (nope, rope), indexer layers as (int8 K, fp16 scale)."""
    mla = AscendMLAAttentionSpec(32, 1, 576, torch.bfloat16)
    idx = AscendSFAIndexerCacheSpec(32, 1, 128, torch.int8)
    group = UniformTypeKVCacheSpecs(32, {"attn.0": mla, "indexer.0": idx})
    caches = {
        "attn.0": (filled((NB, 32, 1, 512), torch.bfloat16, 7), filled((NB, 32, 1, 64), torch.bfloat16, 8)),
        "indexer.0": [filled((NB, 32, 1, 128), torch.int8, 9), filled((NB, 32, 1, 1), torch.float16, 10)],
    }
    t = translate_kv_caches(LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["attn.0", "indexer.0"], group)]), caches)
    assert [p.row_bytes for p in t.layout.planes] == [1024, 128, 128, 2]
    assert t.layout.num_groups == 1 and t.source_groups == (0,)
    _roundtrip(t, 64, src=[1, 2], dst=[6, 7], chunk=32)


@pytest.mark.parametrize("release, block_size, storage", [
    (engine_tables.VLLM_ASCEND_0_23, 128, None),  # 0.23.0.post1: block_size = 128 rows (512 tokens)
    (engine_tables.VLLM_ASCEND_MAIN, 512, 128),  # main after PR 13242: block_size tokens, storage rows
])
def test_ascend_compressed_mla_in_both_block_semantics(release, block_size, storage):
    """DeepSeek V4 C4 on vLLM-Ascend: [NB, 128, 1, 512] per layer, 128 rows = 512 tokens per block."""
    spec = AscendMLAAttentionSpec(block_size, 1, 512, torch.bfloat16, compress_ratio=4, storage_block_size=storage)
    caches = {"c4": [filled((NB, 128, 1, 512), torch.bfloat16, 11)]}
    t = translate_kv_caches(LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["c4"], spec)]), caches, release=release)
    assert t.layout.groups == (GroupSpec(block_size=512, compress_ratio=4),)
    assert t.tokens_per_block(0) == 512
    _roundtrip(t, 1024, src=[2, 3], dst=[5, 6], chunk=256)


def test_ascend_release_rows_read_from_the_spec_not_the_shape():
    """Read with vLLM's token semantics, the 0.23 spec means 32 rows: the real tensor is refused."""
    spec = AscendMLAAttentionSpec(128, 1, 512, torch.bfloat16, compress_ratio=4)
    caches = {"c4": [filled((NB, 128, 1, 512), torch.bfloat16, 11)]}
    with pytest.raises(LayoutError, match="c4"):
        translate_kv_caches(LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["c4"], spec)]), caches,
                            release=engine_tables.VLLM)


def test_inconsistent_storage_block_size_is_refused():
    spec = AscendMLAAttentionSpec(512, 1, 512, torch.bfloat16, compress_ratio=4, storage_block_size=64)
    with pytest.raises(UnsupportedLayoutError, match="storage_block_size"):
        translate_kv_caches(LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["c4"], spec)]),
                            {"c4": [filled((NB, 128, 1, 512), torch.bfloat16, 1)]}, release=engine_tables.VLLM_ASCEND_MAIN)


def test_engine_release_table_by_version():
    assert engine_tables.ascend_release("0.23.0.post1") is engine_tables.VLLM_ASCEND_0_23
    assert engine_tables.ascend_release("0.22.1rc1") is engine_tables.VLLM_ASCEND_0_23
    assert engine_tables.ascend_release("0.24.0") is engine_tables.VLLM_ASCEND_MAIN
    assert engine_tables.ascend_release("0.13.0rc3") is engine_tables.VLLM_ASCEND_0_13  # its DeepSeek V4 line
    assert engine_tables.ascend_release("0.13.0") is engine_tables.VLLM_ASCEND_0_13
    assert engine_tables.release_of([AscendMLAAttentionSpec(16, 1, 576, torch.bfloat16)]) is engine_tables.VLLM  # look-alike


def test_kernel_block_split_of_a_hybrid_at_block_256():
    """vLLM-Ascend re-splits hybrid attention tensors into kernel blocks of 128: [2*NB, 128, H, D];
    vLLM block b is kernel blocks 2b and 2b+1, the null block stays null."""
    full, swa = FullAttentionSpec(256, 2, 64, torch.bfloat16), SlidingWindowSpec(256, 2, 64, torch.bfloat16, sliding_window=256)
    k, v = filled((2 * NB, 128, 2, 64), torch.bfloat16, 20), filled((2 * NB, 128, 2, 64), torch.bfloat16, 21)
    config = LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["swa"], swa), KVCacheGroupSpec(["full"], full)])
    t = translate_kv_caches(config, {"swa": (k, v), "full": (k, v)}, release=engine_tables.VLLM_ASCEND_0_23)
    assert t.kernel_splits == (2, 2) and t.layout.groups[1] == GroupSpec(block_size=128)
    assert t.tokens_per_block(1) == 256
    swa_table, full_table = t.block_tables(([0, 3], [5, 1]))
    assert swa_table.tolist() == [-1, -1, 6, 7] and full_table.tolist() == [10, 11, 2, 3]
    engine = KVCacheEngine(t.layout, Config(chunk_size=256, max_local_cpu_size=0.01))
    tokens = np.arange(512, dtype=np.int64)
    assert engine.store(tokens, t.block_tables(([1, 2], [3, 4]))) == 512
    before = k.clone()
    assert engine.retrieve(tokens, t.block_tables(([0, 6], [5, 7]))) == 512
    # full group: vLLM blocks 3, 4 -> 5, 7 (kernel 6..9 -> 10, 11, 14, 15)
    assert torch.equal(k[[10, 11, 14, 15]], before[[6, 7, 8, 9]])
    # window group (W 256: tokens 257..511 needed at 512): vLLM block 2 -> 6 (kernel 4, 5 -> 12, 13)
    assert torch.equal(k[12][1:], before[4][1:]) and torch.equal(k[13], before[5])
    engine.close()


def test_kernel_split_with_too_few_blocks_is_refused():
    full, swa = FullAttentionSpec(256, 2, 64, torch.bfloat16), SlidingWindowSpec(256, 2, 64, torch.bfloat16, sliding_window=512)
    k = filled((NB, 256, 2, 64), torch.bfloat16, 22)  # not re-split: contradicts the release table
    config = LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["swa"], swa), KVCacheGroupSpec(["full"], full)])
    with pytest.raises(LayoutError):
        translate_kv_caches(config, {"swa": (k, k), "full": (k, k)}, release=engine_tables.VLLM_ASCEND_0_23)


def test_overlapping_third_view_is_stored_once():
    """A5's indexer: K fp8 [.,128] + scale fp32 [.,1] in one 16896-byte page, and a third
    [.,132] view over the same page: two planes, the same bytes never stored twice."""
    page = 128 * 132
    # seeded; bytes below 0x7f so no fp32 scale is a NaN (torch.equal compares values)
    raw = torch.randint(0, 0x7F, (NB * page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    kview = torch.as_strided(raw, (NB, 128, 1, 128), (page, 128, 128, 1))
    scale = torch.as_strided(raw.view(torch.float32), (NB, 128, 1, 1), (page // 4, 1, 1, 1), 128 * 128 // 4)
    full = torch.as_strided(raw, (NB, 128, 1, 132), (page, 132, 132, 1))
    spec = AscendMLAAttentionSpec(128, 1, 128, torch.uint8, compress_ratio=4)
    t = translate_kv_caches(LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["idx"], spec)]), {"idx": [kview, scale, full]},
                            release=engine_tables.VLLM_ASCEND_0_23)
    assert [p.row_bytes for p in t.layout.planes] == [128, 4]
    _roundtrip(t, 1024, src=[1, 2], dst=[4, 6], chunk=256)


def test_partially_overlapping_views_are_refused():
    raw = torch.zeros(NB * 4096, dtype=torch.uint8)
    a = torch.as_strided(raw, (NB, 16, 1, 128), (4096, 128, 128, 1))
    b = torch.as_strided(raw, (NB, 16, 1, 128), (4096, 128, 128, 1), 64)  # half of each row of a
    spec = AscendMLAAttentionSpec(16, 1, 128, torch.uint8)
    with pytest.raises(UnsupportedLayoutError, match="overlaps"):
        translate_kv_caches(LegacyKVCacheConfig(NB, [KVCacheGroupSpec(["x"], spec)]), {"x": [a, b]},
                            release=engine_tables.VLLM_ASCEND_0_23)


# --- hybrid allocator, sharing, block ids ---------------------------------------------------
def test_hybrid_groups_share_memory_but_keep_both_layers():
    """HMA: a window layer and a full layer are views of the same allocation (one group owns a
    block at a time), so equal tensors in different groups are both kept."""
    full, swa = FullAttentionSpec(32, 2, 64, torch.float32), SlidingWindowSpec(32, 2, 64, torch.float32, sliding_window=64)
    shared = filled((NB, 2, 32, 128), torch.float32, 13)
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["swa"], swa), KVCacheGroupSpec(["full"], full)], kv_cache_layout="LBHNC")
    t = translate_kv_caches(config, {"swa": shared, "full": shared}, backend_names={"swa": "CPU_ATTN", "full": "CPU_ATTN"})
    assert t.layout.num_groups == 2 and t.source_groups == (0, 1)
    assert t.layout.groups[0].restore_window == 63 and t.layout.groups[1].sliding_window is None


def test_kv_sharing_layers_stored_once():
    spec = FullAttentionSpec(16, 2, 32, torch.float16)
    tensor = filled((NB, 16, 2, 64), torch.float16, 14).permute(0, 2, 1, 3)
    t = translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["l0", "l1"], spec)]), {"l0": tensor, "l1": tensor})
    assert [p.layer_name for p in t.layout.planes] == ["l0"]


def test_page_and_row_layers_of_one_group_split_into_two():
    spec = FullAttentionSpec(32, 2, 64, torch.float32)
    caches = {"p": filled((NB, 2, 32, 128), torch.float32, 15), "r": filled((NB, 32, 2, 128), torch.float32, 16).permute(0, 2, 1, 3)}
    t = translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["p", "r"], spec)], kv_cache_layout="LBHNC"),
                            caches, backend_names={"p": "CPU_ATTN"})
    assert t.layout.num_groups == 2 and t.source_groups == (0, 0)
    _roundtrip(t, 64, src=[1, 2], dst=[3, 4], chunk=64)


def test_block_tables_map_the_null_block():
    spec = FullAttentionSpec(16, 2, 32, torch.float16)
    caches = {"l0": filled((NB, 16, 2, 64), torch.float16, 17).permute(0, 2, 1, 3)}
    t = translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)]), caches)
    (table,) = t.block_tables(([0, 5, 0, 7],))
    assert table.tolist() == [-1, 5, -1, 7]
    with pytest.raises(BlockTableError):
        t.block_tables(([1], [2]))


def test_shape_not_matching_the_spec_is_a_layout_error():
    spec = FullAttentionSpec(16, 2, 32, torch.float16)
    with pytest.raises(LayoutError):
        translate_kv_caches(KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)]), {"l0": torch.zeros(NB, 3, 5, 64)})


def test_identity_separates_ranks_and_stages():
    spec = FullAttentionSpec(16, 2, 32, torch.float16)
    caches = {"l0": filled((NB, 16, 2, 64), torch.float16, 18).permute(0, 2, 1, 3)}
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)])
    base = translate_kv_caches(config, caches, model_name="m").layout.fingerprint
    assert translate_kv_caches(config, caches, model_name="m").layout.fingerprint == base
    assert translate_kv_caches(config, caches, model_name="m", tp_rank=1, tp_size=2).layout.fingerprint != base
    assert translate_kv_caches(config, caches, model_name="m", pp_rank=1, pp_size=2).layout.fingerprint != base
    assert translate_kv_caches(config, caches, model_name="other").layout.fingerprint != base


# --- scheduler-side reads ----------------------------------------------------------------
def _request(**kw):
    base = dict(request_id="r", prompt_token_ids=[5, 6, 7], num_tokens=4, mm_features=None, lora_request=None,
                prompt_embeds=None, cache_salt=None, num_computed_tokens=0)
    return SimpleNamespace(**{**base, **kw})


LORA = SimpleNamespace(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql")


@pytest.mark.parametrize("extra, cacheable", [
    ({}, True), ({"mm_features": [object()]}, False), ({"prompt_embeds": object()}, False),
    ({"mm_features": [SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=1, length=2))]}, True),
    ({"mm_features": [SimpleNamespace(identifier=None, mm_position=SimpleNamespace(offset=1, length=2))]}, False),
    ({"lora_request": LORA}, True), ({"cache_salt": "tenant"}, True), ({"prompt_token_ids": None}, False),
    ({"cache_salt": "x" * 5000}, False),  # too long for a namespace: neither looked up nor saved
    ({"lora_request": object()}, False),  # an adapter without a name cannot be told apart
])
def test_request_view_is_cacheable_only_when_tokens_namespace_and_media_decide_the_kv(extra, cacheable):
    view = request_reads.request_view(_request(**extra))
    assert view.cacheable is cacheable and view.num_tokens == 4


def test_request_namespace_is_lora_and_salt():
    ns = lambda **kw: request_reads.request_view(_request(**kw)).namespace  # noqa: E731
    assert ns() == b""  # plain requests keep the keys they always had
    variants = [ns(cache_salt="a"), ns(cache_salt="b"), ns(lora_request=LORA), ns(lora_request=LORA, cache_salt="a"),
                ns(lora_request=SimpleNamespace(lora_name="sql", lora_int_id=3, lora_path="/other")),
                ns(lora_request=SimpleNamespace(lora_name="sql2", lora_int_id=3, lora_path="/adapters/sql"))]
    assert len(set(variants)) == len(variants) and b"" not in variants
    # the int id is process-local: not part of the namespace (vLLM keys its prefix cache the same way)
    assert ns(lora_request=SimpleNamespace(lora_name="sql", lora_int_id=9, lora_path="/adapters/sql")) == ns(lora_request=LORA)
    assert ns(cache_salt="a") == ns(cache_salt="a")


def test_current_block_ids_prefer_the_scheduler_block_state():
    state = SimpleNamespace(get_block_ids=lambda r: ([1, 0, 3], [4]) if r == "a" else None)
    manager = SimpleNamespace(get_block_ids=lambda r: ([9], [9]))
    out = SimpleNamespace(kv_connector_block_state=state)
    assert request_reads.current_block_ids(out, manager, "a") == ((1, 0, 3), (4,))
    assert request_reads.current_block_ids(out, manager, "b") == ((9,), (9,))
    assert request_reads.current_block_ids(SimpleNamespace(), None, "a") is None


def test_block_outermost_packed_views_round_trip():
    """vLLM >= 0.32's block-outermost packing (seed 002; driven for real in
    tests/integration/vllm_dsv4_packed.py): one int8 backing buffer, every layer of a block side
    by side, each layer an ``as_strided`` ``[B, 1, N, C]`` view whose block stride spans the
    widest group's whole block; groups alias from byte 0 of a block (a block id belongs to one
    group at a time) and a UniformType group mixes compress ratios."""
    c4 = MLAAttentionSpec(16, 1, 512, torch.uint8, tokens_per_state=4)  # 4 rows of 584 B
    c8 = MLAAttentionSpec(16, 1, 512, torch.uint8, tokens_per_state=8)  # 2 rows
    swa = SlidingWindowSpec(4, 1, 512, torch.uint8, sliding_window=8)  # 4 rows
    row, nb = 584, 48
    mla_pages = [("c4.a", 4), ("c4.b", 4), ("c8", 2)]
    block_stride = sum(rows * row for _, rows in mla_pages)  # the widest group sets the block
    buf = filled((nb * block_stride,), torch.uint8, 21)
    caches, offset = {}, 0
    for name, rows in mla_pages:
        caches[name] = torch.as_strided(buf, (nb, 1, rows, row), (block_stride, rows * row, row, 1), offset)
        offset += rows * row
    for i, name in enumerate(("swa.a", "swa.b")):  # the SWA group starts at byte 0 again
        caches[name] = torch.as_strided(buf, (nb, 1, 4, row), (block_stride, 4 * row, row, 1), i * 4 * row)
    uniform = UniformTypeKVCacheSpecs(16, {"c4.a": c4, "c4.b": c4, "c8": c8})
    config = KVCacheConfig(nb, [KVCacheGroupSpec(["c4.a", "c4.b", "c8"], uniform),
                                KVCacheGroupSpec(["swa.a", "swa.b"], swa)], kv_cache_layout="BLHNC")
    t = translate_kv_caches(config, caches)
    assert [(g.block_size, g.compress_ratio, g.sliding_window) for g in t.layout.groups] == [
        (16, 4, None), (16, 8, None), (4, 1, 8)]
    assert t.source_groups == (0, 0, 1)

    tokens = np.arange(64, dtype=np.int64) + 3
    src = [list(range(1, 5)), list(range(5, 21))]
    dst = [list(range(21, 25)), list(range(25, 41))]
    engine = KVCacheEngine(t.layout, Config(chunk_size=16, max_local_cpu_size=0.01))
    assert engine.store(tokens, t.block_tables(src)) == 64
    old = buf.clone()
    buf.copy_(filled((nb * block_stride,), torch.uint8, 22))
    scrambled = buf.clone()
    assert engine.retrieve(tokens, t.block_tables(dst)) == 64
    old_blocks, new_blocks = old.view(nb, block_stride), buf.view(nb, block_stride)
    for name, rows in mla_pages:  # full groups: every row of every block, by vLLM's offsets
        start = caches[name].storage_offset()
        for s, d in zip(src[0], dst[0]):
            assert torch.equal(new_blocks[d, start:start + rows * row], old_blocks[s, start:start + rows * row]), name
    for i in range(2):  # the window: tokens 57..63 (W - 1 = 7), blocks 14 and 15 of the SWA table
        for token in range(57, 64):
            b, r = token // 4, token % 4
            at = i * 4 * row + r * row
            assert torch.equal(new_blocks[dst[1][b], at:at + row], old_blocks[src[1][b], at:at + row])
    untouched = [b for b in range(nb) if b not in dst[0] + dst[1]]
    assert torch.equal(new_blocks[untouched], scrambled.view(nb, block_stride)[untouched])
    engine.close()


# --- split blocks: caches vLLM writes as [rows x field 0][rows x field 1] (engine_tables.SplitRows) --


@dataclass(frozen=True)
class V4MLAAttentionSpec(FullAttentionSpec):  # vLLM 0.32 MLAAttentionSpec with its DeepSeek V4 fields
    cache_dtype_str: Optional[str] = None
    model_version: Optional[str] = None
    state_content_bytes: Optional[int] = None


@dataclass(frozen=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    cache_dtype_str: Optional[str] = None
    model_version: Optional[str] = None
    state_content_bytes: Optional[int] = None


V4MLAAttentionSpec.__name__ = "MLAAttentionSpec"  # vLLM's class name is what the table matches
FP8 = dict(cache_dtype_str="fp8_ds_mla", model_version="deepseek_v4", state_content_bytes=584)


def _v4_caches(nb=12):
    """DeepSeek V4 on vLLM 0.32: SWA (64-token blocks, 584-byte rows), C4 MLA and the C4 indexer
    (256-token blocks: 64 rows), as [B, 1, N, C] views into pages padded to 576 bytes."""
    swa = SlidingWindowMLASpec(64, 1, 512, torch.uint8, sliding_window=128, **FP8)
    c4 = V4MLAAttentionSpec(256, 1, 512, torch.uint8, tokens_per_state=4, **FP8)
    idx = V4MLAAttentionSpec(256, 1, 132, torch.uint8, tokens_per_state=4)
    pages = {"swa": (64, 584, 37440), "c4": (64, 584, 37440), "idx": (64, 132, 8640)}
    bufs = {n: filled((nb * page,), torch.uint8, i) for i, (n, (_, _, page)) in enumerate(pages.items())}
    caches = {n: torch.as_strided(bufs[n], (nb, 1, rows, row), (page, rows * row, row, 1))
              for n, (rows, row, page) in pages.items()}
    config = KVCacheConfig(nb, [KVCacheGroupSpec(["swa"], swa), KVCacheGroupSpec(["c4", "idx"],
                                UniformTypeKVCacheSpecs(256, {"c4": c4, "idx": idx}))], kv_cache_layout="BLHNC")
    return config, caches, bufs, pages


def test_deepseek_v4_fp8_and_indexer_blocks_become_sub_planes():
    config, caches, _, _ = _v4_caches()
    t = translate_kv_caches(config, caches)
    assert [(p.layer_name, p.row_bytes, p.row_stride_bytes, p.region_index) for p in t.layout.planes] == [
        ("swa", 576, 576, 0), ("swa", 8, 8, 1), ("c4", 576, 576, 0), ("c4", 8, 8, 1), ("idx", 128, 128, 0), ("idx", 4, 4, 1)]
    base = {n: c.data_ptr() for n, c in caches.items()}
    starts = [tensor.data_ptr() - base[p.layer_name] for p, tensor in zip(t.layout.planes, t.layout.tensors)]
    assert starts == [0, 64 * 576, 0, 64 * 576, 0, 64 * 128]
    # the same caches read as whole rows (a release without the table rows) are another identity
    whole = translate_kv_caches(config, caches, release=engine_tables.EngineRelease("vllm", compressed_block_unit="tokens"))
    assert [p.row_bytes for p in whole.layout.planes] == [584, 584, 132]
    assert whole.layout.fingerprint != t.layout.fingerprint


@pytest.mark.parametrize("spec, row, split", [
    (V4MLAAttentionSpec(256, 1, 512, torch.uint8, tokens_per_state=4, **FP8), 584, True),
    (V4MLAAttentionSpec(256, 1, 512, torch.uint8, tokens_per_state=4, cache_dtype_str="fp8_ds_mla"), 584, False),  # not V4
    (V4MLAAttentionSpec(64, 1, 656, torch.uint8, cache_dtype_str="fp8_ds_mla"), 656, False),  # V3.2: whole 656-B rows
    (V4MLAAttentionSpec(64, 1, 132, torch.uint8), 132, True),  # V3.2 indexer (indexer_k_quant_and_cache)
    (V4MLAAttentionSpec(64, 1, 132, torch.bfloat16), 264, False),
    (FullAttentionSpec(64, 1, 132, torch.uint8), 132, False),  # not an MLA spec
])
def test_split_rows_table_matches_the_spec_fields(spec, row, split):
    got = engine_tables.VLLM.row_regions(spec, str(spec.dtype).removeprefix("torch."), row)
    assert (got is not None) == split


def test_split_blocks_round_trip_from_a_boundary_inside_a_block():
    """Store 256-token chunks, restore at 512 into other blocks: the SWA window (W - 1 = 127
    tokens) starts at row 1 of a 64-token block. Each row's data and scale are compared where
    vLLM's write ops put them (data at row * 576, scale at 64 * 576 + row * 8 of the page), and
    every other byte of the destination pages is untouched."""
    config, caches, bufs, pages = _v4_caches(nb=16)
    t = translate_kv_caches(config, caches)
    tokens = np.arange(512, dtype=np.int64) + 11
    src, dst = [list(range(1, 9)), [1, 2]], [[0, 0, 0, 0, 0, 9, 10, 11], [3, 4]]
    engine = KVCacheEngine(t.layout, Config(chunk_size=256, max_local_cpu_size=0.01))
    assert engine.store(tokens, t.block_tables(src)) == 512
    old = {n: b.clone() for n, b in bufs.items()}
    for i, b in enumerate(bufs.values()):
        b.copy_(filled(b.shape, torch.uint8, 40 + i))
    scrambled = {n: b.clone() for n, b in bufs.items()}
    assert engine.retrieve(tokens, t.block_tables(dst)) == 512
    engine.close()

    def fields(name, block, row):
        rows, whole, page = pages[name]
        data, scale = (576, 8) if whole == 584 else (128, 4)
        at = block * page
        return [(at + row * data, data), (at + rows * data + row * scale, scale)]

    expected = {n: b.clone() for n, b in scrambled.items()}
    for token in range(512 - 127, 512):  # SWA: one row per token, 64 rows a block
        for at_src, at_dst in zip(fields("swa", src[0][token // 64], token % 64), fields("swa", dst[0][token // 64], token % 64)):
            expected["swa"][at_dst[0]:at_dst[0] + at_dst[1]] = old["swa"][at_src[0]:at_src[0] + at_src[1]]
    for name in ("c4", "idx"):  # 128 compressed rows: two whole 64-row blocks
        for row in range(128):
            for a, b in zip(fields(name, src[1][row // 64], row % 64), fields(name, dst[1][row // 64], row % 64)):
                expected[name][b[0]:b[0] + b[1]] = old[name][a[0]:a[0] + a[1]]
    for name in bufs:
        assert torch.equal(bufs[name], expected[name]), name


def test_unaudited_packed_deepseek_v4_cache_is_refused():
    """A packed DeepSeek V4 record the table does not describe (V4.1's 288-byte NVFP4 compressed
    record) is refused at registration rather than guessed as whole rows."""
    spec = V4MLAAttentionSpec(256, 1, 512, torch.uint8, tokens_per_state=4, cache_dtype_str="nvfp4_ds_mla",
                              model_version="deepseek_v4", state_content_bytes=288)
    cache = torch.as_strided(filled((8 * 18432,), torch.uint8, 5), (8, 1, 64, 288), (18432, 64 * 288, 288, 1))
    config = KVCacheConfig(8, [KVCacheGroupSpec(["c4"], spec)], kv_cache_layout="BLHNC")
    with pytest.raises(UnsupportedLayoutError, match="layer 'c4'.*in-block layout"):
        translate_kv_caches(config, {"c4": cache})
    v41 = V4MLAAttentionSpec(256, 1, 512, torch.uint8, tokens_per_state=4, cache_dtype_str="fp8_ds_mla",
                             model_version="deepseek_v4", state_content_bytes=528)  # V4.1 MXFP8: [64 x 512][64 x 16]
    assert engine_tables.VLLM.row_regions(v41, "uint8", 528).region_bytes == (512, 16)


def test_tiled_indexer_is_stored_as_whole_pages():
    """vLLM's ROCm V3.2 indexer (``uses_shuffled_layout``) tiles a block's values: no row is
    contiguous, so the layer becomes an opaque page per block (its own page group reading
    the MLA group's block ids; a restore boundary must then fall on a block edge)."""
    mla = MLAAttentionSpec(16, 1, 576, torch.bfloat16)
    idx = V4MLAAttentionSpec(16, 1, 132, torch.uint8)
    caches = {"attn": filled((NB, 1, 16, 576), torch.bfloat16, 1), "idx": filled((NB, 1, 16, 132), torch.uint8, 2)}
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["attn", "idx"], UniformTypeKVCacheSpecs(16, {"attn": mla, "idx": idx}))])
    module = SimpleNamespace(uses_shuffled_layout=True)
    vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"idx": module, "attn": object()}))
    assert tensors.tiled_layers(vllm_config, ["attn", "idx"]) == ["idx"]
    t = translate_kv_caches(config, caches, tiled_layers=["idx"])
    assert [(p.layer_name, p.is_page, p.row_bytes) for p in t.layout.planes] == [("attn", False, 1152), ("idx", True, 16 * 132)]
    assert t.source_groups == (0, 0)
    plain = translate_kv_caches(config, caches)  # not tiled: the split indexer rows
    assert [p.row_bytes for p in plain.layout.planes] == [1152, 128, 4]
    _roundtrip(t, 32, [1, 2], [5, 6], chunk=16)


# --- window-free restore points (engine_tables.WindowFree) ------------------------------
def test_c128_compressor_state_is_window_free_on_the_devices_it_was_shown_on():
    """vLLM's DeepSeek V4 C128 ``CompressorStateCache`` (fp32, window 128, block 8) gets restore window 0
    at multiples of 128 on CPU (the bench: tests/integration/dsv4_reads.py) and CUDA / ROCm (the state
    readers' code: tests/integration/test_vllm_spec_classes.py); nothing else, nowhere else."""
    state = SlidingWindowMLASpec(8, 1, 1024, torch.float32, sliding_window=128)
    for device in ("cpu", "cuda"):
        spec = group_spec_of(state, device_type=device)
        assert (spec.sliding_window, spec.restore_window, spec.window_free_every) == (128, 127, 128)
        assert engine_tables.VLLM.window_free_every(state, device) == 128
    for device in ("xpu", "npu", None):  # not shown there: keep the rows
        assert group_spec_of(state, device_type=device).window_free_every is None
    for release in (engine_tables.VLLM_ASCEND_0_23, engine_tables.VLLM_ASCEND_MAIN):  # AscendC compressor: unread
        for device in ("cpu", "npu"):
            assert group_spec_of(state, release, device_type=device).window_free_every is None
    others = [
        SlidingWindowMLASpec(4, 1, 2048, torch.float32, sliding_window=8),  # C4 compressor state: read
        SlidingWindowMLASpec(64, 1, 512, torch.uint8, sliding_window=128, **FP8),  # SWA: read
        SlidingWindowMLASpec(64, 1, 1024, torch.float32, sliding_window=128),  # another block size: not benched
        SlidingWindowSpec(8, 1, 1024, torch.float32, sliding_window=128),  # another spec class
    ]
    for other in others:
        assert group_spec_of(other, device_type="cpu").window_free_every is None, other


def test_refused_specs_name_the_class_and_the_reason():
    from kvconnect.integrations.vllm import specs

    for name, reason in specs.REFUSED_SPECS.items():
        lookalike = type(name, (FullAttentionSpec,), {})
        with pytest.raises(UnsupportedLayoutError) as err:
            group_spec_of(lookalike(16, 2, 64, torch.bfloat16))
        assert name in str(err.value) and reason in str(err.value)
    assert set(specs.REFUSED_SPECS) <= specs.known_specs()
    assert "Compress4AttentionSpec" in specs.known_specs(engine_tables.VLLM_ASCEND_0_13)
    assert "Compress4AttentionSpec" not in specs.known_specs(engine_tables.VLLM_ASCEND_0_23)


def test_rswa_is_a_full_group_whose_model_stores_prompt_chunks_only():
    """R-SWA (specs.PROMPT_ONLY): served as a full group; the rule fires on the spec (also inside a
    UniformTypeKVCacheSpecs) or on the model config's rswa_window, and on nothing else.
    tests/integration/test_vllm_sink_and_rswa.py proves it under vLLM's scheduler."""
    from kvconnect.integrations.vllm import specs

    rswa = RSWASpec(16, 2, 64, torch.bfloat16, rswa_window=128)
    group = group_spec_of(rswa)
    assert (group.block_size, group.sliding_window, group.compress_ratio) == (16, None, 1)
    assert "RSWASpec" in specs.known_specs() and "RSWASpec" not in specs.REFUSED_SPECS
    plain = SimpleNamespace(model_config=SimpleNamespace(rswa_window=None))
    one = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a"], rswa)])
    assert specs.prompt_only_reason(plain, one) == f"RSWASpec (rswa_window 128): {specs.PROMPT_ONLY}"
    uniform = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a", "b"], UniformTypeKVCacheSpecs(
        16, {"a": FullAttentionSpec(16, 2, 64, torch.bfloat16), "b": rswa}))])
    assert specs.prompt_only_reason(plain, uniform).startswith("RSWASpec")
    full = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a"], FullAttentionSpec(16, 2, 64, torch.bfloat16))])
    assert specs.prompt_only_reason(plain, full) is None and specs.prompt_only_reason(plain, None) is None
    windowed = SimpleNamespace(model_config=SimpleNamespace(rswa_window=128))
    assert specs.prompt_only_reason(windowed, full) == f"ModelConfig.rswa_window 128: {specs.PROMPT_ONLY}"


def test_translation_sets_the_rule_from_the_registered_tensors_device():
    state = SlidingWindowMLASpec(8, 1, 1024, torch.float32, sliding_window=128)
    group = SimpleNamespace(kv_cache_spec=state, layer_names=["layers.0.compressor.state_cache"])
    config = SimpleNamespace(kv_cache_groups=[group], num_blocks=6)
    caches = {"layers.0.compressor.state_cache": torch.zeros(6, 8, 1, 1024)}
    t = translate_kv_caches(config, caches)
    assert [g.window_free_every for g in t.layout.groups] == [128]


# --- vLLM-Ascend 0.13 (releases/v0.13.0's DeepSeek V4) ----------------------------------------
# SYNTHETIC look-alikes of vllm_ascend/core/kv_cache_spec.py's classes at 0.13.0rc3 (names and
# the fields translate reads); the release's own code builds the real ones in tests/ascend013.
@dataclass(frozen=True)
class Compress4AttentionSpec:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 512
    dtype: torch.dtype = torch.bfloat16
    compress_ratio: int = 4


@dataclass(frozen=True)
class Compress128AttentionSpec(Compress4AttentionSpec):
    compress_ratio: int = 128


def _v013_case(nb=256):
    config = LegacyKVCacheConfig(nb, [KVCacheGroupSpec(["c4"], Compress4AttentionSpec(128)),
                                      KVCacheGroupSpec(["c128"], Compress128AttentionSpec(128))])
    caches = {"c4": (filled((nb // 4, 128, 1, 512), torch.bfloat16, 1), filled((nb // 4, 128, 1, 128), torch.int8, 2),
                     filled((nb // 4, 128, 1), torch.float16, 3)),
              "c128": (filled((nb // 128, 128, 1, 512), torch.bfloat16, 4),)}
    return config, caches


def test_v013_compressed_specs_have_per_group_pools():
    config, caches = _v013_case()
    t = translate_kv_caches(config, caches, release=engine_tables.VLLM_ASCEND_0_13)
    assert t.layout.groups == (GroupSpec(block_size=512, compress_ratio=4), GroupSpec(block_size=16384, compress_ratio=128))
    assert [p.row_bytes for p in t.layout.planes] == [1024, 128, 2, 1024]
    with pytest.raises(UnsupportedLayoutError, match="Compress4AttentionSpec is not supported"):
        translate_kv_caches(config, caches, release=engine_tables.VLLM_ASCEND_0_23)  # not 0.23's specs


def test_v013_states_refusal_names_the_release_and_the_reason():
    config, caches = _v013_case()
    states = {"c4": (torch.zeros(6, 128, 512),), "c128": (torch.zeros(6, 128, 512),)}
    text = translate.states_refusal(config, caches, states, release=engine_tables.VLLM_ASCEND_0_13)
    assert "vllm-ascend 0.13" in text and "per request slot" in text and "stale" in text
    assert "kv_states of 2 layers" in text and "2 block-addressed groups" in text
    assert "Compress128AttentionSpec, Compress4AttentionSpec" in text
    generic = translate.states_refusal(config, caches, states, release=engine_tables.VLLM_ASCEND_0_23)
    assert "vllm-ascend-0.23 registered per-request state buffers" in generic and "do not translate" in generic


def test_model_identity_tells_apart_models_a_name_does_not():
    """The vLLM adapter names its model by name, revision and a digest of the config fields that
    decide the KV: the same path serving another checkpoint (other KV heads, another
    quantisation) is another identity, the same checkpoint the same one on every server."""

    class HF(SimpleNamespace):
        def to_dict(self):
            return dict(vars(self))

    def vllm_config(revision="r1", **hf):
        fields = dict(architectures=["LlamaForCausalLM"], num_hidden_layers=2, hidden_size=1024,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128, _name_or_path="/local/path")
        fields.update(hf)
        return SimpleNamespace(model_config=SimpleNamespace(model="/models/m", revision=revision, dtype=torch.bfloat16,
                                                            quantization=None, hf_config=HF(**fields)))

    base = translate.model_identity(vllm_config())
    assert base.startswith("/models/m@r1#") and len(base.split("#")[1]) == 16
    assert translate.model_identity(vllm_config()) == base  # prefill and decode servers agree
    assert translate.model_identity(vllm_config(_name_or_path="/elsewhere")) == base  # where it lies is no identity
    others = [vllm_config(num_key_value_heads=4), vllm_config(head_dim=64), vllm_config(revision="r2"),
              vllm_config(quantization_config={"quant_method": "fp8"})]
    assert len({translate.model_identity(c) for c in others} | {base}) == len(others) + 1
