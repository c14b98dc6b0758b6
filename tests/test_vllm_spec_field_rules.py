"""specs.SPEC_FIELDS: vLLM's KV-cache spec fields with a kvconnect rule (issue 38 item 5).

Look-alike spec classes with vLLM's names and fields (no vLLM needed): vLLM 0.32 spells the
retained tail below a sliding window ``extra_retained_tokens``, vLLM 0.33 adds the
``num_retained_tokens`` property (their sum with W - 1) and ``MLAAttentionSpec.topk_buffer_width``.
vLLM's own classes, Scheduler and SlidingWindowManager drive the same rules in
tests/integration/test_vllm_spec_fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch

from kvconnect import Config, KVCacheEngine
from kvconnect.integrations.vllm import specs
from kvconnect.integrations.vllm.specs import SPEC_FIELDS, SpecField, config_refusal, group_spec_of, retained_tokens
from kvconnect.integrations.vllm.translate import translate_kv_caches
from support.vllm_lookalikes import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, NB, filled


@dataclass(frozen=True)
class SlidingWindowSpec:  # vLLM 0.32: the field only
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int = 64
    extra_retained_tokens: int = 0


@dataclass(frozen=True)
class SlidingWindowSpec033(SlidingWindowSpec):  # vLLM 0.33: the field and its property
    @property
    def num_retained_tokens(self) -> int:
        return self.sliding_window - 1 + self.extra_retained_tokens


SlidingWindowSpec033.__name__ = "SlidingWindowSpec"


@dataclass(frozen=True)
class MLAAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    tokens_per_state: object = 1
    topk_buffer_width: Optional[int] = None


def test_every_field_has_a_known_rule_and_a_reason():
    assert {f.name for f in SPEC_FIELDS} >= {"num_retained_tokens", "num_hash_lookahead_tokens", "topk_buffer_width",
                                             "extra_retained_tokens"}
    for field in SPEC_FIELDS:
        assert field.rule in SpecField.RULES and field.why and field.owner and field.releases
    with pytest.raises(ValueError, match="rule 'ignored'"):
        SpecField("x", frozenset({"FullAttentionSpec"}), frozenset({"0.33"}), "ignored", "no")


@pytest.mark.parametrize("cls", [SlidingWindowSpec, SlidingWindowSpec033])
def test_the_restore_window_is_what_vllm_retains(cls):
    plain = group_spec_of(cls(16, 2, 16, torch.float32, sliding_window=32))
    mtp = group_spec_of(cls(16, 2, 16, torch.float32, sliding_window=32, extra_retained_tokens=24))
    assert (plain.sliding_window, plain.restore_window) == (32, 31)  # W - 1, as before
    assert (mtp.sliding_window, mtp.restore_window) == (32, 55)  # W - 1 + the MTP tail vLLM keeps
    assert retained_tokens(cls(16, 2, 16, torch.float32, sliding_window=1)) == 0
    assert group_spec_of(cls(16, 2, 16, torch.float32, sliding_window=1)).restore_window == 1


def test_the_property_is_read_where_present():
    """vLLM 0.33 asks consumers to read num_retained_tokens; a release that changed it is followed."""

    @dataclass(frozen=True)
    class Wider(SlidingWindowSpec):
        @property
        def num_retained_tokens(self) -> int:
            return 40

    Wider.__name__ = "SlidingWindowSpec"
    assert group_spec_of(Wider(16, 2, 16, torch.float32, sliding_window=32)).restore_window == 40


def _layout(swa, seed=0):
    full = FullAttentionSpec(16, 2, 16, torch.float32)
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["swa"], swa)])
    caches = {"full": filled((NB, 2, 16, 2, 16), torch.float32, seed), "swa": filled((NB, 2, 16, 2, 16), torch.float32, seed + 1)}
    return translate_kv_caches(config, caches)


def _restore(t, tables) -> int:
    engine = KVCacheEngine(t.layout, Config(chunk_size=16, max_local_cpu_size=0.01))
    tokens = np.arange(64, dtype=np.int64) + 7
    assert engine.store(tokens, t.block_tables(((1, 2, 3, 4), (1, 2, 3, 4)))) == 64
    return engine.retrieve(tokens, t.block_tables(tables))


def test_a_retained_tail_is_restored_byte_exact_and_enters_the_identity():
    """At 64 with W = 32: W - 1 needs tokens [33, 64) (window blocks 2, 3); with MTP's 24-token
    tail vLLM keeps [9, 64), blocks 0..3, and kvconnect restores all of them, byte-exact. The tail
    changes what a hit needs, so it enters the fingerprint."""
    from kvconnect import BlockTableError

    plain = _layout(SlidingWindowSpec033(16, 2, 16, torch.float32, sliding_window=32))
    mtp = _layout(SlidingWindowSpec033(16, 2, 16, torch.float32, sliding_window=32, extra_retained_tokens=24))
    assert mtp.layout.groups[1].window_tokens == 55 and plain.layout.groups[1].window_tokens == 31
    assert mtp.layout.fingerprint != plain.layout.fingerprint
    dropped = ((5, 6, 7, 1), (0, 0, 7, 5))  # the window blocks vLLM frees without a tail: null
    assert _restore(plain, dropped) == 64
    with pytest.raises(BlockTableError, match="needs block index 0"):
        _restore(mtp, dropped)  # vLLM allocates the tail's blocks: a table without them is wrong input
    before = [t.clone() for t in mtp.layout.tensors]
    assert _restore(mtp, ((5, 6, 7, 1), (5, 6, 7, 1))) == 64
    for plane, tensor, old in zip(mtp.layout.planes, mtp.layout.tensors, before):
        assert tensor.shape[1] == 16  # [blocks, rows, heads, head]
        for i, (src, dst) in enumerate(zip((1, 2, 3, 4), (5, 6, 7, 1))):
            first = 9 if plane.group_index == 1 and i == 0 else 0  # the window group: tokens [9, 64) only
            assert torch.equal(tensor[dst, first:], old[src, first:]), f"{plane.name}: block {src} -> {dst}"
            if first:
                assert torch.equal(tensor[dst, :first], old[dst, :first])  # rows outside the window: untouched


def test_topk_buffer_width_changes_no_row():
    """A read-side index buffer's width: the same GroupSpec, the same layout identity."""
    without = MLAAttentionSpec(64, 1, 32, torch.float32)
    with_width = MLAAttentionSpec(64, 1, 32, torch.float32, topk_buffer_width=2176)
    assert group_spec_of(with_width) == group_spec_of(without)
    layouts = []
    for spec in (without, with_width):
        config = KVCacheConfig(NB, [KVCacheGroupSpec(["mla"], spec)])
        layouts.append(translate_kv_caches(config, {"mla": filled((NB, 1, 64, 32), torch.float32, 3)}).layout)
    assert layouts[0].fingerprint == layouts[1].fingerprint


def test_hash_lookahead_is_refused_unless_zero():
    assert config_refusal(SimpleNamespace()) is None  # vLLM 0.32: no such property
    assert config_refusal(SimpleNamespace(num_hash_lookahead_tokens=0)) is None
    reason = config_refusal(SimpleNamespace(num_hash_lookahead_tokens=2))
    assert reason.startswith("VllmConfig.num_hash_lookahead_tokens = 2: ") and "legacy hashes" in reason
    assert reason.endswith(next(f.why for f in specs.SPEC_FIELDS if f.name == "num_hash_lookahead_tokens"))
