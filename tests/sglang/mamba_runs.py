"""The three SGLang engine runs of the Mamba-pool suites (test_sglang_mamba: LFM2, test_sglang_gdn:
Qwen3.5's Gated DeltaNet), each on the real SGLang 0.5.23 CPU engine with
``mamba_radix_cache_strategy="no_buffer"``, page size 1 and 64-token prefill chunks.

| run | HiCache | phases |
|-----|---------|--------|
| R0  | none    | A, B, C, F (F = A + A's outputs + 40: SGLang's own radix hit at A's end), D |
| R1  | kvconnect, disk D | A, B, C, D cold (each followed by a listing of D), flush, A, B, C (L3), settle, flush, F (L3) |
| R2  | kvconnect, disk D, fresh process; A's Mamba objects deleted, B's corrupted, D's rewritten by the suite's ``wrong_state`` under valid checksums | A, B, C, D |

One prompt per generate call: the chunk shapes of a resumed prefill are then the cold run's,
and outputs and logprobs must be bit-identical to R0's. Node ends (where SGLang stores a Mamba
state): the chunked prefill's edges, the prompt's end and the finished request's end
(``NODE_ENDS``); the largest one inside each prompt with a stored state is its L3 hit
(``L3_HITS``).
"""

from __future__ import annotations

import os
from pathlib import Path

from engine_runs import BACKEND, run_engine, storage_hits
from kvconnect.chunks.chunk_format import decode_header, encode
from kvconnect.page_store import group_folder

CHUNK = 64  # SGLang's chunked prefill: a radix node (and a Mamba state) at every 64 tokens of a prompt
NEW = 8
PROMPTS = {
    "A": [(7 * i + 3) % 997 + 3 for i in range(150)],
    "B": [(13 * i + 5) % 991 + 3 for i in range(100)],
    "C": [(11 * i + 2) % 983 + 3 for i in range(90)],
    "D": [(19 * i + 4) % 971 + 3 for i in range(80)],
}
FOLLOW_EXTRA = [(17 * i + 9) % 977 + 3 for i in range(40)]
NODE_ENDS = {"A": [64, 128, 150, 157], "B": [64, 100, 107], "C": [64, 90, 97], "D": [64, 80, 87]}
L3_HITS = {"A": 128, "B": 64, "C": 64, "D": 64, "F": 157}
HYBRID = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True, "chunked_prefill_size": CHUNK}
MAMBA_GROUP = 1  # kvconnect group of the Mamba pool: registered after the KV anchor (storage.py)


def gen(name):
    return {"op": "generate", "prompts": [PROMPTS[name]], "max_new_tokens": NEW, "logprobs": True}


def follow(at):
    """The next turn of phase ``at``'s prompt: prompt + its outputs + 40 new tokens."""
    return {"op": "generate", "prompts": [{"follow": [at, 0], "extra": FOLLOW_EXTRA}], "max_new_tokens": NEW, "logprobs": True}


def hybrid_spec(model, phases, disk=None):
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


def zeroed(payload: bytes) -> bytes:
    return bytes(len(payload))


def three_runs(model: str, root: Path, wrong_state=zeroed, timeout_s: float = 900, **env) -> dict:
    """R0, R1 and R2 (module docstring) on ``model``; ``wrong_state(payload) -> payload`` rewrites
    D's Mamba objects between R1 and R2 (the control: a wrong state kvconnect cannot tell).
    Returns {"R0" / "R1" / "R2": run results, "at": phase indices by label, "disk", "model",
    "objects": {prompt: Mamba objects its cold run added, before the damage}}."""
    disk = root / "disk"
    out = {"disk": disk, "model": model}
    r0 = gen_phases("ABC").add(follow(0), "F").add(gen("D"), "D")
    out["R0"] = run_engine(hybrid_spec(model, r0.list), root / "r0", timeout_s=timeout_s, **env)
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
    out["R1"] = run_engine(hybrid_spec(model, r1.list, disk), root / "r1", timeout_s=timeout_s, **env)
    p = out["R1"]["phases"]
    seen, added = set(), {}
    for name in "ABCD":
        files = set(p[r1.at[f"files after {name}"]]["files"])
        added[name] = sorted(files - seen)
        seen |= files
    out["objects"] = {name: mamba_objects(disk, names) for name, names in added.items()}  # before the damage
    # between R1 and R2: A's Mamba objects deleted, the last payload byte of B's flipped, D's
    # rewritten under a valid checksum
    for name in out["objects"]["A"]:
        os.remove(disk / name)
    for name in out["objects"]["B"]:
        with open(disk / name, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
    for name, (header, payload) in out["objects"]["D"].items():
        (disk / name).write_bytes(encode(header, wrong_state(payload)))
    r2 = gen_phases("ABCD")
    out["R2"] = run_engine(hybrid_spec(model, r2.list, disk), root / "r2", timeout_s=timeout_s, **env)
    out["at"] = {"R0": r0.at, "R1": r1.at, "R2": r2.at}
    return out


def phase(runs, run, label):
    return runs[run]["phases"][runs["at"][run][label]]


def served(result):
    """(output ids, chosen tokens' logprobs) of a one-prompt generate phase."""
    return result["outputs"][0], result["logprobs"][0]


def reference(runs, name):
    return served(phase(runs, "R0", name))


def objects_by_end(runs, name, seq) -> list[tuple[int, bytes]]:
    """(p, payload) of each Mamba object prompt ``name``'s cold run stored, p its node end: the
    object's key is kvconnect's fold of SGLang's page key of token p - 1 of ``seq`` (prompt +
    outputs); a key that is no such fold fails."""
    from sglang.srt.mem_cache.utils import get_hash_str

    page_keys = get_hash_str(seq[:-1], None, page_size=1)
    out = []
    for header, payload in runs["objects"][name].values():
        chunk_keys = group_folder(header.fingerprint, 1, MAMBA_GROUP).fold(page_keys)
        assert header.key in chunk_keys, name
        out.append((chunk_keys.index(header.key) + 1, payload))
    return out


# -- the checks both suites make of the three runs (each over its own model) -----------------------


def check_cold_runs(runs) -> None:
    """R1's cold phases equal R0's (the engine is deterministic across processes) and miss L3."""
    for name in "ABCD":
        cold = phase(runs, "R1", f"cold {name}")
        assert served(cold) == reference(runs, name), name
        assert storage_hits(cold) == [0]


def check_l3_restore(runs) -> None:
    """After flush_cache each prompt hits kvconnect at ``L3_HITS`` with outputs and logprobs equal
    to R0's; the next turn hits the first turn's finished state from L3, equal to R0's own radix hit."""
    assert phase(runs, "R1", "flush")["flushed"] and phase(runs, "R1", "second flush")["flushed"]
    for name in "ABC":
        got = phase(runs, "R1", f"L3 {name}")
        assert served(got) == reference(runs, name), name
        assert storage_hits(got) == [L3_HITS[name]], (name, got["cached"])
    follow_up = phase(runs, "R1", "L3 F")
    assert served(follow_up) == reference(runs, "F")
    assert storage_hits(follow_up) == [L3_HITS["F"]], follow_up["cached"]


def check_damage(runs) -> None:
    """R2, a fresh process: C hits the disk tier as R1 left it; A (Mamba objects deleted) and B
    (Mamba objects corrupted) miss, their KV pages on disk notwithstanding; outputs equal R0's."""
    for name, hit in (("C", L3_HITS["C"]), ("A", 0), ("B", 0)):
        got = phase(runs, "R2", name)
        assert served(got) == reference(runs, name), name
        assert storage_hits(got) == [hit], (name, got["cached"])


def check_control(runs) -> None:
    """R2's D: its Mamba objects rewritten by the suite's ``wrong_state`` under valid checksums are
    served like any stored page, and the logprobs differ from R0's, so the bit-exact checks above
    see the restored state (not only the KV pages)."""
    d = phase(runs, "R2", "D")
    assert storage_hits(d) == [L3_HITS["D"]], d["cached"]
    logprobs, ref_logprobs = served(d)[1], reference(runs, "D")[1]
    assert logprobs != ref_logprobs
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) > 1e-4
