"""One cache across TP sizes on the real engine (issue 40 item 2): a one-layer GQA Llama (2 KV
heads) stored by a TP 1 engine is served by a TP 2 engine, and the reverse, over one disk tier.

With one decoder layer the KV does not depend on the TP size (K and V are a column-parallel
projection of the embeddings), so the reader's outputs and logprobs must equal its own
prefix-cache hit at its TP size, bit for bit: each reader runs the prompt twice without
resetting vLLM's prefix cache; the first run's prefix comes from kvconnect (assembled from the
other size's objects: the reader's process is fresh and its own size never stored that
prefix), the second from vLLM's own prefix cache, over the same 256 tokens.

Three engine runs (two at TP 1, one at TP 2 on both cores).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
from support.tiny_models import make_llama, random_tokens

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK, BLOCK, MAX_TOKENS = 64, 32, 8
PREFIX = 4 * CHUNK  # 8 whole blocks: vLLM's own hit and kvconnect's restore cover the same tokens


def _fingerprint_dirs(disk) -> dict[str, int]:
    """Chunk files per fingerprint directory of the disk tier."""
    out: dict[str, int] = {}
    for f in disk.rglob("*.kvc"):
        out[f.parent.parent.name] = out.get(f.parent.parent.name, 0) + 1
    return out


def test_gqa_stored_at_one_tp_size_is_served_at_another(run_vllm, tmp_path):
    model = make_llama(str(tmp_path / "llama1"), num_layers=1)
    rng = random.Random(40)
    first, second = random_tokens(rng, PREFIX), random_tokens(rng, PREFIX)
    tail = lambda: random_tokens(rng, 20)  # noqa: E731  (< one block: vLLM's own hit stops at the prefix)
    disk = tmp_path / "disk"
    opts = dict(block_size=BLOCK, chunk_size=CHUNK, max_tokens=MAX_TOKENS, max_num_batched_tokens=128, logprobs=3,
                local_disk=str(disk), reset_between_phases="false")

    # TP 1 stores the first prefix (4 chunks under its one fingerprint)
    run_vllm(model, [[first + tail()]], connector=f"ipc://{tmp_path}/w1", **opts)
    assert list(_fingerprint_dirs(disk).values()) == [4]

    # TP 2 serves it from TP 1's objects, then stores the second prefix under its two ranks' names
    read = first + tail()
    tp2 = run_vllm(model, [[read], [read], [second + tail()]], connector=f"ipc://{tmp_path}/r2", timeout_s=400,
                   tensor_parallel_size=2, **opts)
    assert [s["loaded_tokens"] for s in tp2["stats"][0]] == [PREFIX, PREFIX]  # both ranks, from TP 1's objects
    assert all(s["load_failures"] == 0 for s in tp2["stats"][-1])
    assert tp2["cached_tokens"][:2] == [PREFIX, PREFIX]  # kvconnect's, then vLLM's own
    assert tp2["outputs"][0] == tp2["outputs"][1] and tp2["logprobs"][0] == tp2["logprobs"][1]
    assert sorted(_fingerprint_dirs(disk).values()) == [4, 4, 4]  # TP 1's, and one per TP 2 rank (one head each)

    # TP 1 serves the second prefix from both TP 2 ranks' objects (each holds one of its two heads)
    read = second + tail()
    tp1 = run_vllm(model, [[read], [read]], connector=f"ipc://{tmp_path}/r1", **opts)
    assert [s["loaded_tokens"] for (s,) in tp1["stats"]] == [PREFIX, PREFIX]
    assert tp1["stats"][-1][0]["load_failures"] == 0
    assert tp1["cached_tokens"] == [PREFIX, PREFIX]
    assert tp1["outputs"][0] == tp1["outputs"][1] and tp1["logprobs"][0] == tp1["logprobs"][1]
