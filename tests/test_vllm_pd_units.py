"""P/D disaggregation's engine-free parts: roles, kv_transfer_params, the decode side's wait.

No vLLM needed: the scheduler side (``KVConnectScheduler`` wrapped by ``pd.PDScheduler``)
runs against a stand-in for the lookup channel whose restorable prefix the test sets, on a
clock the test moves. The real protocol through vLLM and its router is in
tests/integration/test_vllm_pd.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvconnect import Config, ConfigError
from kvconnect.integrations.vllm import pd, roles, transfer_params as tp
from kvconnect.integrations.vllm.metadata import RequestView
from kvconnect.integrations.vllm.scheduler import KVConnectScheduler

CHUNK, BLOCK = 64, 32
SHARED = Config(server_url="ipc:///tmp/kvc-unit.sock")


# --- roles -------------------------------------------------------------------------------
def test_roles_decide_lookups_and_stores():
    producer = roles.role_policy("kv_producer", SHARED)
    consumer = roles.role_policy("kv_consumer", SHARED)
    both = roles.role_policy(None, Config())
    assert (producer.loads, producer.stores_prompt, producer.stores_decode) == (False, True, False)
    assert (consumer.loads, consumer.stores_prompt, consumer.stores_decode, consumer.stores) == (True, False, False, False)
    assert (both.role, both.loads, both.stores_prompt) == (roles.Role.BOTH, True, True)
    keep_decode = roles.role_policy("kv_consumer", Config(remote_url="redis://127.0.0.1:1", save_decode_cache=True))
    assert keep_decode.stores and not keep_decode.stores_prompt and keep_decode.stores_decode


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_pd_role_without_a_shared_tier_is_refused_at_start(role):
    with pytest.raises(ConfigError, match="server_url or remote_url"):
        roles.role_policy(role, Config())


@pytest.mark.parametrize("bad", ["kv_prefill", "", "KV_PRODUCER", "both"])
def test_an_unknown_role_is_one_clear_error(bad):
    with pytest.raises(ConfigError, match="is not one of kv_both, kv_producer, kv_consumer"):
        roles.role_policy(bad, SHARED)


def test_pd_timeouts_are_validated_config():
    assert Config.from_dict({"pd_wait_timeout_s": "2.5"}).pd_wait_timeout_s == 2.5
    assert Config.from_env({"KVCONNECT_PD_POLL_INTERVAL_S": "0.01"}).pd_poll_interval_s == 0.01
    with pytest.raises(ConfigError, match="KVCONNECT_PD_WAIT_TIMEOUT_S"):
        Config(pd_wait_timeout_s=-1)
    with pytest.raises(ConfigError, match="KVCONNECT_PD_POLL_INTERVAL_S"):
        Config.from_dict({"pd_poll_interval_s": -0.5})


# --- kv_transfer_params --------------------------------------------------------------------
PROMPT = np.arange(3, 303, dtype=np.int64)  # 300 tokens: 4 chunks of 64 + 44


def stored(**kw) -> tp.StoredPrefill:
    values = dict(tokens=288, chunk_tokens=CHUNK, tp_size=1, prompt_digest=tp.prompt_digest(PROMPT), model="m", engine_id="e1")
    values.update(kw)
    return tp.StoredPrefill(**values)


def test_params_round_trip_in_vllms_shape():
    params = stored().to_params()
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "e1"
    assert tp.remote_prefill(params) == stored()
    assert tp.remote_prefill({**params, "remote_prefill_cached_tokens": 0}) == stored()  # vLLM adds this field


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": True},
                                    {"do_remote_prefill": True, "remote_block_ids": [1, 2]}, "text", [1]])
def test_params_naming_no_kvconnect_prefill_are_not_ours(params):
    assert tp.remote_prefill(params) is None


@pytest.mark.parametrize("entry, why", [
    ("x", "must be an object"),
    ({"v": 2}, "version"),
    ({"tokens": -1}, "'tokens'"),
    ({"tokens": True}, "'tokens'"),
    ({"chunk_tokens": "64"}, "'chunk_tokens'"),
    ({"tp_size": 0}, "'tp_size'"),
    ({"prompt_digest": "XYZ"}, "prompt_digest"),
    ({"prompt_digest": "0" * 31}, "prompt_digest"),
    ({"model": ["m"]}, "short strings"),
])
def test_malformed_params_are_a_typed_error(entry, why):
    params = stored().to_params()
    params["kvconnect"] = entry if not isinstance(entry, dict) else {**params["kvconnect"], **entry}
    with pytest.raises(tp.TransferParamsError, match=why):
        tp.remote_prefill(params)


def test_only_do_remote_decode_true_asks_for_a_prefill():
    assert tp.wants_remote_decode({"do_remote_decode": True})
    assert not tp.wants_remote_decode({"do_remote_decode": "true"})
    assert not tp.wants_remote_decode({"do_remote_decode": False}) and not tp.wants_remote_decode(None)


def test_identity_checks():
    ok = dict(prompt=PROMPT, namespace=b"", chunk_tokens=CHUNK, model="m")
    assert tp.mismatch(stored(), **ok) is None
    assert "model 'other-model'" in tp.mismatch(stored(model="other-model"), **ok)
    assert tp.mismatch(stored(model=""), **ok) is None  # params naming no model: not checked on it
    assert "128-token" in tp.mismatch(stored(chunk_tokens=128), **ok)
    assert tp.mismatch(stored(tp_size=2), **ok) is None  # another TP size: the workers decide (test_vllm_pd_other_tp.py)
    assert "another prompt" in tp.mismatch(stored(), **{**ok, "prompt": PROMPT[::-1].copy()})
    assert "another prompt" in tp.mismatch(stored(), **{**ok, "namespace": b"salt"})
    assert "400 tokens" in tp.mismatch(stored(tokens=400), **ok)


# --- the scheduler side ----------------------------------------------------------------------
class TierHits:
    """The lookup channel over a shared tier holding chunks of one prompt up to ``restorable``,
    stored under the key generation ``generation`` (a lookup under another finds nothing)."""

    def __init__(self) -> None:
        self.restorable = 0
        self.generation = b""
        self.calls: list[tuple[int, bool]] = []  # (tokens asked about, counted)
        self.asked_generations: list = []  # the generation each lookup named
        self.cleared_to: list = []
        self.retired_to: list = []  # the generation each clear retired (None: none)
        self.markers: set = set()  # generations whose retirement marker the tier holds

    def lookup(self, tokens, namespace=b"", *, count=True, generation=None, media=()):
        self.calls.append((len(tokens), count))
        self.asked_generations.append(generation)
        return min(self.restorable, len(tokens)) if generation == self.generation else 0

    def clear(self, generation=None, retire=None):
        self.cleared_to.append(generation)
        self.retired_to.append(retire)
        if retire is not None:
            self.markers.add(retire)
        return True

    def retired(self, generation):
        return generation in self.markers

    def tp_refusal(self, tp_size):  # workers whose layout reads no other TP size (test_vllm_pd_other_tp.py: those that do)
        return f"worker 0: cannot read TP {tp_size}'s chunks"

    def close(self):
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(role: str, *, timeout_s=2.0, poll_s=0.01, config=SHARED, **kw):
    policy = roles.role_policy(role, config)
    hits, clock = TierHits(), Clock()
    sched = KVConnectScheduler(hits, chunk_tokens=CHUNK, min_load_tokens=CHUNK, role=policy, tail_align_tokens=BLOCK,
                               save_decode_cache=config.save_decode_cache, **kw)
    server = pd.PDScheduler(sched, policy, pd.ServerIdentity(chunk_tokens=CHUNK, tp_size=1, model="m", engine_id="e1"),
                            wait_timeout_s=timeout_s, poll_interval_s=poll_s, clock=clock)
    return server, sched, hits, clock


def view(req_id="r", prompt=PROMPT, num_tokens=None) -> RequestView:
    return RequestView(req_id, prompt, len(prompt) if num_tokens is None else num_tokens)


PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None}


def test_producer_never_looks_up_and_stores_the_whole_prompt_to_the_last_block():
    server, sched, hits, _ = make("kv_producer")
    req = view()
    assert server.num_new_matched_tokens(req, 96, PREFILL) == (0, False)  # vLLM's own cache held 96
    assert hits.calls == []
    sched.after_alloc(req, (), 96, 0)
    plan = sched.build_plan({"r": len(PROMPT) - 96}, lambda r: 96, lambda r: ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10),))
    (save,) = plan.saves
    # every chunk from token 0 (vLLM's cached blocks too), up to the last block edge 288 (9 x 32)
    assert (len(save.tokens), save.stored_tokens) == (288, 0)
    params = server.request_finished(req, PREFILL)
    assert tp.remote_prefill(params) == stored(generation=sched.generation)  # its fresh start generation
    assert server.counters["remote_decode_prefills"] == 1


def test_a_plain_request_on_a_producer_stores_chunks_only_and_names_nothing():
    server, sched, hits, _ = make("kv_producer")
    req = view()
    assert server.num_new_matched_tokens(req, 0, None) == (0, False)
    sched.after_alloc(req, (), 0, 0)
    (save,) = sched.build_plan({"r": 300}, lambda r: 0, lambda r: ((1,) * 10,)).saves
    assert len(save.tokens) == 256
    assert server.request_finished(req, None) is None and hits.calls == []


def test_an_aborted_prefill_names_nothing():
    server, sched, _, _ = make("kv_producer")
    req = view()
    server.num_new_matched_tokens(req, 0, PREFILL)
    sched.after_alloc(req, (), 0, 0)
    sched.build_plan({"r": 128}, lambda r: 0, lambda r: ((1,) * 10,))  # 128 of 300 computed, then aborted
    assert server.request_finished(req, PREFILL) is None


def test_prompt_of_exactly_whole_chunks_names_them_all():
    server, sched, _, _ = make("kv_producer")
    req = view(prompt=PROMPT[:256])
    server.num_new_matched_tokens(req, 0, PREFILL)
    sched.after_alloc(req, (), 0, 0)
    (save,) = sched.build_plan({"r": 256}, lambda r: 0, lambda r: ((1,) * 8,)).saves
    assert len(save.tokens) == 256
    assert server.request_finished(req, PREFILL)["kvconnect"]["tokens"] == 256


def test_consumer_asks_later_until_the_producers_chunks_land_then_loads_them(caplog):
    server, sched, hits, clock = make("kv_consumer")
    req, params = view(), stored().to_params()
    assert server.num_new_matched_tokens(req, 0, params) == (None, False)  # nothing there yet
    assert hits.calls == [(288, False)]  # a probe of the named prefix, left out of the figures
    clock.t += 0.005
    assert server.num_new_matched_tokens(req, 0, params) == (None, False)
    assert len(hits.calls) == 1  # within the poll interval: the tier is not asked again
    hits.restorable = 256  # four chunks landed, not the tail
    clock.t += 0.01
    assert server.num_new_matched_tokens(req, 0, params) == (None, False)
    hits.restorable = 288
    clock.t += 0.01
    assert server.num_new_matched_tokens(req, 0, params) == (288, True)  # vLLM computes 12 tokens
    assert hits.calls[-1] == (288, True)
    assert server.counters["remote_prefills"] == 1 and server.counters["remote_prefill_ready"] == 1
    assert server.counters["remote_prefill_wait_us"] == pytest.approx(25_000, abs=10)
    assert server.num_waiting == 0
    sched.after_alloc(req, ((1,) * 10,), 0, 288)
    plan = sched.build_plan({"r": 12}, lambda r: 288, lambda r: ((1,) * 10,))
    (load,) = plan.loads
    assert (len(load.tokens), load.end_tokens) == (288, 288)
    assert plan.saves == ()  # a consumer stores nothing
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_waiting_decode_probes_less_often_the_longer_it_waits():
    """The probe interval doubles after each miss, up to MAX_POLL_INTERVAL_S, and past that is
    PROBE_GROWTH of the time waited: a remote store's master is not flooded by waiting requests
    (hundreds of RPCs a second at a fixed 5 ms), and a request waits at most one interval past
    its chunks landing."""
    server, _, hits, clock = make("kv_consumer", timeout_s=10.0, poll_s=0.005)
    req, params = view(), stored().to_params()
    probes_at = []
    for _ in range(2000):  # 2 s of scheduler steps, one per millisecond
        before = len(hits.calls)
        assert server.num_new_matched_tokens(req, 0, params) == (None, False)
        if len(hits.calls) > before:
            probes_at.append(round(clock.t - 100.0, 3))
        clock.t += 0.001
    gaps = [round(b - a, 3) for a, b in zip(probes_at, probes_at[1:])]
    assert gaps[:4] == [0.01, 0.02, 0.04, 0.05]  # the first at once, then 2 x 5 ms, doubling, capped
    for at, gap in zip(probes_at[1:], gaps[1:]):
        assert gap <= max(pd.MAX_POLL_INTERVAL_S, pd.PROBE_GROWTH * at) + 0.0015, (at, gap)
    assert len(probes_at) <= 25  # ~20 in 2 s, not 40 (or 400 at a fixed 5 ms)
    hits.restorable = 288
    clock.t += pd.PROBE_GROWTH * 2.0
    assert server.num_new_matched_tokens(req, 0, params) == (288, True)  # at most one interval late


def test_a_poll_interval_longer_than_the_cap_is_kept():
    server, _, hits, clock = make("kv_consumer", timeout_s=10.0, poll_s=0.2)
    req, params = view(), stored().to_params()
    server.num_new_matched_tokens(req, 0, params)
    clock.t += 0.199
    server.num_new_matched_tokens(req, 0, params)
    assert len(hits.calls) == 1
    clock.t += 0.001
    server.num_new_matched_tokens(req, 0, params)
    assert len(hits.calls) == 2


def test_a_producer_that_never_stores_costs_the_timeout_then_a_recompute(caplog):
    server, _, hits, clock = make("kv_consumer", timeout_s=2.0)
    params = stored().to_params()
    for i in range(5):
        assert server.num_new_matched_tokens(view(), 0, params) == (None, False)
        clock.t += 0.3
    hits.restorable = 128  # part of it is there
    clock.t += 1.0
    with caplog.at_level(logging.WARNING, logger="kvconnect"):
        assert server.num_new_matched_tokens(view(), 0, params) == (128, True)  # what is there; vLLM computes the rest
        assert server.counters["remote_prefill_timeouts"] == 1
        # a second one within WARN_INTERVAL_S is counted, not logged
        assert server.num_new_matched_tokens(view("r2"), 0, params) == (None, False)
        clock.t += 2.5
        hits.restorable = 0
        assert server.num_new_matched_tokens(view("r2"), 0, params) == (0, False)
    assert server.counters["remote_prefill_timeouts"] == 2
    warnings = [r for r in caplog.records if "were not all in the shared tier" in r.getMessage()]
    assert len(warnings) == 1
    clock.t += pd.WARN_INTERVAL_S
    with caplog.at_level(logging.WARNING, logger="kvconnect"):
        server.num_new_matched_tokens(view("r3"), 0, params)
        clock.t += 3
        server.num_new_matched_tokens(view("r3"), 0, params)
    assert "1 more since the last such message" in caplog.records[-1].getMessage()


def test_a_zero_timeout_never_waits():
    server, _, hits, _ = make("kv_consumer", timeout_s=0.0)
    hits.restorable = 192
    assert server.num_new_matched_tokens(view(), 0, stored().to_params()) == (192, True)


@pytest.mark.parametrize("bad", [
    {"do_remote_prefill": True, "kvconnect": {"v": 9}},
    stored(tp_size=2).to_params(),  # a TP size the workers say they cannot read
    stored(chunk_tokens=128).to_params(),
    stored(prompt_digest="0" * 32).to_params(),
])
def test_unusable_params_are_a_plain_lookup_never_a_wait(bad, caplog):
    server, _, hits, _ = make("kv_consumer")
    hits.restorable = 256
    with caplog.at_level(logging.WARNING, logger="kvconnect"):
        assert server.num_new_matched_tokens(view(), 0, bad) == (256, True)
    assert server.counters["remote_prefill_rejected"] == 1 and server.num_waiting == 0
    assert hits.calls == [(300, True)]
    assert "plain lookup instead" in caplog.records[-1].getMessage()


def test_without_params_the_consumer_is_a_plain_lookup():
    server, _, hits, _ = make("kv_consumer")
    hits.restorable = 64
    assert server.num_new_matched_tokens(view(), 0, None) == (64, True)
    hits.restorable = 32  # under min_load_tokens: not worth a step without P/D
    assert server.num_new_matched_tokens(view("r2"), 0, None) == (0, False)
    assert server.counters["remote_prefills"] == 0


def test_a_short_remote_prefill_is_loaded_whatever_min_load_tokens():
    server, sched, hits, _ = make("kv_consumer")
    short = PROMPT[:50]
    params = stored(tokens=32, prompt_digest=tp.prompt_digest(short)).to_params()
    hits.restorable = 32
    assert server.num_new_matched_tokens(view(prompt=short), 0, params) == (32, True)


def test_a_request_aborted_while_waiting_is_forgotten():
    server, _, _, _ = make("kv_consumer")
    assert server.num_new_matched_tokens(view(), 0, stored().to_params()) == (None, False)
    assert server.num_waiting == 1
    assert server.request_finished(view(), stored().to_params()) is None
    assert server.num_waiting == 0


def test_a_consumer_keeping_decode_tokens_stores_only_what_decoding_completes():
    config = Config(server_url="ipc:///tmp/kvc-unit.sock", save_decode_cache=True)
    server, sched, hits, _ = make("kv_consumer", config=config)
    req = view(num_tokens=300)
    hits.restorable = 288
    assert server.num_new_matched_tokens(req, 0, stored().to_params()) == (288, True)
    sched.after_alloc(req, ((1,) * 12,), 0, 288)
    tokens = np.arange(400, dtype=np.int64)
    blocks = lambda r: ((1,) * 12,)  # noqa: E731
    assert sched.build_plan({"r": 12}, lambda r: 288, blocks, lambda r: tokens).saves == ()  # the prompt: the producer's
    assert sched.build_plan({"r": 1}, lambda r: 318, blocks, lambda r: tokens).saves == ()
    (save,) = sched.build_plan({"r": 1}, lambda r: 319, blocks, lambda r: tokens).saves  # token 320 completes chunk 5
    assert (len(save.tokens), save.stored_tokens) == (320, 256)


def test_kv_both_acts_as_producer_for_a_remote_decode_and_as_consumer_for_its_params():
    server, sched, hits, _ = make("kv_both")
    req = view()
    hits.restorable = 0
    assert server.num_new_matched_tokens(req, 0, PREFILL) == (0, False)  # a plain lookup: a miss
    sched.after_alloc(req, (), 0, 0)
    (save,) = sched.build_plan({"r": 300}, lambda r: 0, lambda r: ((1,) * 10,)).saves
    assert len(save.tokens) == 288
    assert server.request_finished(req, PREFILL)["kvconnect"]["tokens"] == 288
    hits.restorable = 288
    assert server.num_new_matched_tokens(view("d"), 0, stored().to_params()) == (288, True)


def test_engine_block_tokens_from_vllms_groups():
    class Spec:
        def __init__(self, n):
            self.block_size = n

    class Group:
        def __init__(self, n):
            self.kv_cache_spec = Spec(n)

    class KVConfig:
        kv_cache_groups = [Group(32), Group(64)]

    class Cache:
        block_size = 16

    class VllmConfig:
        cache_config = Cache()

    assert pd.engine_block_tokens(VllmConfig(), KVConfig()) == 64
    assert pd.engine_block_tokens(VllmConfig(), None) == 16


# --- params a decode server must not wait on (issue 26, item 5) ------------------------------------
def test_params_of_a_producer_serving_another_model_are_rejected_at_once(caplog):
    """Chunk keys fold in the model: a producer serving another model stored chunks this server
    can never find. Its params are a plain lookup at once, never a wait of pd_wait_timeout_s."""
    server, _, hits, clock = make("kv_consumer", timeout_s=5.0)
    hits.restorable = 0
    with caplog.at_level(logging.WARNING, logger="kvconnect"):
        assert server.num_new_matched_tokens(view(), 0, stored(model="other-model").to_params()) == (0, False)
    assert server.counters["remote_prefill_rejected"] == 1 and server.num_waiting == 0
    assert hits.calls == [(len(PROMPT), True)]  # one plain lookup
    assert "serves model 'other-model'" in caplog.records[-1].getMessage()


def test_params_naming_a_prompt_never_stored_cost_a_bounded_number_of_probes():
    """Anyone can compute a prompt's digest: params naming a prompt no producer stored must not
    buy a tier lookup every few scheduler steps for the whole wait."""
    server, _, hits, clock = make("kv_consumer", timeout_s=5.0, poll_s=0.005)
    req, params = view(), stored().to_params()
    steps = 0
    while True:
        got = server.num_new_matched_tokens(req, 0, params)
        steps += 1
        if got != (None, False):
            break
        clock.t += 0.001
    assert got == (0, False) and server.counters["remote_prefill_timeouts"] == 1
    assert steps >= 5000
    assert len(hits.calls) <= 34, len(hits.calls)  # ~32 probes and the final lookup for a 5 s wait (it was ~100)


# --- P/D across resets (issue 26, item 6) ------------------------------------------------------
GEN_A, GEN_B = b"\xaa" * 16, b"\xbb" * 16


def test_params_carry_the_producers_generation_as_hex():
    params = stored(generation=GEN_A).to_params()
    assert params["kvconnect"]["generation"] == "aa" * 16
    assert tp.remote_prefill(params).generation == GEN_A
    assert stored().to_params()["kvconnect"]["generation"] == ""  # a producer never reset: no generation
    legacy = stored().to_params()
    del legacy["kvconnect"]["generation"]  # a producer from before the field: the empty generation
    assert tp.remote_prefill(legacy).generation == b""


@pytest.mark.parametrize("bad", [None, 7, True, b"\xaa" * 16, ["aa"], {"g": 1}, "aa" * 15, "aa" * 17, "AA" * 16,
                                 "zz" * 16, " " + "a" * 31, "a" * 10_000])
def test_a_malformed_generation_is_a_typed_error_never_a_wait(bad, caplog):
    params = stored().to_params()
    params["kvconnect"]["generation"] = bad
    with pytest.raises(tp.TransferParamsError, match="'generation'") as err:
        tp.remote_prefill(params)
    assert len(str(err.value)) < 300  # a huge value is not echoed back into the logs
    server, _, hits, _ = make("kv_consumer")
    hits.restorable = 256
    with caplog.at_level(logging.WARNING, logger="kvconnect"):
        assert server.num_new_matched_tokens(view(), 0, params) == (256, True)  # a plain lookup, at once
    assert server.counters["remote_prefill_rejected"] == 1 and server.num_waiting == 0
    assert hits.calls == [(300, True)] and hits.asked_generations == [b""]  # under this server's own generation


def _prefill(server, sched, req_id="r"):
    req = view(req_id)
    server.num_new_matched_tokens(req, 0, PREFILL)
    sched.after_alloc(req, (), 0, 0)
    return req


def test_a_producer_reset_moves_its_saves_and_params_to_one_new_generation():
    server, sched, hits, _ = make("kv_producer")
    start = sched.generation
    assert len(start) == 16  # a producer starts with a fresh generation: a restart never names a retired one
    before = _prefill(server, sched, "old")  # admitted before the reset
    assert sched.reset_cache()
    (new_gen,) = hits.cleared_to
    assert len(new_gen) == 16 and sched.generation == new_gen  # the scheduler chose it and named it to every worker
    assert hits.retired_to == [start]  # and had the workers leave the old one's marker in the tier
    after = _prefill(server, sched, "new")
    plan = sched.build_plan({"old": 300, "new": 300}, lambda r: 0, lambda r: ((1,) * 10,))
    assert {s.req_id: s.generation for s in plan.saves} == {"old": start, "new": new_gen}
    # each prefill's params name the generation its chunks were stored under
    assert tp.remote_prefill(server.request_finished(before, PREFILL)).generation == start
    assert tp.remote_prefill(server.request_finished(after, PREFILL)).generation == new_gen
    assert sched.reset_cache() and hits.cleared_to[1] not in (start, new_gen)  # every reset a fresh one
    assert make("kv_producer")[1].generation not in (b"", start)  # another start, another generation
    # a consumer's reset retires nothing: no producer's params name its generation
    _, consumer, consumer_hits, _ = make("kv_consumer")
    assert consumer.generation == b"" and consumer.reset_cache() and consumer_hits.retired_to == [None]


def test_a_consumer_loads_under_the_producers_generation_whatever_its_own():
    server, sched, hits, clock = make("kv_consumer")
    assert sched.reset_cache()  # the consumer's own generation moves
    own = sched.generation
    hits.generation, hits.restorable = GEN_A, 288  # the producer stored under its generation A
    req = view()
    assert server.num_new_matched_tokens(req, 0, stored(generation=GEN_A).to_params()) == (288, True)
    assert server.counters["remote_prefill_ready"] == 1 and server.counters["remote_prefill_timeouts"] == 0
    assert set(hits.asked_generations) == {GEN_A}  # probe and lookup: the producer's generation
    sched.after_alloc(req, ((1,) * 10,), 0, 288)
    (load,) = sched.build_plan({"r": 12}, lambda r: 288, lambda r: ((1,) * 10,)).loads
    assert load.generation == GEN_A
    # a plain request on the consumer looks under its own generation (the producer's chunks are not its own)
    assert server.num_new_matched_tokens(view("plain"), 0, None) == (0, False)
    assert hits.asked_generations[-1] == own


def test_params_of_a_prefill_from_before_the_producers_reset_find_its_chunks_or_miss_cleanly():
    """Old params name the old generation: its chunks load while the tier holds them; once gone,
    the decode waits the bounded timeout and loads nothing (vLLM recomputes), never other chunks."""
    server, sched, hits, clock = make("kv_consumer", timeout_s=2.0)
    hits.generation, hits.restorable = GEN_B, 288  # the tier holds the new generation's chunks only
    old = stored(generation=GEN_A).to_params()
    assert server.num_new_matched_tokens(view(), 0, old) == (None, False)
    clock.t += 2.0
    assert server.num_new_matched_tokens(view(), 0, old) == (0, False)
    assert server.counters["remote_prefill_timeouts"] == 1
    assert set(hits.asked_generations) == {GEN_A} and len(hits.calls) <= 10
    hits.generation = GEN_A  # the old generation's chunks are still there
    assert server.num_new_matched_tokens(view("r2"), 0, old) == (288, True)


def test_once_the_pair_moved_on_an_old_generation_no_longer_loads():
    """Params are the client's: replaying a prefill's params from before a reset must not load
    the pre-reset KV for ever. While only one side has reset, old params still load (prefills
    in flight); once this server reset and the producer named a new generation, they do not."""
    server, sched, hits, clock = make("kv_consumer")
    old = stored(generation=GEN_A).to_params()
    hits.generation, hits.restorable = GEN_A, 288
    assert server.num_new_matched_tokens(view("a1"), 0, old) == (288, True)
    assert sched.reset_cache()  # this server resets (the weights changed)
    own = sched.generation
    assert server.num_new_matched_tokens(view("a2"), 0, old) == (288, True)  # the producer has not moved yet
    hits.generation = GEN_B  # the producer reset: its new prefills are stored under B
    assert server.num_new_matched_tokens(view("b1"), 0, stored(generation=GEN_B).to_params()) == (288, True)
    hits.generation = GEN_A  # A's chunks are still in the tier, and a client replays A's params
    rejected = server.counters["remote_prefill_rejected"]
    assert server.num_new_matched_tokens(view("a3"), 0, old) == (0, False)  # a plain lookup: nothing of A loads
    assert server.counters["remote_prefill_rejected"] == rejected + 1
    assert hits.asked_generations[-1] == own and server.num_waiting == 0
    # params naming a generation no producer stored under cannot retire a real one
    hits.generation = GEN_B
    forged = stored(generation=b"\x07" * 16).to_params()
    assert server.num_new_matched_tokens(view("f"), 0, forged) == (None, False)
    clock.t += 10
    assert server.num_new_matched_tokens(view("f"), 0, forged) == (0, False)
    assert server.num_new_matched_tokens(view("b2"), 0, stored(generation=GEN_B).to_params()) == (288, True)


def test_replayed_params_from_before_a_producer_reset_load_nothing():
    """Issue 39 item 1: the producer's reset left generation A's marker in the tier. A decode
    server that reset too but has loaded nothing of the new generation yet, and one started
    after the reset (no memory of A at all), both refuse params naming A: they load 0, with A's
    chunks still in the tier. Params of the new generation load as before."""
    server, sched, hits, clock = make("kv_consumer")
    old = stored(generation=GEN_A).to_params()
    hits.generation, hits.restorable = GEN_A, 288
    assert server.num_new_matched_tokens(view("a1"), 0, old) == (288, True)  # before the reset
    hits.markers.add(GEN_A)  # the producer reset (scheduler.reset_cache: clear(new, retire=A))
    assert sched.reset_cache()  # this server too (the weights changed)
    own = sched.generation
    rejected = server.counters["remote_prefill_rejected"]
    assert server.num_new_matched_tokens(view("a2"), 0, old) == (0, False)  # a plain lookup under its own: nothing
    assert server.counters["remote_prefill_rejected"] == rejected + 1 and server.num_waiting == 0
    assert hits.asked_generations[-1] == own
    restarted, _, hits2, _ = make("kv_consumer")  # a decode server started after the reset: it saw nothing of A
    hits2.generation, hits2.restorable, hits2.markers = GEN_A, 288, {GEN_A}
    assert restarted.num_new_matched_tokens(view("a3"), 0, old) == (0, False)
    assert restarted.counters["remote_prefill_rejected"] == 1 and GEN_A not in hits2.asked_generations
    hits2.generation = GEN_B  # the producer's new generation is not retired: it loads
    assert restarted.num_new_matched_tokens(view("b1"), 0, stored(generation=GEN_B).to_params()) == (288, True)


def test_a_long_forged_prompt_costs_a_bounded_number_of_probed_tokens():
    """Issue 39 item 3: params naming a 262k-token prompt nobody stored looked up the whole prompt
    ~30 times over a 5 s wait (1.4 s of CPU); the tokens one request's probes look up are now at
    most PROBE_TOKENS_PER_REQUEST beyond its first probe and its final lookup."""
    prompt = np.arange(1 << 18, dtype=np.int64) % 1000
    server, _, hits, clock = make("kv_consumer", timeout_s=5.0, poll_s=0.005)
    req = view(prompt=prompt)
    params = stored(tokens=len(prompt) // BLOCK * BLOCK, prompt_digest=tp.prompt_digest(prompt)).to_params()
    while (got := server.num_new_matched_tokens(req, 0, params)) == (None, False):
        clock.t += 0.001
    assert got == (0, False) and server.counters["remote_prefill_timeouts"] == 1
    probed = sum(n for n, _ in hits.calls)
    needed = len(prompt) // BLOCK * BLOCK
    assert probed <= pd.PROBE_TOKENS_PER_REQUEST + 2 * needed, (probed, len(hits.calls))
    assert 2 <= len(hits.calls) <= 7, len(hits.calls)  # was ~32
