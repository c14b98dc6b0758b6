"""rebuilt.py: vLLM's engine-rebuilt groups (rings, bounded-replay windows) in kvconnect's layout.

Look-alike spec classes with vLLM's names and fields (no vLLM needed); vLLM's own classes, its
Scheduler and KV-cache managers drive the same rule in tests/integration/test_vllm_rebuilt_groups.py.
A rebuilt group holds no plane and no byte, enters the fingerprint, and a hit lands only on its period.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvconnect import Config, KVCacheEngine, LayoutError
from kvconnect.errors import UnsupportedLayoutError
from kvconnect.integrations.vllm import engine_tables, rebuilt
from kvconnect.integrations.vllm.specs import group_spec_of, known_specs
from kvconnect.integrations.vllm.translate import translate_kv_caches
from kvconnect.layout.spec import RebuiltGroup
from support.vllm_lookalikes import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, NB, filled


@dataclass(frozen=True)
class CircularBufferSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class SlidingWindowMLASpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int = 128
    bounded_replay: bool = False
    tokens_per_state: object = 1


def _v41_like(ring_capacity=8, swa_block=64, main_block=64, ring_head=1024):
    """DeepSeek V4.1's group structure: full MLA, ratio-2 MLA, the ratio-2 ring, the replayed SWA."""
    groups = [
        KVCacheGroupSpec(["l.0.attn"], MLAAttentionSpec(main_block, 1, 64, torch.bfloat16)),
        KVCacheGroupSpec(["l.1.attn"], MLAAttentionSpec(main_block, 1, 64, torch.bfloat16, tokens_per_state=2)),
        KVCacheGroupSpec(["l.1.ring"], CircularBufferSpec(ring_capacity, 1, ring_head, torch.float32)),
        KVCacheGroupSpec(["l.0.swa", "l.1.swa"],
                         SlidingWindowMLASpec(swa_block, 1, 64, torch.bfloat16, sliding_window=128, bounded_replay=True)),
    ]
    caches = {
        "l.0.attn": filled((NB, 1, main_block, 64), torch.bfloat16, 1),
        "l.1.attn": filled((NB, 1, main_block // 2, 64), torch.bfloat16, 2),
        "l.1.ring": filled((NB, 1, ring_capacity, ring_head), torch.float32, 3),
        "l.0.swa": filled((NB, 1, swa_block, 64), torch.bfloat16, 4),
        "l.1.swa": filled((NB, 1, swa_block, 64), torch.bfloat16, 5),
    }
    return KVCacheConfig(NB, groups, kv_cache_layout="LBHNC"), caches


def test_rebuilt_groups_are_identity_without_planes():
    config, caches = _v41_like()
    t = translate_kv_caches(config, caches)
    assert t.source_groups == (0, 1)  # only the prefix-cacheable groups are stored
    assert {p.layer_name for p in t.layout.planes} == {"l.0.attn", "l.1.attn"}
    ring, swa = t.layout.rebuilt
    assert ring.what.startswith("CircularBufferSpec(block 8, heads 1, head 1024, float32)") and ring.resume_every == 8
    assert "bounded replay" in swa.what and "x 2 layers" in swa.what
    assert swa.resume_every == 64  # vLLM's scheduler block size: lcm(64, 64, 8, 64)
    assert t.layout.resume_every == 64 and t.layout.resumable_at(128) and not t.layout.resumable_at(100)
    # vLLM's block ids of all four groups in, kvconnect's two tables out
    tables = t.block_tables(((1, 2), (3, 4), (5,), (0, 6)))
    assert [list(x) for x in tables] == [[1, 2], [3, 4]]


def test_the_fingerprint_covers_the_rebuilt_groups():
    base = translate_kv_caches(*_v41_like()).layout.fingerprint
    assert translate_kv_caches(*_v41_like()).layout.fingerprint == base
    for other in (dict(ring_capacity=16), dict(ring_head=512), dict(swa_block=32)):
        assert translate_kv_caches(*_v41_like(**other)).layout.fingerprint != base, other
    config, caches = _v41_like()
    without = KVCacheConfig(NB, config.kv_cache_groups[:2], kv_cache_layout="LBHNC")
    plain = translate_kv_caches(without, {k: v for k, v in caches.items() if "attn" in k}).layout
    assert plain.fingerprint != base and plain.rebuilt == () and plain.resume_every == 1


def test_hits_land_only_on_the_rebuilt_period():
    """Chunks of 32 tokens over a layout whose rebuilt groups need multiples of 64: the gate offers
    only chunk ends on 64 (192 of 224 stored), and the retrieve restores them byte-exact."""
    config, caches = _v41_like(main_block=64, swa_block=64)
    t = translate_kv_caches(config, caches)
    engine = KVCacheEngine(t.layout, Config(chunk_size=32, max_local_cpu_size=0.01))
    tokens = np.arange(224, dtype=np.int64) + 3
    src = ((1, 2, 3, 4),) * 4
    assert engine.store(tokens, t.block_tables(src)) == 224
    for upto, hit in ((224, 192), (200, 192), (191, 128), (64, 64), (63, 0)):
        assert engine.lookup(tokens[:upto]) == hit, upto
    before = [x.clone() for x in t.layout.tensors]
    dst = ((5, 6, 7, 0),) * 4
    assert engine.retrieve(tokens[:200], t.block_tables(dst)) == 192
    for plane, x, old in zip(t.layout.planes, t.layout.tensors, before):
        assert torch.equal(x[5:8], old[1:4]), plane.name


def test_the_c128_rule_covers_both_spellings():
    """DeepSeek V4's C128 state: paged (window-free at multiples of 128 where shown) and PR 58074's ring
    (rebuilt: hits on multiples of 128 whatever the ring's capacity); V4.1's ratio-2 ring is not it."""
    rule = engine_tables.DSV4_C128_STATE_FREE
    paged = SlidingWindowMLASpec(8, 1, 1024, torch.float32, sliding_window=128)
    assert group_spec_of(paged, device_type="cuda").window_free_every == rule.every == 128
    c128_ring = CircularBufferSpec(128, 1, 1024, torch.float32)
    assert rule.applies_to_ring(c128_ring) and engine_tables.VLLM.ring_every(c128_ring) == 128
    assert not rule.applies_to_ring(CircularBufferSpec(8, 1, 1024, torch.float32))  # V4.1's ratio-2 ring
    assert engine_tables.VLLM.ring_every(CircularBufferSpec(8, 1, 1024, torch.float32)) is None
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["a"], FullAttentionSpec(256, 1, 64, torch.bfloat16)),
                                KVCacheGroupSpec(["c128"], c128_ring)], kv_cache_layout="LBHNC")
    (entry,) = rebuilt.rebuilt_groups(config)
    assert entry.resume_every == 128


def test_rebuilt_specs_are_known_and_never_a_group_spec():
    assert {"CircularBufferSpec"} <= known_specs(engine_tables.VLLM)
    with pytest.raises(UnsupportedLayoutError, match="engine-rebuilt"):
        group_spec_of(CircularBufferSpec(8, 1, 1024, torch.float32))
    with pytest.raises(UnsupportedLayoutError, match="engine-rebuilt"):
        group_spec_of(SlidingWindowMLASpec(64, 1, 64, torch.bfloat16, bounded_replay=True))
    mixed = KVCacheConfig(NB, [KVCacheGroupSpec(["a", "b"], _Uniform(8, {
        "a": CircularBufferSpec(8, 1, 64, torch.float32), "b": FullAttentionSpec(8, 1, 64, torch.float32)}))])
    with pytest.raises(UnsupportedLayoutError, match="mixes engine-rebuilt and stored"):
        rebuilt.rebuilt_groups(mixed)
    with pytest.raises(LayoutError):
        RebuiltGroup(what="ring", resume_every=0)


@dataclass(frozen=True)
class _Uniform:
    block_size: int
    kv_cache_specs: dict


_Uniform.__name__ = "UniformTypeKVCacheSpecs"
CircularBufferSpec.__name__ = "CircularBufferSpec"
SlidingWindowMLASpec.__name__ = "SlidingWindowMLASpec"
