"""What vLLM-Ascend 0.13.0rc3 registers for DeepSeek V4, built by its own code (harness013), and
what kvconnect's ``vllm-ascend-0.13`` table row makes of it."""

from __future__ import annotations

import torch

import harness013 as h
from kvconnect.errors import UnsupportedLayoutError
from kvconnect.integrations.vllm import engine_tables, translate

C4, C128 = "model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"


def test_the_release_specs_and_groups():
    from vllm_ascend.core.kv_cache_spec import Compress4AttentionSpec, Compress128AttentionSpec

    case = h.deepseek_v4()
    assert sorted(case.specs) == [f"model.layers.{i}.self_attn.attn" for i in range(2, h.NUM_LAYERS)]  # 0, 1: none
    c4, c128 = case.specs[C4], case.specs[C128]
    assert type(c4) is Compress4AttentionSpec and type(c128) is Compress128AttentionSpec
    assert (c4.block_size, c4.compress_ratio, c4.nope_dim, c4.rope_dim, c4.scale_dim) == (128, 4, 448, 64, 0)
    assert (c4.indexer_head_size, c4.indexer_dtype, c4.indexer_scale_dim, c4.indexer_scale_dtype) == (
        128, torch.int8, 1, torch.float16)
    assert (c128.block_size, c128.compress_ratio, c128.dtype) == (128, 128, torch.bfloat16)
    # one group per spec (patch_kv_cache_utils), num_blocks a multiple of 128
    assert [type(g.kv_cache_spec) for g in case.groups] == [Compress4AttentionSpec, Compress128AttentionSpec]
    assert case.num_blocks % 128 == 0


def test_the_registered_tensors_and_states():
    case = h.deepseek_v4()
    nb = case.num_blocks
    kv, index_k, index_scale = case.kv_caches[C4]
    assert (tuple(kv.shape), kv.dtype) == ((nb // 4, 128, 1, 512), torch.bfloat16)
    assert (tuple(index_k.shape), index_k.dtype) == ((nb // 4, 128, 1, 128), torch.int8)
    assert (tuple(index_scale.shape), index_scale.dtype) == ((nb // 4, 128, 1), torch.float16)
    (kv128,) = case.kv_caches[C128]
    assert tuple(kv128.shape) == (nb // 128, 128, 1, 512)
    # kv_states: per request slot ((max_num_reqs + 1) x 3 state blocks), not per KV block
    slots = (h.MAX_NUM_REQS + 1) * 3
    assert [tuple(t.shape) for t in case.kv_states[C4]] == [(slots, 128, 512)] + [(slots, 128, 1024)] * 2 + [
        (slots, 128, 256)] * 2
    assert [tuple(t.shape) for t in case.kv_states[C128]] == [(slots, 128, 512), (slots, 128, 512), (slots, 128, 512)]
    assert [tuple(t.shape) for t in case.kv_states["model.layers.0.self_attn.attn"]] == [(slots, 128, 512)]


def test_translation_row_vllm_ascend_0_13():
    case = h.deepseek_v4()
    assert engine_tables.ascend_release(h.RELEASE) is engine_tables.VLLM_ASCEND_0_13
    t = translate.translate_kv_caches(case.kv_cache_config, case.kv_caches, model_name="dsv4")
    assert t.release == "vllm-ascend-0.13"  # detected: the spec classes' package and the installed version
    groups = t.layout.groups
    assert [(g.compress_ratio, g.block_size, g.rows_per_block) for g in groups] == [(4, 512, 128), (128, 16384, 128)]
    assert all(g.sliding_window is None for g in groups)
    assert t.source_groups == (0, 1)
    planes = {(p.layer_name, p.row_bytes) for p in t.layout.planes}
    assert {(C4, 1024), (C4, 128), (C4, 2), (C128, 1024)} <= planes
    assert len([p for p in t.layout.planes if p.layer_name == C4]) == 3


def test_the_0_23_row_refuses_these_tensors():
    """The same registration read with vLLM-Ascend 0.23's semantics (one pool of num_blocks for
    every group) is refused: its tensors hold num_blocks / ratio blocks, fewer than 0.23 hands out."""
    import pytest

    case = h.deepseek_v4()
    with pytest.raises(UnsupportedLayoutError, match="Compress4AttentionSpec is not supported|fewer than"):
        translate.translate_kv_caches(case.kv_cache_config, case.kv_caches, release=engine_tables.VLLM_ASCEND_0_23)


def test_a5_specs_cannot_be_built_by_this_release():
    """Why only A2/A3 is covered: on A5 the release's get_kv_cache_spec passes ``nope_dytpe`` (sic),
    which Compress4AttentionSpec does not take. Should a later build fix it, this fails: add A5."""
    import pytest

    with pytest.raises(TypeError, match="nope_dytpe"):
        h.deepseek_v4(device="A5")
