"""kvconnect under vLLM's own Scheduler and model-runner mixin (vllm_scheduler_rig: only the
forward is faked). Each test drains the engine and checks vLLM's block pool for leaks.

Chunk 64 tokens, vLLM block 16 tokens: a chunk is 4 blocks.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK, BLOCK = 64, 16


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama")  # conftest: built once per session


@pytest.fixture
def rig(model_dir):
    from vllm_scheduler_rig import make_rig

    made = []

    def make(**kwargs):
        made.append(make_rig(model_dir, chunk_size=CHUNK, block_size=BLOCK, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, n)


def _store(r, tokens) -> None:
    """Run ``tokens`` to completion (its chunks are saved), then forget vLLM's own prefix cache."""
    r.add(tokens)
    r.run()
    r.assert_no_leak()
    assert r.scheduler.reset_prefix_cache()


def _first_compute(r, req) -> int:
    """Where vLLM's first forward of ``req`` started (its computed prefix after any load)."""
    return r.computed_log[req.request_id][0][0]


def test_a_stored_prompt_is_loaded_by_the_next_request_byte_exact(rig):
    r = rig()
    tokens = _prompt(0, 200)
    _store(r, tokens)
    req = r.add(tokens)
    r.step()  # lookup: 192 tokens, asynchronous load
    from vllm.v1.request import RequestStatus

    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.request_id not in r.computed_log
    r.step()  # the load landed; vLLM runs the request from token 192
    assert _first_compute(r, req) == 192
    r.check_rows(req, 192)
    r.run()
    r.assert_no_leak()


def test_a_short_load_reports_exactly_the_blocks_that_failed(rig):
    """2 of 3 chunks land: vLLM recomputes the third chunk only (64 tokens, not 192)."""
    r = rig()
    tokens = _prompt(1, 200)
    _store(r, tokens)
    third = r.engine.chunks(tokens, include_partial=False)[2].key

    blocks = []

    def lose_third_chunk(out):  # after vLLM planned the load, before the worker runs it
        assert out.kv_connector_metadata.plan.loads
        r.engine.pool.remove(third)
        blocks.extend(r.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0])

    req = r.add(tokens)
    _, kv_output = r.step(lose_third_chunk)  # lookup (192 tokens) and load: chunks 0 and 1 land
    assert kv_output.invalid_block_ids == set(blocks[128 // BLOCK : 192 // BLOCK])
    assert not kv_output.failed_recving
    r.run()
    assert _first_compute(r, req) == 128
    assert r.worker._worker.stats()["loads"] == 1  # vLLM kept the 128 tokens that landed: no second load
    assert sum(n for _, n in r.computed_log[req.request_id]) == 200 - 128 + 1  # + the decode step
    assert r.worker._worker.stats()["load_failures"] == 1
    r.assert_no_leak()


def test_a_load_that_lands_nothing_recomputes_from_vllms_own_prefix(rig):
    r = rig()
    tokens = _prompt(2, 200)
    _store(r, tokens)
    keys = [c.key for c in r.engine.chunks(tokens, include_partial=False)]

    def lose_everything(out):
        if out.kv_connector_metadata.plan.loads:
            for key in keys:
                r.engine.pool.remove(key)

    req = r.add(tokens)
    r.run(before_worker=lose_everything)
    assert _first_compute(r, req) == 0
    r.assert_no_leak()


@pytest.mark.parametrize("scheme", ["ipc", "tcp", "default"])
def test_data_parallel_ranks_each_answer_their_own_lookups(rig, tmp_path, scheme):
    if scheme == "ipc":
        extra = {"lookup_url": f"ipc://{tmp_path}/lookup"}
    elif scheme == "tcp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            extra = {"lookup_url": f"tcp://127.0.0.1:{s.getsockname()[1]}", "lookup_token": "dp-test-token"}  # tcp: a token
    else:  # no address given: derived from the engine id both ranks share
        extra = {}
    # vLLM's DP engine cores start side by side: both ranks' workers bind before a scheduler connects
    ranks = [rig(extra=extra, dp_rank=d, start_scheduler=False, engine_id=f"dp-engine-{tmp_path.name}") for d in (0, 1)]
    for r in ranks:
        r.start_scheduler()
    prompts = [_prompt(10, 160), _prompt(11, 160)]
    for r, p in zip(ranks, prompts):
        _store(r, p)
    for d, r in enumerate(ranks):
        mine = r.add(prompts[d])
        other = r.add(prompts[1 - d])
        assert r.connector.get_num_new_matched_tokens(mine, 0) == (128, True)
        assert r.connector.get_num_new_matched_tokens(other, 0) == (0, False)
        r.run()
        assert _first_compute(r, mine) == 128 and _first_compute(r, other) == 0
        r.assert_no_leak()


def test_a_tcp_lookup_channel_without_a_token_stops_the_engine_at_start(rig):
    from kvconnect.errors import ConfigError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConfigError, match="KVCONNECT_LOOKUP_TOKEN"):
        rig(extra={"lookup_url": url})


@pytest.mark.parametrize("length, expected", [(63, 0), (64, 63), (65, 64), (127, 64), (128, 127), (129, 128), (80, 64)])
def test_prompt_lengths_around_one_chunk(rig, length, expected):
    """The documented rule: the stored chunk-aligned prefix, but never the prompt's last token."""
    r = rig(extra={"min_load_tokens": 1})
    tokens = _prompt(length, length)
    _store(r, tokens)
    req = r.add(tokens)
    r.run()
    assert _first_compute(r, req) == expected
    r.assert_no_leak()


def test_prompt_lengths_property(rig):
    """Over many lengths, with and without vLLM's own prefix hit: vLLM starts exactly at the rule's
    boundary and every row it holds is right."""
    from hypothesis import HealthCheck, example, given, settings, strategies as st

    r = rig(extra={"min_load_tokens": 1})
    seeds = iter(range(10_000, 20_000))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(length=st.integers(1, 300), keep_vllm_prefix=st.booleans())
    @example(length=CHUNK, keep_vllm_prefix=False)
    @example(length=2 * CHUNK, keep_vllm_prefix=True)
    def check(length, keep_vllm_prefix):
        tokens = _prompt(next(seeds), length)
        r.add(tokens)
        r.run()
        if not keep_vllm_prefix:
            assert r.scheduler.reset_prefix_cache()
        req = r.add(tokens)
        r.run()
        full_blocks = (length - 1) // BLOCK * BLOCK  # vLLM's own hit leaves the last token too
        own = full_blocks if keep_vllm_prefix else 0
        stored = length // CHUNK * CHUNK
        ours = min(stored, length - 1)
        assert _first_compute(r, req) == max(own, ours)
        r.assert_no_leak()
        assert r.scheduler.reset_prefix_cache()

    check()


def test_reset_connector_reaches_the_disk_tier_and_stores_again(rig, tmp_path):
    """vLLM's reset_prefix_cache(reset_connector=True): no chunk stored before it is loaded, though
    the disk still holds them (kept for engines still on the old weights); stored again, they hit."""
    r = rig(extra={"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05})
    tokens = _prompt(20, 200)
    _store(r, tokens)
    assert r.engine.storage.flush(30.0)
    disk = r.engine.storage.tiers[0]
    on_disk = len(disk)
    assert on_disk == 3
    assert r.engine.generation == b""
    assert r.scheduler.reset_prefix_cache(reset_connector=True)
    # vLLM's scheduler-side connector chose the new generation, and the worker moved to it
    assert len(r.engine.generation) == 16 and r.engine.generation == r.connector._scheduler.generation
    before = r.add(tokens)
    r.run()
    assert _first_compute(r, before) == 0  # nothing from kvconnect: not the pool, not the disk
    assert len(disk) >= on_disk  # the old chunks were not deleted from the (shareable) disk
    assert r.scheduler.reset_prefix_cache()
    assert r.engine.storage.flush(30.0)
    r.engine.pool.clear()  # the new generation's chunks come back from the disk
    after = r.add(tokens)
    r.run()
    assert _first_compute(r, after) == 192
    r.assert_no_leak()


def test_chunked_prefill_saves_say_which_end_at_a_step_end(rig):
    """Under chunked prefill (64-token steps over 64-token chunks) every save short of the prompt's
    last full chunk is a step end, every save after the first continues one, and the rows stored
    are those vLLM computed: a second request of the same prompt loads them byte-exact."""
    r = rig(max_num_batched_tokens=64, enable_prefix_caching=False)  # the second request's hit is the connector's
    tokens = _prompt(11, 230)  # full chunks end at 64, 128, 192
    saves = []
    req = r.add(tokens)
    r.run(before_worker=lambda out: saves.extend(out.kv_connector_metadata.plan.saves))
    assert [(len(j.tokens), j.stored_tokens, j.step_end, j.continues) for j in saves] == [
        (64, 0, True, False), (128, 64, True, True), (192, 128, False, True)]
    # a step end carries the prompt's next chunk (the engine looks it up: walks on, or leaves a prefix)
    assert [None if j.then is None else j.then.tolist() for j in saves] == [
        tokens[64:128].tolist(), tokens[128:192].tolist(), None]
    assert all(start + n <= len(tokens) + 1 for start, n in r.computed_log[req.request_id])
    again = r.add(tokens)
    r.run()  # the rig's forward checks every row vLLM counts as computed, the loaded ones included
    assert _first_compute(r, again) == 192
    r.assert_no_leak()


@pytest.mark.parametrize("discard, stored", [(True, 192), (False, 200)])
def test_lmcache_vllm_keys_are_read_with_lmcaches_meaning_and_warned_once_by_the_scheduler(rig, monkeypatch, discard, stored):
    """LMCache 0.5.6's kv_connector_extra_config keys (issue 41): ``lmcache.<key>`` is LMCache's config
    key, ``skip_last_n_tokens`` leaves the prompt's last tokens out of the lookup (vLLM then computes
    them), ``discard_partial_chunks`` stores no partial chunk; a setting kvconnect does not use is
    warned about by the scheduler's connector only, and a value that matches kvconnect is silent."""
    from kvconnect import config as config_module
    from kvconnect.throttled_warning import OnceWarnings

    warned: list[str] = []
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(lambda msg, *a: warned.append(msg % a)).warn)
    extra = {"lmcache.max_local_cpu_size": 0.125, "lmcache.save_unfull_chunk": True, "discard_partial_chunks": discard,
             "skip_last_n_tokens": 72, "lmcache.enable_p2p": True, "lmcache.enable_blending": False}
    r = rig(extra=extra, start_scheduler=False)
    config = r.engine.config  # the worker's (it stores whatever partial chunk the scheduler hands it: P/D)
    assert (config.max_local_cpu_size, config.skip_last_n_tokens) == (0.125, 72)
    assert warned == []  # the worker reads quietly
    r.start_scheduler()
    assert len(warned) == 1 and "lmcache.enable_p2p" in warned[0], warned  # enable_blending: false is kvconnect's
    tokens = _prompt(5, 200)
    _store(r, tokens)
    assert r.engine.lookup(tokens) == stored  # 3 whole chunks, and the partial one unless discarded
    req = r.add(tokens)
    r.step()
    r.step()
    assert _first_compute(r, req) == 128  # the lookup saw 200 - 72 = 128 tokens: 2 chunks
    r.check_rows(req, 128)
    r.run()
    r.assert_no_leak()
