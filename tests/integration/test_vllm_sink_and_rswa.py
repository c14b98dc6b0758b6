"""SinkFullAttentionSpec and RSWASpec settled under vLLM's own Scheduler and KV-cache managers
(issue 38 item 1; vllm_rebuilt_rig: hand-built KVCacheConfigs, the forward faked; 0.32 here,
0.33 in its own stage).

- ``SinkFullAttentionSpec`` (openPangu's static sink attention) does not run on the installed
  release: vLLM's own KV-cache manager fails to build its manager (TypeError), and nothing reserves
  the blocks its layer writes sink rows into (the manager hands them to the first request as its
  blocks 0, 1, ...). kvconnect refuses it by name with that reason; a release that changes any of
  this fails here.
- ``RSWASpec`` (Unlimited-OCR's Reference Sliding Window Attention) is served as a full group with
  the prompt-only rule: a generated token's row (computed with a window) is never stored, even with
  ``save_decode_cache``; a decode-extended prefix hits only the storing request's prompt chunks,
  byte-exact; vLLM's RSWAManager frees decode gap blocks and never a prompt block. The negative
  control: without the rule the same run stores decode rows and the next request loads them.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK = 64


@pytest.fixture
def rig(rebuilt_rig):
    return functools.partial(rebuilt_rig, chunk_size=CHUNK)  # conftest: closed after the test


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, n)


# --- SinkFullAttentionSpec ----------------------------------------------------------------------
def test_sink_full_attention_runs_on_no_installed_release_and_is_refused_with_that_reason(rig):
    import torch
    from vllm.v1 import kv_cache_interface as kv
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager

    from kvconnect.integrations.vllm import specs
    from support import spec_classes
    from vllm_rebuilt_rig import Layer

    spec = kv.SinkFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sink_len=32)
    r = rig([[Layer("model.layers.0.self_attn.attn", spec)]], start_scheduler=False)
    assert r.worker._worker.translation is None  # kvconnect stayed off (refused by name)
    assert "needs_kv_cache_zeroing" in specs.REFUSED_SPECS["SinkFullAttentionSpec"]
    # vLLM's own KV-cache manager, as its Scheduler builds it (the Scheduler itself would leave its
    # connector's sockets open when this raises), cannot build the spec's manager: no model with this
    # spec runs on this release
    with pytest.raises(TypeError, match=r"SinkFullAttentionManager\.__init__\(\) got an unexpected keyword "
                                        r"argument 'needs_kv_cache_zeroing'"):
        KVCacheManager(kv_cache_config=r.kv_cache_config, max_model_len=2048, scheduler_block_size=16,
                       hash_block_size=16)
    # where the sink rows would live: the layer writes them at slots B .. B + sink_len - 1 (blocks 1 ..
    # sink_len / B) and prepends those blocks to every block table ...
    root = spec_classes.package_dir("vllm")
    sink = "".join((root / "model_executor/layers/attention/static_sink_attention.py").read_text().split())
    assert "sink_kv_slot_mapping=torch.arange(self.block_size,self.sink_len+self.block_size," in sink
    assert "self.block_table_with_sink[:,:self.num_sink_blocks]=torch.arange(1,self.num_sink_blocks+1," in sink
    # ... which no code reserves (sink_len appears in these files only): the manager itself, built with
    # the arguments its __init__ takes, maps a request's block b to tokens b x B .. (b + 1) x B - 1 in
    # the pool's first free blocks, so the first request's blocks 0 and 1 ARE the sink blocks 1 and 2
    users = {str(p.relative_to(root)) for p in root.rglob("*.py") if "sink_len" in p.read_text()}
    assert users == {"v1/kv_cache_interface.py", "v1/core/single_type_kv_cache_manager.py",
                     "model_executor/layers/attention/static_sink_attention.py", "model_executor/models/openpangu.py"}
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    manager = SinkFullAttentionManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                                       scheduler_block_size=16)
    manager.allocate_new_blocks("r0", 40, 40)
    assert [b.block_id for b in manager.req_to_blocks["r0"]] == [1, 2, 3]


# --- RSWASpec -----------------------------------------------------------------------------------
def _decode_extended_run(r, seed: int):
    """Request A (a 173-token prompt, 150 generated tokens), then B: A's prompt and outputs and 20 new
    tokens, a prefix whose tokens past A's prompt A computed with its decode window."""
    prompt = _prompt(seed, 2 * CHUNK + 45)
    a = r.add(prompt, max_tokens=150)
    r.run()
    extended = np.concatenate([np.asarray(a.all_token_ids, dtype=np.int64), _prompt(seed + 1, 20)])
    assert len(extended) == len(prompt) + 150 + 20
    b = r.add(extended, max_tokens=2)
    return a, b


def test_rswa_serves_prompt_chunks_only_byte_exact(rig):
    """Unlimited-OCR's group (rswa_window 32, block 16): with save_decode_cache asked for, kvconnect
    stores only A's two whole prompt chunks; B, extending A's prompt with A's own outputs, hits
    exactly them and its rows are prompt-computed (the fake forward checks every row it loads)."""
    from kvconnect.integrations.vllm import specs
    from vllm_rebuilt_rig import unlimited_ocr

    # vLLM itself turns its prefix cache off for Unlimited-OCR (R-SWA decode KV is not reusable)
    r = rig(unlimited_ocr(window=32), enable_prefix_caching=False, extra={"save_decode_cache": True})
    assert "RSWASpec (rswa_window 32)" in specs.prompt_only_reason(r.vllm_config, r.kv_cache_config)
    (group,) = r.worker._worker.translation.layout.groups
    assert (group.block_size, group.sliding_window) == (16, None)  # a full group: every row of a chunk
    assert not r.connector._scheduler.save_decode_cache  # the rule overrides the setting
    a, b = _decode_extended_run(r, seed=5)
    # vLLM freed the decode gap, blocks [ceil(173 / 16), (322 - 32) // 16), never a prompt block (the rig checks)
    assert r.gap_blocks[a.request_id] == 7
    stats = r.engine.stats_snapshot()
    assert stats["stored_chunks"] == 2  # [0, 64), [64, 128): wholly inside A's 173-token prompt
    r.run()  # B's first forward checked rows [0, 128) hold prompt-computed values
    lookups = r.connector._scheduler.lookup_stats
    assert lookups["hits"] == 1 and lookups["hit_tokens"] == 2 * CHUNK
    assert r.computed_log[b.request_id][0][0] == 2 * CHUNK  # never past A's prompt: a decode-extended prefix
    assert r.engine.stats_snapshot()["stored_chunks"] == 2 + 3  # B's own prompt chunks, all prompt-computed
    r.assert_no_leak()


def test_without_the_prompt_only_rule_decode_rows_are_served_and_the_rig_catches_them(rig, monkeypatch):
    """The negative control: the rule switched off (a plain full group with save_decode_cache), a
    window of 128 so that vLLM has freed none of a decode chunk's blocks when kvconnect saves it:
    chunks [128, 320) of A's decode are stored, B hits 320 and loads row 173, a generated token's."""
    from kvconnect.integrations.vllm import specs
    from vllm_rebuilt_rig import unlimited_ocr

    monkeypatch.setattr(specs, "prompt_only_reason", lambda vllm_config, kv_cache_config: None)
    r = rig(unlimited_ocr(window=128), enable_prefix_caching=False, extra={"save_decode_cache": True})
    assert r.connector._scheduler.save_decode_cache
    _decode_extended_run(r, seed=5)
    assert r.engine.stats_snapshot()["stored_chunks"] == 5  # two prompt chunks and three with decode rows
    with pytest.raises(AssertionError, match=r"row 173 is .* \(prompt value\)"):
        r.run()
