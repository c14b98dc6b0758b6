"""kvconnect as SGLang's HiCache L3 backend on the real SGLang 0.5.23 engine (CPU, tiny Llama).

Engine runs (each a process, ~45-65 s to start, so several phases share one):

| run | host layout        | tier          | phases |
|-----|--------------------|---------------|--------|
| R0  | no HiCache         | -             | reference greedy outputs |
| R1  | layer_first        | disk D1       | serve, settle, flush_cache, serve (L3 hit) |
| R2  | layer_first        | disk D1       | fresh process: serve (L3 hit from disk) |
| R3  | page_first_direct  | disk D2       | serve, settle, flush_cache, serve (L3 hit) |
| R4  | page_first_direct  | disk D2, corrupted before start | serve (miss, same outputs), settle, flush, serve (hit again) |
| R5  | layer_first, SGLang's generic API (no ``interface_v1``) | node server S | serve, settle (pages reach the server's shared pool) |
| R6  | layer_first, generic API | node server S | fresh process: serve (L3 hit from the shared pool) |

Every served output must equal R0's token for token.
"""

from __future__ import annotations

import os
import sys

import pytest

# "sglang.srt", not "sglang": tests/sglang itself is importable as a namespace package "sglang"
pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
transformers = pytest.importorskip("transformers")

from conftest import REPO, run_engine  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "server"))
import server_rig  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE = 16
PROMPTS = [
    [(7 * i + 3) % 997 + 1 for i in range(70)],
    [(13 * i + 5) % 991 + 1 for i in range(53)],
]
NEW_TOKENS = 8
BACKEND = {"backend_name": "kvconnect", "module_path": "kvconnect.integrations.sglang", "class_name": "KVConnectStorage",
           "interface_v1": 1, "prefetch_threshold": PAGE, "max_local_cpu_size": 0.05, "max_local_disk_size": 0.5}


def _gen():
    return {"op": "generate", "prompts": PROMPTS, "max_new_tokens": NEW_TOKENS}


def _spec(model, layout=None, disk=None, phases=(), **extra):
    spec = {"model": model, "page_size": PAGE, "phases": list(phases)}
    if layout:
        tiers = {"local_disk": str(disk)} if disk else {}
        spec.update(hicache=True, layout=layout, hicache_ratio=2, backend="dynamic", extra={**BACKEND, **tiers, **extra})
    return spec


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


def _storage_hits(phase):
    return [c.get("storage", 0) for c in phase["cached"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import tiny_models

    root = tmp_path_factory.mktemp("sglang_e2e")
    model = tiny_models.make_llama(str(root / "llama"))
    d1, d2 = root / "disk1", root / "disk2"
    settle_flush = [{"op": "settle", "seconds": 4}, {"op": "flush"}]
    out = {"R0": run_engine(_spec(model, phases=[_gen()]), root / "r0")}
    out["R1"] = run_engine(_spec(model, "layer_first", d1, [_gen(), *settle_flush, _gen()]), root / "r1")
    out["disk1_files"] = sum(len(fs) for _, _, fs in os.walk(d1))
    out["R2"] = run_engine(_spec(model, "layer_first", d1, [_gen()]), root / "r2")
    out["R3"] = run_engine(_spec(model, "page_first_direct", d2, [_gen(), *settle_flush, _gen()]), root / "r3")
    out["corrupted"] = _corrupt(d2)
    out["R4"] = run_engine(_spec(model, "page_first_direct", d2, [_gen(), *settle_flush, _gen()]), root / "r4")
    url = f"ipc://{root}/kvc.sock"
    server = server_rig.start_server_process(url, str(root / "server.log"), size_mb=64, lease_s=5.0)
    try:
        on_server = {"server_url": url, "interface_v1": 0}
        out["R5"] = run_engine(_spec(model, "layer_first", None, [_gen(), {"op": "settle", "seconds": 3}], **on_server), root / "r5")
        out["R6"] = run_engine(_spec(model, "layer_first", None, [_gen()], **on_server), root / "r6")
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
    hits = _storage_hits(second)
    # every full page of each prompt but the last token's is served from L3
    assert all(h >= PAGE for h in hits), second["cached"]
    assert all(c.get("device", 0) == 0 and c.get("host", 0) == 0 for c in second["cached"]), second["cached"]
    assert runs["disk1_files"] >= sum(len(p) // PAGE for p in PROMPTS)


def test_fresh_process_hits_the_disk_tier(runs):
    (phase,) = runs["R2"]["phases"]
    assert phase["outputs"] == runs["R0"]["phases"][0]["outputs"]
    assert all(h >= PAGE for h in _storage_hits(phase)), phase["cached"]


def test_page_first_direct_hits_after_flush(runs):
    first, _, _, second = runs["R3"]["phases"]
    ref = runs["R0"]["phases"][0]["outputs"]
    assert first["outputs"] == ref and second["outputs"] == ref
    assert all(h >= PAGE for h in _storage_hits(second)), second["cached"]


def test_corrupted_tier_is_a_miss_and_outputs_are_unchanged(runs):
    assert runs["corrupted"] > 0
    first, _, _, second = runs["R4"]["phases"]
    ref = runs["R0"]["phases"][0]["outputs"]
    assert first["outputs"] == ref
    assert _storage_hits(first) == [0, 0], first["cached"]  # every stored page was damaged: nothing loaded
    # the damaged pages were dropped and stored again: the next request hits
    assert second["outputs"] == ref
    assert all(h >= PAGE for h in _storage_hits(second)), second["cached"]


def test_fresh_process_hits_the_node_servers_shared_pool_through_the_generic_api(runs):
    ref = runs["R0"]["phases"][0]["outputs"]
    first, _ = runs["R5"]["phases"]
    assert first["outputs"] == ref
    (fresh,) = runs["R6"]["phases"]
    assert fresh["outputs"] == ref
    assert all(h >= PAGE for h in _storage_hits(fresh)), fresh["cached"]

