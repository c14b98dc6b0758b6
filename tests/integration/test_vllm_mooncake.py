"""Two vLLM engine processes share KV through Mooncake Store (real master, loopback).

A ``mooncake_master`` and kvconnect's node server holding the node's Mooncake segment
(``kvconnect server --mooncake-segment-gb``) are started here. The first vLLM process (its
own CPU pool, ``LMCACHE_REMOTE_URL=mooncakestore://...``, contributing no segment) serves
a prompt and exits; the second, a fresh process with an empty pool, serves a prompt sharing
its prefix: the prefix's whole chunks must come back from Mooncake and the outputs must
equal a plain engine's.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
from support.tiny_models import random_tokens


from support.mooncake_master import MooncakeMaster, NodeHolder, mooncake_available  # noqa: E402

_REASON = mooncake_available()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]

CHUNK = 64


@pytest.fixture
def mooncake_node(tmp_path):
    """A master and a node server holding 256 MB for it; yields the engines' extra config."""
    with MooncakeMaster(tmp_path / "master") as master:
        holder = NodeHolder(master, tmp_path / "node", 0.25)
        try:
            path = tmp_path / "mooncake.json"
            path.write_text(json.dumps({"global_segment_size": 0, "protocol": "tcp", "local_hostname": "127.0.0.1"}))
            yield {"remote_url": master.url, "mooncake_config_path": str(path)}
        finally:
            holder.stop()


def test_second_engine_process_hits_what_the_first_stored(mooncake_node, tiny_models, run_vllm, tmp_path):
    rng = random.Random(3)
    prefix = random_tokens(rng, 500)  # 7 whole chunks + 52 tokens
    a, b = prefix + random_tokens(rng, 37), prefix + random_tokens(rng, 45)
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=8, max_num_batched_tokens=128)
    model = tiny_models("llama")
    extra = json.dumps(mooncake_node)

    plain = run_vllm(model, [[a], [b]], **opts)
    first = run_vllm(model, [[a]], connector=f"ipc://{tmp_path}/kvc1", extra_config=extra, **opts)
    second = run_vllm(model, [[b]], connector=f"ipc://{tmp_path}/kvc2", extra_config=extra, **opts)

    assert first["outputs"] == plain["outputs"][:1]
    assert second["outputs"] == plain["outputs"][1:]
    ((s1,),) = first["stats"]
    ((s2,),) = second["stats"]
    assert s1["loaded_tokens"] == 0 and s1["save_failures"] == 0
    assert s2["loaded_tokens"] == 448  # the 7 whole chunks of the shared prefix, from Mooncake
    assert s2["load_failures"] == 0
