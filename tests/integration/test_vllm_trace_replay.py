"""The trace replay through vLLM's scheduler (benchmarks/vllm_trace_replay.py) and its peer,
vLLM's OffloadingConnector on the CPU copy worker of benchmarks/offloading_cpu_shim.py.

- The peer's copy worker moves the right bytes: under the scheduler rig's own forward (every
  row written from its token prefix and checked before each forward), a request that loads its
  prefix from the peer computes on correct rows.
- On a full-attention layout, where the two connectors' rules agree, kvconnect and the peer serve
  the same tokens and store the same bytes: the harness measures the connector, not itself.
- On the sliding-window hybrid, kvconnect through vLLM at 256- and 2048-token prefill steps
  serves what the engine-API replay serves and stores the same objects (issue 33: the step
  size no longer decides what is stored).

The requests are a small conversation in the public traces' format (hash ids of 512-token
blocks): turns that extend their prompt and branches off a shared prefix.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

REPO = Path(__file__).resolve().parents[2]
TRACE = [  # input_length, hash ids: r1 extends r0, r2..r4 branch off their 1024-token prefix
    {"input_length": 1900, "hash_ids": [1, 2, 3, 4]},
    {"input_length": 2900, "hash_ids": [1, 2, 3, 4, 5, 6]},
    {"input_length": 1500, "hash_ids": [1, 2, 7]},
    {"input_length": 1300, "hash_ids": [1, 2, 8]},
    {"input_length": 1700, "hash_ids": [1, 2, 9, 10]},
    {"input_length": 3000, "hash_ids": [1, 2, 3, 4, 5, 6, 11]},
]
MAX_LEN = 3072


@pytest.fixture(scope="module")
def replay():
    spec = importlib.util.spec_from_file_location("vllm_trace_replay", REPO / "benchmarks" / "vllm_trace_replay.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_trace_replay"] = module
    spec.loader.exec_module(module)  # puts benchmarks/ and the rig on sys.path
    return module


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama")


def _full_specs(replay, layers: int = 3) -> dict:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=replay.BLOCK, num_kv_heads=replay.HEADS, head_size=replay.HEAD_SIZE,
                             dtype=torch.float32)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}


def test_the_peer_loads_the_rows_the_forward_wrote(replay, model_dir):
    rig = replay.peer_rig(model_dir, step=512, max_len=MAX_LEN, pool_gb=0.05)
    loaded = []
    try:
        for req in TRACE[:3]:
            rig.add(replay.prompt_tokens(req), max_tokens=2)
            replay.run_peer(rig, lambda out: loaded.extend(r.num_computed_tokens for r in out.scheduled_new_reqs))
        # every forward checked the rows of every computed token: the loads brought the right bytes
        assert loaded == [0, 1792, 1024]  # r0's whole chunks; r0's 1024-token prefix
        assert rig.worker.connector_worker.worker.bytes_loaded > 0
    finally:
        rig.close()


def test_on_full_attention_kvconnect_and_the_peer_agree(replay, model_dir):
    ours = replay.vllm_replay(model_dir, TRACE, 512, 4096, MAX_LEN, False, pool_gb=0.05, specs=_full_specs(replay))
    peer = replay.peer_replay(model_dir, TRACE, 512, MAX_LEN, 0.05, specs=_full_specs(replay))
    assert ours["served"] > 0.3
    assert peer["served"] == ours["served"]
    assert peer["stored_bytes"] == ours["stored_bytes"] and peer["prefix_parts"] == ours["prefix_parts"]


@pytest.mark.parametrize("step", [256, 2048])
def test_through_vllm_the_hybrid_stores_and_serves_as_the_engine_api(replay, model_dir, step):
    ours = replay.vllm_replay(model_dir, TRACE, step, 4096, MAX_LEN, False, pool_gb=0.05)
    api = replay.api_replay(replay.rig_layout(model_dir, MAX_LEN), TRACE, 4096, MAX_LEN, pool_gb=0.05)
    assert ours["served"] == api["served"] > 0.3
    # the same objects: a step end inside a stored prefix (r2 recomputes r0's first 1024 tokens,
    # whose window rows were never kept there) is a point only where the request leaves it
    for key in ("stored_bytes", "prefix_parts", "window_parts", "window_pieces", "restore_point_hits"):
        assert ours[key] == api[key], key
    peer = replay.peer_replay(model_dir, TRACE, step, MAX_LEN, 0.05)
    assert peer["served"] <= ours["served"]  # the peer keeps window rows at request ends only
    print(json.dumps({"kvconnect": ours, "engine API": api, "OffloadingConnector": peer}, default=str))


def test_on_deepseek_v41_only_the_cacheable_groups_are_stored_and_hits_keep_the_rule(replay, model_dir):
    """``--layout dsv41``: DeepSeek V4.1's groups (vllm_rebuilt_rig.deepseek_v41: ratio-1 and
    ratio-2 MLA, the ratio-2 compressor's ring, the bounded-replay window). kvconnect through
    vLLM, the engine API and the peer store the compressed MLA rows only (bytes = chunks x 256
    tokens x their bytes per token; no window part, nothing of the ring or the window) and every
    hit lands on a chunk end that is a multiple of the layout's resume_every."""
    from vllm_rebuilt_rig import deepseek_v41, kind_of

    layout = replay.rig_layout(model_dir, MAX_LEN, "dsv41")
    structure = deepseek_v41(block=replay.BLOCK)
    cacheable = [layer for group in structure for layer in group if kind_of(layer.spec) == "rows"]
    assert {p.layer_name for p in layout.planes} == {layer.name for layer in cacheable}
    per_token = sum(layer.spec.page_size_bytes // layer.spec.block_size for layer in cacheable)
    hits, peer_hits = [], []
    ours = replay.vllm_replay(model_dir, TRACE, 256, 4096, MAX_LEN, False, pool_gb=0.05, layout="dsv41", hits=hits)
    peer = replay.peer_replay(model_dir, TRACE, 256, MAX_LEN, 0.05, layout="dsv41", hits=peer_hits)
    api = replay.api_replay(layout, TRACE, 4096, MAX_LEN, pool_gb=0.05)
    for row in (ours, api, peer):
        assert row["stored_bytes"] == row["prefix_parts"] * replay.CHUNK * per_token, row
        assert row["window_bytes"] == 0 and row["window_parts"] in (0, None)
    assert peer["offloaded_groups"] == ["MLAAttentionSpec", "MLAAttentionSpec"]  # vLLM's prefix_cacheable_group_ids
    # r1 hits r0's whole chunks, r2..r4 the shared 1024-token prefix, r5 r1's chunks
    assert hits == peer_hits == [0, 1792, 1024, 1024, 1024, 2816]
    assert all(h % replay.CHUNK == 0 and h % layout.resume_every == 0 for h in hits)
    assert ours["served"] == api["served"] == peer["served"]
    assert ours["replayed_tokens"] == 5 * 128  # vLLM recomputed each hit's last window
