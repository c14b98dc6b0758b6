"""kvconnect as SGLang's HiCache L3 backend on the real SGLang 0.5.23 engine (CPU, tiny Llama).

Engine runs (each a process, ~45-65 s to start, so several phases share one):

| run | host layout        | tier          | phases |
|-----|--------------------|---------------|--------|
| R0  | no HiCache         | -             | reference greedy outputs |
| R1  | layer_first        | disk D1       | serve, settle, flush_cache, serve (L3 hit); revision "r1" |
| R2  | layer_first        | disk D1       | fresh process: serve (L3 hit from disk); revision "r1" |
| R7  | layer_first        | disk D1       | fresh process, revision "r2" of the same path: serve (miss) |
| R3  | page_first_direct  | disk D2       | serve, settle, flush_cache, serve (L3 hit) |
| R4  | page_first_direct  | disk D2, corrupted before start | serve (miss, same outputs), settle, flush, serve (hit again) |
| R5  | layer_first, SGLang's generic API (no ``interface_v1``) | node server S | serve, settle (pages reach the server's shared pool) |
| R6  | layer_first, generic API | node server S | fresh process: serve (L3 hit from the shared pool) |

Every served output must equal R0's token for token.
"""

from __future__ import annotations

import os

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
transformers = pytest.importorskip("transformers")

from engine_runs import NEW_TOKENS, PAGE, PROMPTS, gen, run_engine, spec, storage_hits  # noqa: E402
from support import server_rig  # noqa: E402

pytestmark = pytest.mark.sglang

def _corrupt(disk) -> int:
    """Flip a payload byte of every other stored page, truncate the rest; returns files touched."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(disk) for f in fs)
    for i, path in enumerate(files):
        size = os.path.getsize(path)
        if i % 2:
            with open(path, "r+b") as f:
                f.seek(size - 1)
                b = f.read(1)
                f.seek(size - 1)
                f.write(bytes([b[0] ^ 0xFF]))
        else:
            os.truncate(path, size // 2)
    return len(files)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from support import tiny_models

    root = tmp_path_factory.mktemp("sglang_e2e")
    model = tiny_models.make_llama(str(root / "llama"))
    d1, d2 = root / "disk1", root / "disk2"
    out = {}
    settle_flush = [{"op": "settle", "seconds": 4}, {"op": "flush"}]
    out["R0"] = run_engine(spec(model, phases=[gen()]), root / "r0")
    out["R1"] = run_engine(spec(model, "layer_first", d1, [gen(), *settle_flush, gen()], revision="r1"), root / "r1")
    out["disk1_files"] = sum(len(fs) for _, _, fs in os.walk(d1))
    out["R2"] = run_engine(spec(model, "layer_first", d1, [gen()], revision="r1"), root / "r2")
    out["R7"] = run_engine(spec(model, "layer_first", d1, [gen()], revision="r2"), root / "r7")
    out["R3"] = run_engine(spec(model, "page_first_direct", d2, [gen(), *settle_flush, gen()]), root / "r3")
    out["corrupted"] = _corrupt(d2)
    out["R4"] = run_engine(spec(model, "page_first_direct", d2, [gen(), *settle_flush, gen()]), root / "r4")
    url = f"ipc://{root}/kvc.sock"
    server = server_rig.start_server_process(url, str(root / "server.log"), size_mb=64, lease_s=5.0)
    try:
        on_server = {"server_url": url, "interface_v1": 0}
        out["R5"] = run_engine(spec(model, "layer_first", None, [gen(), {"op": "settle", "seconds": 3}], **on_server), root / "r5")
        out["R6"] = run_engine(spec(model, "layer_first", None, [gen()], **on_server), root / "r6")
    finally:
        server_rig.stop_process(server)
    return out


def test_reference_run_has_no_storage(runs):
    assert all(len(o) == NEW_TOKENS for o in runs["R0"]["phases"][0]["outputs"])


def test_layer_first_hits_after_flush_with_identical_outputs(runs):
    first, _, flushed, second = runs["R1"]["phases"]
    ref = runs["R0"]["phases"][0]["outputs"]
    assert first["outputs"] == ref
    assert flushed["flushed"]
    assert second["outputs"] == ref
    hits = storage_hits(second)
    # every full page of each prompt but the last token's is served from L3
    assert all(h >= PAGE for h in hits), second["cached"]
    assert all(c.get("device", 0) == 0 and c.get("host", 0) == 0 for c in second["cached"]), second["cached"]
    assert runs["disk1_files"] >= sum(len(p) // PAGE for p in PROMPTS)


def test_fresh_process_hits_the_disk_tier(runs):
    (phase,) = runs["R2"]["phases"]
    assert phase["outputs"] == runs["R0"]["phases"][0]["outputs"]
    assert all(h >= PAGE for h in storage_hits(phase)), phase["cached"]


def test_another_revision_at_the_same_path_misses(runs):
    """Issue 39 item 2: SGLang's model is named ``path@revision#digest`` of its own
    ``ModelConfig`` (identity.py), so revision r2 of the model at the same path loads none of
    r1's pages from the disk R1 filled (R2, revision r1 in a fresh process, hits them)."""
    (phase,) = runs["R7"]["phases"]
    assert phase["outputs"] == runs["R0"]["phases"][0]["outputs"]
    assert storage_hits(phase) == [0, 0], phase["cached"]


def test_page_first_direct_hits_after_flush(runs):
    first, _, _, second = runs["R3"]["phases"]
    ref = runs["R0"]["phases"][0]["outputs"]
    assert first["outputs"] == ref and second["outputs"] == ref
    assert all(h >= PAGE for h in storage_hits(second)), second["cached"]


def test_corrupted_tier_is_a_miss_and_outputs_are_unchanged(runs):
    assert runs["corrupted"] > 0
    first, _, _, second = runs["R4"]["phases"]
    ref = runs["R0"]["phases"][0]["outputs"]
    assert first["outputs"] == ref
    assert storage_hits(first) == [0, 0], first["cached"]  # every stored page was damaged: nothing loaded
    # the damaged pages were dropped and stored again: the next request hits
    assert second["outputs"] == ref
    assert all(h >= PAGE for h in storage_hits(second)), second["cached"]


def test_fresh_process_hits_the_node_servers_shared_pool_through_the_generic_api(runs):
    ref = runs["R0"]["phases"][0]["outputs"]
    first, _ = runs["R5"]["phases"]
    assert first["outputs"] == ref
    (fresh,) = runs["R6"]["phases"]
    assert fresh["outputs"] == ref
    assert all(h >= PAGE for h in storage_hits(fresh)), fresh["cached"]

