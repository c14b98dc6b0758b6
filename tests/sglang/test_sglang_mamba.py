"""SGLang's Mamba state pool (``PoolName.MAMBA``) served by kvconnect, on the real SGLang 0.5.23
engine (CPU, a tiny random LFM2: layers conv, full attention, conv; conv kernel 3).

LFM2's short-convolution layers keep their conv state in SGLang's ``MambaPool``; with HiCache
SGLang backs it up as the ``PoolName.MAMBA`` sidecar pool (one state per radix node, under the
node's last page key, TRAILING_PAGES with N = 1), the same code as for Qwen3.5 / Qwen3-Next's
GDN states. SGLang runs a Mamba radix cache on a platform without ``extra_buffer`` support
with ``mamba_radix_cache_strategy="no_buffer"``, page size 1 and no overlap schedule (its own
``auto`` resolution there); a chunked prefill of 64 tokens makes node ends at 64, 128, ... .
The conv kernels are SGLang's own Triton ``causal_conv1d`` run by Triton's interpreter
(``TRITON_INTERPRET=1``); the test harness only names the GDN kernels SGLang binds at import
and adds the host pool's index copies (tests/sglang/harness, docs/testing.md).

| run | HiCache | phases |
|-----|---------|--------|
| R0  | none    | A, B, C, F (F = A + A's outputs + 40: SGLang's own radix hit at A's end), D |
| R1  | kvconnect, disk D | A, B, C, D cold (each followed by a listing of D), flush, A, B, C (L3), settle, flush, F (L3) |
| R2  | kvconnect, disk D, fresh process; A's Mamba objects deleted, B's corrupted, D's zeroed under valid checksums | A, B, C, D |

One prompt per generate call: the chunk shapes of a resumed prefill are then the cold
run's, and outputs and logprobs must be bit-identical to R0's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from engine_runs import BACKEND, run_engine, storage_hits  # noqa: E402
from kvconnect.chunks.chunk_format import decode_header  # noqa: E402
from kvconnect.page_store import group_folder  # noqa: E402

pytestmark = pytest.mark.sglang

CHUNK = 64  # SGLang's chunked prefill: a radix node (and a Mamba state) at every 64 tokens of a prompt
NEW = 8
PROMPTS = {
    "A": [(7 * i + 3) % 997 + 3 for i in range(150)],
    "B": [(13 * i + 5) % 991 + 3 for i in range(100)],
    "C": [(11 * i + 2) % 983 + 3 for i in range(90)],
    "D": [(19 * i + 4) % 971 + 3 for i in range(80)],
}
FOLLOW_EXTRA = [(17 * i + 9) % 977 + 3 for i in range(40)]
HYBRID = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True, "chunked_prefill_size": CHUNK}
MAMBA_GROUP = 1  # kvconnect group of the Mamba pool: registered after the KV anchor (storage.py)
CONV_LAYERS, HIDDEN, STATE_LEN = 2, 128, 2  # tiny_models.make_lfm2: conv state = last (3 - 1) inputs


def gen(name):
    return {"op": "generate", "prompts": [PROMPTS[name]], "max_new_tokens": NEW, "logprobs": True}


def follow(at):
    """The next turn of phase ``at``'s prompt: prompt + its outputs + 40 new tokens."""
    return {"op": "generate", "prompts": [{"follow": [at, 0], "extra": FOLLOW_EXTRA}], "max_new_tokens": NEW, "logprobs": True}


def lfm2_spec(model, phases, disk=None):
    out = {"model": model, "page_size": 1, "engine_args": HYBRID, "phases": phases}
    if disk is not None:  # wait_complete: a request waits for its whole L3 prefetch (exact hit lengths)
        out.update(hicache=True, layout="page_first_direct", hicache_ratio=2, backend="dynamic",
                   prefetch_policy="wait_complete", extra={**BACKEND, "local_disk": str(disk)})
    return out


def mamba_objects(disk: Path, names) -> dict:
    """{relative path: (header, payload)} of the Mamba-pool objects among ``names``."""
    out = {}
    for name in names:
        data = (disk / name).read_bytes()
        header = decode_header(data)
        if header.group_mask == 1 << MAMBA_GROUP:
            out[name] = (header, data[header.header_bytes:])
    return out


class Phases:
    """A run's phases, each found again by its label."""

    def __init__(self):
        self.list, self.at = [], {}

    def add(self, phase, label=None):
        if label:
            self.at[label] = len(self.list)
        self.list.append(phase)
        return self


def gen_phases(labels) -> Phases:
    out = Phases()
    for label in labels:
        out.add(gen(label), label)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from kvconnect.chunks.chunk_format import encode
    from support import tiny_models

    root = tmp_path_factory.mktemp("sglang_mamba")
    model = tiny_models.make_lfm2(str(root / "lfm2"))
    disk = root / "disk"
    interp = {"TRITON_INTERPRET": "1"}
    out = {"disk": disk, "model": model}
    r0 = gen_phases("ABC").add(follow(0), "F").add(gen("D"), "D")
    out["R0"] = run_engine(lfm2_spec(model, r0.list), root / "r0", timeout_s=900, **interp)
    listing = {"op": "list", "dir": str(disk), "stable_s": 2}
    settle = {"op": "settle", "seconds": 4}
    flush = {"op": "flush"}
    r1 = Phases()
    for name in "ABCD":
        r1.add(gen(name), f"cold {name}").add(settle).add(listing, f"files after {name}")
    r1.add(flush, "flush")
    for name in "ABC":
        r1.add(gen(name), f"L3 {name}")
    r1.add(settle).add(flush, "second flush").add(follow(r1.at["cold A"]), "L3 F")
    out["R1"] = run_engine(lfm2_spec(model, r1.list, disk), root / "r1", timeout_s=900, **interp)
    p = out["R1"]["phases"]
    seen, added = set(), {}
    for name in "ABCD":
        files = set(p[r1.at[f"files after {name}"]]["files"])
        added[name] = sorted(files - seen)
        seen |= files
    out["objects"] = {name: mamba_objects(disk, names) for name, names in added.items()}  # before the damage
    # between R1 and R2: A's Mamba objects deleted, the last payload byte of B's flipped, and D's
    # states zeroed under a valid checksum (a wrong state kvconnect cannot tell: the control
    # that the bit-exact comparison sees the restored state)
    for name in out["objects"]["A"]:
        os.remove(disk / name)
    for name in out["objects"]["B"]:
        with open(disk / name, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
    for name, (header, payload) in out["objects"]["D"].items():
        (disk / name).write_bytes(encode(header, bytes(len(payload))))
    r2 = gen_phases("ABCD")
    out["R2"] = run_engine(lfm2_spec(model, r2.list, disk), root / "r2", timeout_s=900, **interp)
    out["at"] = {"R0": r0.at, "R1": r1.at, "R2": r2.at}
    return out


def phase(runs, run, label):
    return runs[run]["phases"][runs["at"][run][label]]


def reference(runs, name):
    return served(phase(runs, "R0", name))


def served(result):
    """(output ids, chosen tokens' logprobs) of a one-prompt generate phase."""
    return result["outputs"][0], result["logprobs"][0]


def test_cold_runs_are_deterministic_across_processes(runs):
    for name in "ABCD":
        cold = phase(runs, "R1", f"cold {name}")
        assert served(cold) == reference(runs, name), name
        assert storage_hits(cold) == [0]


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
    from sglang.srt.mem_cache.utils import get_hash_str
    from transformers import Lfm2ForCausalLM

    model = Lfm2ForCausalLM.from_pretrained(runs["model"], dtype=torch.float32).eval()
    captured = {}
    conv_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "conv")]
    assert len(conv_layers) == CONV_LAYERS
    for i in conv_layers:
        model.model.layers[i].conv.in_proj.register_forward_hook(lambda mod, inp, out, i=i: captured.__setitem__(i, out))
    want_ends = {"A": [64, 128, 150, 157], "B": [64, 100, 107], "C": [64, 90, 97], "D": [64, 80, 87]}
    for name, ends in want_ends.items():
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
        objects = runs["objects"][name]
        assert objects, name
        page_keys = get_hash_str(seq[:-1], None, page_size=1)
        found = []
        for header, payload in objects.values():
            folder = group_folder(header.fingerprint, 1, MAMBA_GROUP)
            chunk_keys = folder.fold(page_keys)
            assert header.key in chunk_keys, name
            p = chunk_keys.index(header.key) + 1
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
    trailing Mamba page), with outputs and logprobs identical to the run without HiCache."""
    assert phase(runs, "R1", "flush")["flushed"] and phase(runs, "R1", "second flush")["flushed"]
    for name, hit in (("A", 128), ("B", 64), ("C", 64)):
        got = phase(runs, "R1", f"L3 {name}")
        assert served(got) == reference(runs, name), name
        assert storage_hits(got) == [hit], (name, got["cached"])
    # the next turn hits the first turn's finished state (157) from L3, bit-exact to SGLang's own radix hit
    follow_up = phase(runs, "R1", "L3 F")
    assert served(follow_up) == reference(runs, "F")
    assert storage_hits(follow_up) == [157], follow_up["cached"]


def test_fresh_process_hits_the_disk_tier(runs):
    c = phase(runs, "R2", "C")
    assert served(c) == reference(runs, "C")
    assert storage_hits(c) == [64], c["cached"]


def test_missing_mamba_objects_are_a_miss(runs):
    """A's KV pages are all on disk, its Mamba objects are not: no prefix of A is restorable."""
    a = phase(runs, "R2", "A")
    assert served(a) == reference(runs, "A")
    assert storage_hits(a) == [0], a["cached"]


def test_corrupted_mamba_objects_are_a_miss(runs):
    b = phase(runs, "R2", "B")
    assert served(b) == reference(runs, "B")
    assert storage_hits(b) == [0], b["cached"]


def test_a_wrong_state_under_a_valid_checksum_is_served_and_changes_the_logprobs(runs):
    """The control: D's Mamba objects rewritten with zero states (valid checksums) are served at
    64 like any stored page, and the logprobs differ from the run without HiCache, so the
    bit-exact comparisons above see the restored state (not only the KV pages)."""
    d = phase(runs, "R2", "D")
    assert storage_hits(d) == [64], d["cached"]
    logprobs, ref_logprobs = served(d)[1], reference(runs, "D")[1]
    assert logprobs != ref_logprobs
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) > 1e-4
