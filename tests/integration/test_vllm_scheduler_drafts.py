"""Speculative decoding under vLLM's own Scheduler (issue 38 item 4; kvconnect/integrations/vllm/drafts.py).

A drafter with KV layers (EAGLE here, a real ``SpeculativeConfig`` over a tiny Llama as the
draft) registers its attention layer in the same KV-cache config as the target's, and vLLM's
own grouping (``get_kv_cache_configs``) puts it in the target's group (or, with a spec marker,
flags its group ``is_eagle_group``). kvconnect refuses both by rule: the connector stays off
for the model, so a repeated prompt gets no external tokens and no chunk is stored; a
KV-free proposer (n-gram) and no speculation are served.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama")


def _speculative(model_dir: str, method: str):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    extra = {"model": model_dir} if method in ("eagle", "draft_model") else {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return SpeculativeConfig(method=method, num_speculative_tokens=1, target_model_config=target,
                             target_parallel_config=ParallelConfig(), **extra)


def _specs(draft_spec=None):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_scheduler_rig import HEAD_SIZE, KV_HEADS, NUM_LAYERS

    spec = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(NUM_LAYERS)}
    specs[f"model.layers.{NUM_LAYERS}.self_attn.attn"] = draft_spec or spec  # EAGLE's layer registers after the target's
    return specs


def test_eagle_draft_layers_in_the_target_group_turn_kvconnect_off(model_dir, caplog):
    from vllm_scheduler_rig import make_rig

    with caplog.at_level(logging.WARNING):
        rig = make_rig(model_dir, chunk_size=64, layer_specs=_specs(), speculative_config=_speculative(model_dir, "eagle"),
                       enable_prefix_caching=False)  # a repeat could come back only through kvconnect
    try:
        groups = rig.kv_cache_config.kv_cache_groups
        assert len(groups) == 1 and "model.layers.2.self_attn.attn" in groups[0].layer_names  # vLLM: one group, draft inside
        assert not groups[0].is_eagle_group  # no spec marker: vLLM flags nothing (it then drops blocks in every group)
        assert rig.engine is None  # kvconnect registered nothing: no chunk can be stored as target layers
        assert any("off for this model: speculative decoding (method 'eagle')" in r.getMessage() for r in caplog.records)
        prompt = np.arange(3, 3 + 200)
        rig.add(prompt)
        rig.run()
        rig.add(prompt)
        rig.run()
        assert rig.connector._scheduler.lookup_stats["lookups"] == 2  # asked twice, offered nothing
        assert rig.connector._scheduler.lookup_stats["hits"] == 0
        assert rig.worker._worker.stats().get("saves", 0) == 0 and rig.worker._worker.stats()["enabled"] == 0
        rig.assert_no_leak()
    finally:
        rig.close()


def test_a_flagged_draft_group_is_refused_by_name(model_dir):
    """A drafter whose spec carries vLLM's marker (``non_causal_multi_token_decode``) gets a group of
    its own, flagged ``is_eagle_group`` by vLLM's ``_annotate_eagle_groups``; the refusal names it."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
    from vllm_scheduler_rig import make_rig

    from kvconnect.integrations.vllm.drafts import draft_refusal

    # a hybrid target (one full, one sliding layer: vLLM groups by page size, then annotates) and a
    # marked MLA drafter of the same page size (16 x 128 x fp32 = 2 x 16 x 2 x 32 x fp32)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    draft = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=torch.float32,
                             non_causal_multi_token_decode=True)
    specs = {"model.layers.0.self_attn.attn": full, "model.layers.1.self_attn.attn": window,
             "model.layers.2.self_attn.attn": draft}
    rig = make_rig(model_dir, chunk_size=64, layer_specs=specs, speculative_config=_speculative(model_dir, "eagle"),
                   start_scheduler=False)
    try:
        flagged = [i for i, g in enumerate(rig.kv_cache_config.kv_cache_groups) if g.is_eagle_group]
        assert flagged and all("model.layers.2.self_attn.attn" in rig.kv_cache_config.kv_cache_groups[i].layer_names
                               for i in flagged)
        assert f"groups {flagged} as draft groups" in draft_refusal(rig.vllm_config, rig.kv_cache_config)
        assert rig.engine is None
    finally:
        rig.scheduler = None
        rig.close()


@pytest.mark.parametrize("method, refused", [("ngram", False), ("draft_model", True), ("eagle", True), (None, False)])
def test_the_rule_per_method(model_dir, method, refused):
    from types import SimpleNamespace

    from kvconnect.integrations.vllm.drafts import draft_refusal

    spec = _speculative(model_dir, method) if method else None
    config = SimpleNamespace(speculative_config=spec)  # the rule reads only this of vLLM's config
    groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(is_eagle_group=False)])
    assert bool(draft_refusal(config, groups)) is refused


def test_kv_free_speculation_is_served(model_dir):
    """n-gram proposes without KV layers: the config holds the target's layers only, kvconnect registers."""
    from vllm_scheduler_rig import make_rig

    rig = make_rig(model_dir, chunk_size=64, speculative_config=_speculative(model_dir, "ngram"), start_scheduler=False)
    try:
        assert rig.engine is not None
    finally:
        rig.scheduler = None
        rig.close()
