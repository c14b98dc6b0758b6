"""SGLang's storage clear (``clear_hicache_storage``, HTTP ``POST /clear_hicache_storage_backend``,
what a weight update is followed by) reaching kvconnect on a real SGLang engine with the pool
and a disk tier: afterwards nothing stored before is served (although the disk still holds it)
and outputs are unchanged; stored again, the prompts hit again."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
pytest.importorskip("transformers")

from engine_runs import PAGE, gen, run_engine, spec, storage_hits  # noqa: E402

pytestmark = pytest.mark.sglang


def test_clear_reaches_every_tier_and_pages_are_stored_again(tmp_path):
    from support import tiny_models

    model = tiny_models.make_llama(str(tmp_path / "llama"))
    disk = tmp_path / "disk"
    settle_flush = [{"op": "settle", "seconds": 4}, {"op": "flush"}]
    phases = [gen(), *settle_flush, gen(),  # stored, then served from kvconnect
              {"op": "clear"}, {"op": "flush"}, gen(),  # after the clear: nothing from kvconnect
              *settle_flush, gen()]  # stored again: served again
    run = run_engine(spec(model, "layer_first", disk, phases), tmp_path / "run")["phases"]
    first, _, _, hit, cleared, _, after_clear, _, _, again = run
    assert cleared["cleared"]
    assert all(h >= PAGE for h in storage_hits(hit)), hit["cached"]
    assert storage_hits(after_clear) == [0, 0], after_clear["cached"]
    assert sum(len(fs) for _, _, fs in os.walk(disk)) > 0  # the disk kept the old pages: a miss all the same
    assert all(h >= PAGE for h in storage_hits(again)), again["cached"]
    assert first["outputs"] == hit["outputs"] == after_clear["outputs"] == again["outputs"]
