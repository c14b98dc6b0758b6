"""SGLang's Mamba state pool (``PoolName.MAMBA``) served by kvconnect, on the real SGLang 0.5.23
engine (CPU, a tiny random LFM2: layers conv, full attention, conv; conv kernel 3).

LFM2's short-convolution layers keep their conv state in SGLang's ``MambaPool``; with HiCache
SGLang backs it up as the ``PoolName.MAMBA`` sidecar pool (one state per radix node, under the
node's last page key, TRAILING_PAGES with N = 1), the same code as for Qwen3.5 / Qwen3-Next's
GDN states. SGLang runs a Mamba radix cache on a platform without ``extra_buffer`` support
with ``mamba_radix_cache_strategy="no_buffer"``, page size 1 and no overlap schedule (its own
``auto`` resolution there); a chunked prefill of 64 tokens makes node ends at 64, 128, ... .
The conv kernels are SGLang's own Triton ``causal_conv1d`` run by Triton's interpreter
(``TRITON_INTERPRET=1``); the test harness adds the host pool's index copies, and its GDN
stand-ins (for Qwen3.5) are never reached here (tests/sglang/harness, docs/testing.md).

The runs (R0 without HiCache, R1 cold + L3 after flush, R2 a fresh process over damaged
objects) are ``mamba_runs.three_runs``; the same runs serve Qwen3.5's GDN state in
test_sglang_gdn.py.
"""

from __future__ import annotations

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from mamba_runs import (  # noqa: E402
    NODE_ENDS, PROMPTS, check_cold_runs, check_control, check_damage, check_l3_restore, objects_by_end, phase, three_runs)

pytestmark = pytest.mark.sglang

CONV_LAYERS, HIDDEN, STATE_LEN = 2, 128, 2  # tiny_models.make_lfm2: conv state = last (3 - 1) inputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from support import tiny_models

    root = tmp_path_factory.mktemp("sglang_mamba")
    return three_runs(tiny_models.make_lfm2(str(root / "lfm2")), root, TRITON_INTERPRET="1")


def test_cold_runs_are_deterministic_across_processes(runs):
    check_cold_runs(runs)


def test_sglangs_own_radix_hit_on_the_follow_up_resumes_at_the_first_turns_end(runs):
    """R0's F hits SGLang's device radix cache at A's finished node: prompt 150 + 7 decoded
    tokens (the last output token is never run), where no_buffer keeps the request's state."""
    (cached,) = phase(runs, "R0", "F")["cached"]
    assert cached.get("total", cached.get("device", 0)) == 157, cached


def test_every_mamba_object_is_the_state_after_exactly_its_page(runs):
    """Each Mamba object SGLang handed kvconnect, found on disk and named by its chunk key: the
    key is kvconnect's fold of SGLang's page key of token p - 1 (p: the node end), and the
    payload is the conv state after exactly p tokens by transformers' own LFM2 forward (each
    conv layer's last 2 inputs B * x, bf16 as SGLang keeps them), far from the state after
    p - 1 or p + 1. The node ends are the chunked prefill's edges, the prompt's end and the
    finished request's end."""
    from transformers import Lfm2ForCausalLM

    model = Lfm2ForCausalLM.from_pretrained(runs["model"], dtype=torch.float32).eval()
    captured = {}
    conv_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "conv")]
    assert len(conv_layers) == CONV_LAYERS
    for i in conv_layers:
        model.model.layers[i].conv.in_proj.register_forward_hook(lambda mod, inp, out, i=i: captured.__setitem__(i, out))
    for name, ends in NODE_ENDS.items():
        outputs = phase(runs, "R1", f"cold {name}")["outputs"][0]
        seq = PROMPTS[name] + outputs
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0]
        # transformers' greedy choices at the prompt's end and each decoded token are SGLang's
        assert logits[len(PROMPTS[name]) - 1:-1].argmax(-1).tolist() == outputs, name
        bx = {}
        for i in conv_layers:
            b, _, x = captured[i][0].chunk(3, dim=-1)
            bx[i] = (b * x).to(torch.bfloat16).float()  # [tokens, hidden]
        assert runs["objects"][name], name
        found = []
        for p, payload in objects_by_end(runs, name, seq):
            state = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).float().view(CONV_LAYERS, HIDDEN, STATE_LEN)

            def err(at):
                return max((state[j] - bx[i][at - STATE_LEN:at].T).abs().max().item() for j, i in enumerate(conv_layers))

            assert err(p) < 0.05, (name, p, err(p))
            assert min(err(p - 1), err(p + 1) if p < len(seq) else 99.0) > 0.5, (name, p)
            found.append(p)
        assert sorted(found) == ends, (name, sorted(found))


def test_l3_restore_after_flush_is_bit_exact(runs):
    """After flush_cache every prompt is served from kvconnect at its largest node end inside
    the prompt whose Mamba state is stored (KV pages reach further: the hit is gated on the
    trailing Mamba page), bit-exact to the run without HiCache; so is the next turn (157)."""
    check_l3_restore(runs)


def test_a_fresh_process_hits_and_missing_or_corrupted_mamba_objects_are_a_miss(runs):
    check_damage(runs)


def test_a_wrong_state_under_a_valid_checksum_is_served_and_changes_the_logprobs(runs):
    """The control: D's Mamba objects rewritten with zero states (valid checksums)."""
    check_control(runs)
