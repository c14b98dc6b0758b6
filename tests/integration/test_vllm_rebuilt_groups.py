"""Engine-rebuilt groups (issue 38 item 1(a)) under vLLM's own Scheduler and KV-cache managers.

Each ring model's group structure as vLLM 0.33's registering code builds it (vllm_rebuilt_rig:
DeepSeek V4.1, Qwen4-exp, GLM-5-Next, Step5; vLLM's own spec classes, hand-built KVCacheConfig,
the forward faked): kvconnect stores and loads the prefix-cacheable groups only, its hits land
where every ring is empty (each ring's rows are checked by the fake forward when a token closes its
period), every cacheable row is restored byte-exact, no byte of a rebuilt group is stored, and vLLM
claims a fresh ring and replays the bounded window after kvconnect's hit exactly as after its own
prefix-cache hit.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK = 128


@pytest.fixture
def rig(rebuilt_rig):
    return functools.partial(rebuilt_rig, chunk_size=CHUNK)  # conftest: closed after the test


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, n)


@pytest.mark.parametrize("name", ["deepseek_v41", "qwen4_exp", "glm5_next", "step5"])
def test_hits_restore_cacheable_groups_and_vllm_rebuilds_the_rest(rig, name):
    from kvconnect.integrations.vllm import rebuilt
    from vllm_rebuilt_rig import STRUCTURES, kind_of

    structure = STRUCTURES[name]()
    r = rig(structure)
    translation = r.worker._worker.translation
    layout = translation.layout
    stored = {layer.name for group in structure for layer in group if kind_of(layer.spec) in ("rows", "window")}
    rebuilt_layers = {layer.name for group in structure for layer in group} - stored
    # no plane, so no byte, of a rebuilt group; each one named in the identity
    assert {p.layer_name for p in layout.planes} == stored
    assert len(layout.rebuilt) == sum(kind_of(g[0].spec) not in ("rows", "window") for g in structure) and rebuilt_layers
    assert layout.resume_every == rebuilt.resume_every_of(r.kv_cache_config)
    assert CHUNK % layout.resume_every == 0  # chunk ends are rebuildable points here
    # kvconnect's rebuilt groups are the groups vLLM keeps out of prefix_cacheable_group_ids, and
    # get_loaded_kv_cache_group_ids stays vLLM's default (those groups: the ones kvconnect loads)
    config = r.kv_cache_config
    groups = set(range(len(config.kv_cache_groups)))
    assert set(rebuilt.rebuilt_group_ids(config)) == groups - set(config.prefix_cacheable_group_ids)
    assert set(r.connector.get_loaded_kv_cache_group_ids(None)) == set(config.prefix_cacheable_group_ids)

    tokens = _prompt(1, 3 * CHUNK + 45)
    r.add(tokens)
    r.run()
    assert r.scheduler.reset_prefix_cache()  # vLLM forgets; kvconnect keeps the chunks
    req = r.add(tokens)
    r.run()  # the fake forward checked every cacheable row and every ring read after the load
    hit = 3 * CHUNK
    assert hit % layout.resume_every == 0
    starts = r.computed_log[req.request_id]
    replay = r.scheduler.prefix_replay_tokens
    assert starts[0][0] == hit - replay, (starts, replay)  # vLLM resumed at the hit, less its replayed window
    assert r.replay_starts[req.request_id] == (hit - replay if replay else 0)
    r.assert_no_leak()


def test_a_hit_off_the_ring_period_is_never_offered(rig):
    """Chunks of 32 tokens over Qwen4-exp's structure with an 8-token ratio and a 64-token ring
    (drafts): kvconnect stores every chunk but offers only multiples of the ring, the rule the fake
    forward's ring reads check."""
    from vllm_rebuilt_rig import qwen4_exp

    structure = qwen4_exp(block=64, ratio=8, drafts=50)
    r = rig(structure, extra={"chunk_size": 32})
    assert r.worker._worker.translation.layout.resume_every == 64
    tokens = _prompt(2, 64 + 32 + 9)  # chunk ends 32, 64, 96: only 64 is on the ring's period
    r.add(tokens)
    r.run()
    assert r.scheduler.reset_prefix_cache()
    req = r.add(tokens)
    r.run()
    assert r.computed_log[req.request_id][0][0] == 64
    r.assert_no_leak()


def test_the_rigs_ring_reads_catch_a_hit_off_the_period(rig, monkeypatch):
    """The negative control: with kvconnect's period rule switched off, a hit at 60 (chunks of 12)
    with a ring of period 8 (Qwen4-exp's structure, its compressed key cache at ratio 4 so that a
    12-token chunk holds whole rows) leaves the open group [56, 64) half computed in a fresh ring,
    and the token closing it reads ring rows vLLM never rebuilt: the rig's check fails."""
    from kvconnect.integrations.vllm import rebuilt
    from vllm_rebuilt_rig import Layer, ring_spec, qwen4_exp

    monkeypatch.setattr(rebuilt, "_resume_every", lambda spec, block, release: 1)
    structure = qwen4_exp(block=64, ratio=4)
    structure[-1] = [Layer("layers.3.qsa.k_ring", ring_spec(8, 1, 32), period=8)]
    r = rig(structure, extra={"chunk_size": 12})
    assert r.worker._worker.translation.layout.resume_every == 1
    tokens = _prompt(4, 62)
    r.add(tokens)
    r.run()
    assert r.scheduler.reset_prefix_cache()
    r.add(tokens, max_tokens=4)  # decodes through token 63, which closes the group
    with pytest.raises(AssertionError, match="ring of layers.3.qsa.k_ring lacks position 56"):
        r.run()


def test_vllm_replays_the_window_after_kvconnects_hit_as_after_its_own(rig):
    """DeepSeek V4.1: the same prompt hit by vLLM's own prefix cache, then (its cache reset) by
    kvconnect: the same resume point, the same replay_start, the same forwards."""
    from vllm_rebuilt_rig import deepseek_v41

    r = rig(deepseek_v41())
    tokens = _prompt(3, 2 * CHUNK + 45)  # both hits at 256: vLLM's on its 64-token blocks, kvconnect's on a chunk end
    r.add(tokens)
    r.run()
    hits = r.connector._scheduler.lookup_stats
    own = r.add(tokens)
    r.run()
    assert hits["hits"] == 0  # vLLM's own prefix cache served it
    assert r.scheduler.reset_prefix_cache()
    ours = r.add(tokens)
    r.run()
    assert hits["hits"] == 1 and hits["hit_tokens"] == 2 * CHUNK  # kvconnect served this one
    replay = r.scheduler.prefix_replay_tokens
    assert replay == 128
    assert r.computed_log[own.request_id] == r.computed_log[ours.request_id]
    assert r.replay_starts[own.request_id] == r.replay_starts[ours.request_id] == 2 * CHUNK - replay
    # vLLM claimed each request a fresh ring block of its own
    r.assert_no_leak()
