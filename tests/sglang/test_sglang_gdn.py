"""SGLang's Mamba state pool (``PoolName.MAMBA``) holding Gated DeltaNet states, served by
kvconnect on the real SGLang 0.5.23 engine (CPU, the tiny random Qwen3.5 of
``support.tiny_models.make_qwen35``: layers GDN x3 + full attention, SGLang's
``Qwen3_5ForCausalLM``).

Each GDN layer keeps two states in SGLang's ``MambaPool``: the conv state (the last 3 inputs of
its kernel-4 convolution over q | k | v, ``[512, 3]``, bf16: the checkpoint's dtype, though the
engine computes in fp32) and the fp32
temporal (recurrent) state ``[4 value heads, 64, 64]``. HiCache backs both up as one
``PoolName.MAMBA`` page per radix node: SGLang's host pool describes it as two pieces (temporal
of all layers, then conv of all layers), kvconnect stores it as one object with two planes.
Same runs as test_sglang_mamba.py (``mamba_runs.three_runs``: R0 without HiCache, R1 cold + L3
after ``flush_cache``, R2 a fresh process over damaged objects); the control here zeroes only
the temporal states of D's objects (conv states and checksums valid), so the bit-exact
comparisons are shown to see the recurrent state, not only the conv state and the KV pages.

The GDN kernels are TEST HARNESS stand-ins (sgl_kernel's CPU build is not on PyPI;
tests/sglang/harness, docs/sglang.md "Testing on CPU"): transformers' own Qwen3.5 functions
(``causal_conv1d_update``, ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``)
behind sgl_kernel's calling convention, reading and writing the states in place in SGLang's pool.
"""

from __future__ import annotations

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from mamba_runs import (  # noqa: E402
    L3_HITS, NODE_ENDS, PROMPTS, check_cold_runs, check_control, check_damage, check_l3_restore, objects_by_end, phase,
    served, three_runs)

pytestmark = pytest.mark.sglang

GDN_LAYERS = 3
TEMPORAL = (4, 64, 64)  # (value heads, key dim, value dim): sgl_kernel CPU's and transformers' order
CONV = (512, 3)  # (2 x 2 key heads x 64 + 4 value heads x 64, kernel 4 - 1)
TEMPORAL_BYTES = GDN_LAYERS * TEMPORAL[0] * TEMPORAL[1] * TEMPORAL[2] * 4  # fp32
CONV_BYTES = GDN_LAYERS * CONV[0] * CONV[1] * 2  # bf16
# largest |stored - transformers'| allowed (measured 2026-12-02 on the 2-core VM, in brackets): a
# temporal state inside the prompt (1e-6), the finished request's after its decode steps (9e-4);
# a conv state: bf16 rounding, one step is 0.03 at |x| in [4, 8) (0.03); the neighbour states
# p - 1 and p + 1 must be farther than NEIGHBOUR_GAP from the stored one (measured at least 0.08 and 4.2)
TOLERANCE = {"prompt": {"temporal": 1e-5, "conv": 0.05}, "decoded": {"temporal": 5e-3, "conv": 0.05}}
NEIGHBOUR_GAP = {"temporal": 0.05, "conv": 1.0}


def zeroed_temporal(payload: bytes) -> bytes:
    """D's control: temporal states zeroed, conv states kept (the object's first plane is the temporal one)."""
    assert len(payload) == TEMPORAL_BYTES + CONV_BYTES
    return bytes(TEMPORAL_BYTES) + payload[TEMPORAL_BYTES:]


def unpack(payload: bytes):
    """(temporal [layers, 4, 64, 64], conv [layers, 512, 3]) of one Mamba object, as fp32."""
    assert len(payload) == TEMPORAL_BYTES + CONV_BYTES
    data = bytearray(payload)
    temporal = torch.frombuffer(data[:TEMPORAL_BYTES], dtype=torch.float32).view(GDN_LAYERS, *TEMPORAL)
    conv = torch.frombuffer(data[TEMPORAL_BYTES:], dtype=torch.bfloat16).float().view(GDN_LAYERS, *CONV)
    return temporal, conv


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from support import tiny_models

    root = tmp_path_factory.mktemp("sglang_gdn")
    return three_runs(tiny_models.make_qwen35(str(root / "qwen35")), root, wrong_state=zeroed_temporal)


def transformers_states(model, seq, at):
    """transformers' own Qwen3.5 forward over ``seq`` with its cache, fed in pieces ending at each
    position of ``at``: ({p: (temporal [layers, 4, 64, 64], conv [layers, 512, 3])} after exactly
    p tokens, the logits of every position)."""
    from transformers import DynamicCache

    cache, states, logits, start = DynamicCache(config=model.config), {}, [], 0
    gdn = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    assert len(gdn) == GDN_LAYERS
    with torch.no_grad():
        for end in sorted(at):
            logits.append(model(torch.tensor([seq[start:end]]), past_key_values=cache, use_cache=True).logits[0])
            layers = [cache.layers[i] for i in gdn]
            states[end] = (torch.stack([layer.recurrent_states[0][0] for layer in layers]),
                           torch.stack([layer.conv_states[0][0, :, -CONV[1]:] for layer in layers]).to(torch.bfloat16).float())
            start = end
    return states, torch.cat(logits)


def test_cold_runs_are_deterministic_across_processes(runs):
    check_cold_runs(runs)


def test_every_mamba_object_holds_transformers_gdn_states_after_exactly_its_page(runs):
    """Each Mamba object SGLang handed kvconnect, found on disk and named by its chunk key: the key
    is kvconnect's fold of SGLang's page key of token p - 1 (p: the node end), and its two planes
    are, for every GDN layer, the temporal state and the conv state after exactly p tokens by
    transformers' own Qwen3.5 forward (its cache) over the same tokens. Not bit-exact, and the
    tolerances say why: SGLang's projections, attention and MLP feed the GDN kernels in another
    float order than transformers' (logprobs of the same tokens agree to ~0.02), and SGLang keeps
    the conv state in bf16 (the checkpoint's dtype) where transformers keeps fp32, so its decode
    steps read bf16-rounded conv inputs: states inside the prompt agree to 1e-6, the finished
    request's state to 1e-3. Both are far below one token's change: the state after p - 1 or
    p + 1 is far from the stored one."""
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(runs["model"], dtype=torch.float32).eval()
    for name, ends in NODE_ENDS.items():
        outputs = phase(runs, "R1", f"cold {name}")["outputs"][0]
        seq = PROMPTS[name] + outputs
        at = {q for p in ends for q in (p - 1, p, p + 1) if 0 < q <= len(seq)} | {len(seq)}
        states, logits = transformers_states(model, seq, at)
        # transformers' logprobs of SGLang's output tokens are SGLang's, to the float-order tolerance (measured 0.02)
        chosen = torch.log_softmax(logits[len(PROMPTS[name]) - 1:-1], -1).gather(1, torch.tensor([outputs]).T)[:, 0]
        cold_logprobs = torch.tensor(served(phase(runs, "R1", f"cold {name}"))[1])
        assert (chosen - cold_logprobs).abs().max().item() < 0.05, name
        found = []
        for p, payload in objects_by_end(runs, name, seq):
            stored = dict(zip(("temporal", "conv"), unpack(payload)))

            def err(at, part):
                want = states[at][0 if part == "temporal" else 1]
                return (stored[part] - want).abs().max().item()

            for part in ("temporal", "conv"):
                here = err(p, part)
                near = min(err(q, part) for q in (p - 1, p + 1) if q in states)
                tolerance = TOLERANCE["prompt" if p <= len(PROMPTS[name]) else "decoded"][part]
                assert here < tolerance and near > NEIGHBOUR_GAP[part], (name, p, part, here, near)
            found.append(p)
        assert sorted(found) == ends, (name, sorted(found))


def test_l3_restore_after_flush_is_bit_exact(runs):
    """After flush_cache every prompt is served from kvconnect at its largest node end inside the
    prompt whose Mamba state is stored, bit-exact to the run without HiCache; the next turn hits
    the first turn's finished state (157) from L3, bit-exact to SGLang's own radix hit in R0."""
    (cached,) = phase(runs, "R0", "F")["cached"]
    assert cached.get("total", cached.get("device", 0)) == L3_HITS["F"], cached
    check_l3_restore(runs)


def test_a_fresh_process_hits_and_missing_or_corrupted_mamba_objects_are_a_miss(runs):
    check_damage(runs)


def test_a_zeroed_temporal_state_under_a_valid_checksum_is_served_and_changes_the_logprobs(runs):
    """The control: D's Mamba objects with their temporal states zeroed (conv states and checksums
    valid), so the bit-exact comparisons above see the restored recurrent state, not only the
    conv state and the KV pages."""
    check_control(runs)
