"""vLLM's KV-cache spec fields with a kvconnect rule (``specs.SPEC_FIELDS``, issue 38 item 5), on
the installed vLLM (CI: 0.32 in tests/integration, 0.33 in its own stage).

- which installed release carries which field is what the table says;
- ``extra_retained_tokens`` / ``num_retained_tokens`` (multi-module MTP's tail below a sliding
  window): under vLLM's own Scheduler and SlidingWindowManager (vllm_rebuilt_rig, a hand-built
  full + sliding-window KVCacheConfig), kvconnect restores every row vLLM keeps readable after an
  external hit, byte-exact; with the old W - 1 rule the rig's row check fails (the negative control);
- ``num_hash_lookahead_tokens`` (0.33): vLLM's own ``VllmConfig`` property, with a real EAGLE
  ``SpeculativeConfig``, is 0 under a KV connector and non-zero without one, which kvconnect refuses.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK = 64
BLOCK = 16
WINDOW = 32
EXTRA = 24  # num_prefill_lookahead_tokens - 1 of a 25-module MTP chain: shrunk numbers, vLLM's rule


def _release() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return "0.33" if hasattr(KVConnectorBase_V1, "restore_kv_caches") else "0.32"  # as .ci/run tells them apart


@pytest.fixture
def rig(rebuilt_rig):
    return functools.partial(rebuilt_rig, chunk_size=CHUNK)  # conftest: closed after the test


def test_the_installed_release_carries_the_fields_the_table_names():
    from vllm.config import VllmConfig
    from vllm.v1 import kv_cache_interface as kv

    from kvconnect.integrations.vllm.specs import SPEC_FIELDS

    release = _release()
    for field in SPEC_FIELDS:
        for owner in field.owner:
            cls = VllmConfig if owner == "VllmConfig" else getattr(kv, owner)
            present = field.name in {f.name for f in dataclasses.fields(cls)} or hasattr(cls, field.name)
            assert present == (release in field.releases), (
                f"{owner}.{field.name}: {'present' if present else 'absent'} on vLLM {release}, "
                f"SPEC_FIELDS says {sorted(field.releases)}")


def _mtp_window_structure():
    from vllm.v1 import kv_cache_interface as kv
    from vllm_rebuilt_rig import Layer

    full = kv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    swa = kv.SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32,
                               sliding_window=WINDOW, extra_retained_tokens=EXTRA)
    return [[Layer("layers.0.attn", full)], [Layer("layers.1.attn", swa)]]


def _hit_after_scrub(r, seed: int):
    tokens = np.random.default_rng(seed).integers(3, 1000, 3 * CHUNK + 45)
    r.add(tokens)
    r.run()
    assert r.scheduler.reset_prefix_cache()  # vLLM forgets; kvconnect keeps the chunks
    for cache in r.kv_caches.values():
        cache.fill_(float("nan"))  # no row survives in vLLM's blocks: only a load brings one back
    req = r.add(tokens)
    return req


def test_mtp_retained_rows_are_restored_byte_exact(rig):
    """A sliding window with MTP's extra retained tokens: kvconnect's restore window is vLLM's retained
    count, and after kvconnect's hit at 192 every row vLLM keeps readable ([192 - 55, 192), blocks
    8..11 of the window group) holds its value (the rig checks before each forward)."""
    structure = _mtp_window_structure()
    swa = structure[1][0].spec
    if hasattr(swa, "num_retained_tokens"):  # vLLM 0.33's own name for it
        assert swa.num_retained_tokens == WINDOW - 1 + EXTRA
    r = rig(structure)
    layout = r.worker._worker.translation.layout
    assert [g.window_tokens for g in layout.groups] == [None, WINDOW - 1 + EXTRA]
    req = _hit_after_scrub(r, 5)
    r.run()  # check_rows: full rows [0, 192) and window rows [137, 192) restored, byte-exact
    assert r.computed_log[req.request_id][0][0] == 3 * CHUNK
    assert r.connector._scheduler.lookup_stats["hit_tokens"] == 3 * CHUNK
    r.assert_no_leak()


def test_the_rigs_row_check_catches_a_window_without_the_retained_tail(rig, monkeypatch):
    """The negative control: with the W - 1 rule (the retained tail ignored) kvconnect loads
    [161, 192) only, and rows vLLM keeps readable below it stay unwritten."""
    from kvconnect.integrations.vllm import specs

    monkeypatch.setattr(specs, "retained_tokens", lambda spec: spec.sliding_window - 1)
    r = rig(_mtp_window_structure())
    assert r.worker._worker.translation.layout.groups[1].window_tokens == WINDOW - 1
    _hit_after_scrub(r, 6)
    with pytest.raises(AssertionError, match=r"layers.1.attn row 137 \(token 137\) is wrong"):
        r.run()


def _hash_lookahead(config, speculative, transfer) -> int:
    """vLLM's own ``VllmConfig.num_hash_lookahead_tokens`` of a copy of ``config`` with these settings."""
    other = copy.copy(config)
    object.__setattr__(other, "speculative_config", speculative)
    object.__setattr__(other, "kv_transfer_config", transfer)
    return other.num_hash_lookahead_tokens


def test_vllm_keeps_legacy_hashes_under_a_connector_and_kvconnect_refuses_lookahead(rig, tiny_models):
    """vLLM 0.33's own ``VllmConfig.num_hash_lookahead_tokens`` with an EAGLE drafter (a real
    ``SpeculativeConfig`` over the tiny Llama as the draft, block drop on): 0 under the rig's KV
    connector, as vLLM's Scheduler and block pool then use, and the drafter's lookahead without
    a connector, which ``specs.config_refusal`` refuses."""
    if _release() != "0.33":
        pytest.skip("num_hash_lookahead_tokens is new in vLLM 0.33")
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    from kvconnect.integrations.vllm import specs

    r = rig(_mtp_window_structure())
    config = r.vllm_config
    assert config.num_hash_lookahead_tokens == 0 == r.scheduler.num_hash_lookahead_tokens
    assert r.scheduler.kv_cache_manager.block_pool.num_hash_lookahead_tokens == 0
    assert specs.config_refusal(config) is None
    model_dir = tiny_models("llama")
    target = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    eagle = SpeculativeConfig(method="eagle", model=model_dir, num_speculative_tokens=1, target_model_config=target,
                              target_parallel_config=ParallelConfig())
    assert eagle.use_eagle_block_drop()
    assert _hash_lookahead(config, eagle, config.kv_transfer_config) == 0  # a connector keeps the legacy hashes
    lookahead = _hash_lookahead(config, eagle, None)
    assert lookahead == 1  # EAGLE reads the next token
    reason = specs.config_refusal(SimpleNamespace(num_hash_lookahead_tokens=lookahead))
    assert reason and reason.startswith("VllmConfig.num_hash_lookahead_tokens = 1: ")
