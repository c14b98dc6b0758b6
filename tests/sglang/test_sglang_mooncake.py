"""kvconnect as SGLang's HiCache L3 over Mooncake Store: a fresh SGLang process hits.

A real ``mooncake_master`` on loopback and kvconnect's node server holding the node's
Mooncake segment (``kvconnect server --mooncake-segment-gb``) are started here; each engine
process has its own small CPU pool and ``remote_url=mooncakestore://...`` (contributing no
segment), so what the second process finds can only have come through Mooncake.

| run | phases |
|-----|--------|
| M1  | serve (nothing stored anywhere yet: computed, the reference), settle (pages reach Mooncake) |
| M2  | fresh process: serve (L3 hits from Mooncake), outputs equal M1's |

M2 runs with ``--hicache-storage-prefetch-policy wait_complete`` (as a remote L3 is deployed):
under SGLang's default ``best_effort`` a request may be scheduled before its prefetch from
a store across the network finished, and what it then computes itself is not a hit.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
pytest.importorskip("transformers")

from support.mooncake_master import MooncakeMaster, NodeHolder, mooncake_available  # noqa: E402

_REASON = mooncake_available()
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

from engine_runs import PAGE, PROMPTS, gen, run_engine, spec, storage_hits  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from support import tiny_models

    root = tmp_path_factory.mktemp("sglang_mooncake")
    model = tiny_models.make_llama(str(root / "llama"))
    with MooncakeMaster(root / "master") as master:
        holder = NodeHolder(master, root / "node", 0.25)
        try:
            path = root / "mooncake.json"
            path.write_text(json.dumps({"global_segment_size": 0, "protocol": "tcp"}))
            tier = {"remote_url": master.url, "mooncake_config_path": str(path), "max_local_disk_size": 0}
            out = {
                "M1": run_engine(spec(model, "layer_first", None, [gen(), {"op": "settle", "seconds": 4}], **tier), root / "m1"),
                "M2": run_engine({**spec(model, "layer_first", None, [gen()], **tier), "prefetch_policy": "wait_complete"},
                                 root / "m2"),
            }
        finally:
            holder.stop()
    return out


def test_fresh_sglang_process_hits_mooncake_with_identical_outputs(runs):
    first, _ = runs["M1"]["phases"]
    assert storage_hits(first) == [0] * len(PROMPTS), first["cached"]  # computed: the reference
    (fresh,) = runs["M2"]["phases"]
    assert fresh["outputs"] == first["outputs"]
    assert all(h >= PAGE for h in storage_hits(fresh)), fresh["cached"]
