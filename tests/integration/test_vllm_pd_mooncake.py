"""Prefill/decode disaggregation through vLLM's P/D router, on Mooncake Store, with a TP 1
producer and a TP 2 decode side (issue 40 item 3).

A real ``mooncake_master`` on loopback, the node's segment held by ``kvconnect server
--mooncake-segment-gb`` (as docs/storage.md recommends: the engines contribute nothing, so
an engine restart loses no cached chunk), a ``kv_producer`` and a ``kv_consumer`` ``vllm
serve`` with ``remote_url = mooncakestore://127.0.0.1:PORT`` and ``vllm-router
--vllm-pd-disaggregation`` in front. The producer writes every chunk behind its prefill
into the holder's segment (Mooncake's transfer engine, TCP); the consumer waits for the
chunks its params name; each of its two ranks cuts its one KV head out of the producer's
objects (kvconnect/restore/other_tp_reads.py) into its pool, and only once every head range
it needs is there does it report the chunk (the restore gate).

The model is a tiny random one-layer GQA Llama (two KV heads): with one decoder layer its KV
does not depend on the TP size (K and V are a column-parallel projection of the embeddings),
so the decode side's outputs and logprobs must be its own cold run's at TP 2, taken before
any P/D request (nothing stored yet, its prefix cache reset after), as
``support.resumed_logprobs`` judges a resumed request. vLLM's own figures (external prefix
cache hits) must show the prompts came from the tier. Equal-TP P/D is in test_vllm_pd.py
(node server) and test_vllm_pd_hybrid.py (a sliding-window hybrid, Redis).
"""

from __future__ import annotations

import importlib.util
import re
import threading
import time
import warnings

import pytest

import pd_cluster as pc
from support.mooncake_master import mooncake_available  # noqa: E402
from support.resumed_logprobs import assert_resumed_logprobs

_VLLM = importlib.util.find_spec("vllm") is not None
_MOONCAKE = mooncake_available() if _VLLM else "vllm is not installed"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not _VLLM, reason="vllm is not installed (.ci/install_vllm.sh)"),
    pytest.mark.skipif(not pc.router_available(), reason="vllm-router is not installed (.ci/install_vllm_router.sh)"),
    pytest.mark.skipif(_MOONCAKE is not None, reason=str(_MOONCAKE)),
]

CHUNK, BLOCK = 64, 32


SEQUENTIAL = pc.prompts(21, (300, 520, 610, 777))
CONCURRENT = pc.prompts(22, (510, 450, 680, 390))


@pytest.fixture(scope="module")
def pd_mooncake(tmp_path_factory):
    from support import tiny_models

    work = tmp_path_factory.mktemp("pd_mooncake")
    model = tiny_models.make_llama(str(work / "llama1"), num_layers=1)
    cluster = pc.PDCluster(model, work, chunk_tokens=CHUNK, block_size=BLOCK, tier="mooncake", mooncake_segment_gb=0.25,
                           producer_cores="0", consumer_cores="0|1", consumer_tp=2,
                           # three engine processes on 2 cores: a slow write-behind put is waited for, not recomputed
                           wait_timeout_s=15.0)
    try:
        cluster.start()
        cluster.model = model
        # the reference: the TP 2 decode server's own cold runs (no params: a plain lookup, a miss)
        cluster.reference = {tuple(p): pc.top_logprobs(cluster.consumer_url, model, p) for p in SEQUENTIAL + CONCURRENT}
        cold = figures(cluster, "consumer")
        assert cold["kvconnect_retrieved_tokens_total"] == 0 and cold["external_prefix_cache_hits_total"] == 0, cold
        assert cluster.reset("consumer")  # vLLM's own prefix cache now holds none of them
        yield cluster
    except Exception:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


def assert_as_cold(got, want, what) -> None:
    assert got[0] == want[0], what
    assert_resumed_logprobs(got[1], want[1], what)


def figures(cluster: pc.PDCluster, role: str) -> dict[str, float]:
    text = cluster.metrics(role)
    return {name: pc.metric(text, "vllm:" + name) for name in (
        "kvconnect_retrieved_tokens_total", "kvconnect_stored_chunks_total", "kvconnect_lookups_total",
        "kvconnect_pd_remote_prefill_ready_total", "kvconnect_pd_remote_prefill_timeouts_total",
        "kvconnect_pd_remote_prefill_other_tp_total", "kvconnect_pd_remote_prefill_rejected_total",
        "kvconnect_pd_remote_decode_prefills_total", "kvconnect_load_failures_total", "kvconnect_tier_errors_total",
        "kvconnect_write_queue_dropped_total", "prompt_tokens_total", "request_success_total",
        "external_prefix_cache_hits_total")}


def mooncake_series(cluster: pc.PDCluster, role: str, name: str) -> float:
    """Sum of ``vllm:<name>`` over the samples labelled ``tier="mooncake"``."""
    text = cluster.metrics(role)
    pattern = rf'^vllm:{re.escape(name)}{{[^}}]*tier="mooncake"[^}}]*}} ([0-9.e+-]+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def test_pd_from_tp1_to_tp2_over_mooncake_equals_the_decode_servers_cold_run(pd_mooncake):
    c = pd_mooncake
    before = figures(c, "consumer")
    for p in SEQUENTIAL:
        assert_as_cold(pc.top_logprobs(c.router_url, c.model, p), c.reference[tuple(p)], len(p))
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = pc.top_logprobs(c.router_url, c.model, CONCURRENT[i])
        except Exception as exc:  # a failed request is a failed test, with its error
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, p in enumerate(CONCURRENT):
        assert not isinstance(results[i], Exception), (i, results[i])
        assert_as_cold(results[i], c.reference[tuple(p)], (i, len(p)))

    everything = SEQUENTIAL + CONCURRENT
    loadable = sum(len(p) // BLOCK * BLOCK for p in everything)
    deadline, d = time.monotonic() + 30, figures(c, "consumer")
    while d["kvconnect_retrieved_tokens_total"] - before["kvconnect_retrieved_tokens_total"] < 2 * loadable and time.monotonic() < deadline:
        time.sleep(0.5)
        d = figures(c, "consumer")
    d = {k: v - before[k] for k, v in d.items()}
    p = figures(c, "producer")
    assert d["prompt_tokens_total"] == sum(len(x) for x in everything)
    # every decode's params named the TP 1 producer, and the TP 2 ranks said they read it
    assert d["kvconnect_pd_remote_prefill_other_tp_total"] == len(everything), (d, p)
    assert d["kvconnect_pd_remote_prefill_rejected_total"] == 0, (d, p)
    assert d["kvconnect_load_failures_total"] == 0, (d, p)
    if p["kvconnect_write_queue_dropped_total"] == 0 and p["kvconnect_tier_errors_total"] == 0:
        # every producer write reached Mooncake: each TP 2 rank restored its head from the TP 1
        # objects up to each prompt's last block edge (kvconnect's figure sums the two ranks;
        # vLLM's own count of connector-provided tokens agrees), every decode ready without a timeout
        assert 2 * loadable == d["kvconnect_retrieved_tokens_total"] >= 2 * 0.9 * d["prompt_tokens_total"], (d, p, c.logs())
        assert d["external_prefix_cache_hits_total"] == loadable, (d, p)
        assert d["kvconnect_pd_remote_prefill_ready_total"] == len(everything), (d, p)
        assert d["kvconnect_pd_remote_prefill_timeouts_total"] == 0, (d, p)
        assert d["kvconnect_tier_errors_total"] == 0, (d, p)
    else:
        # Seen on this loaded 2-core machine (1 run in ~7): some of the producer's Mooncake writes
        # fail (tier errors; its breaker then drops write-behind puts). A cache may miss: those
        # decodes wait out the timeout and recompute, and the answers above are still exact.
        # Open question, in the notes; the 90% bound is held by the node-server and Redis runs.
        warnings.warn(f"producer's Mooncake writes failed: decode figures {d}, producer figures {p}")
        assert 0 < d["kvconnect_retrieved_tokens_total"] <= 2 * loadable, (d, p)
        assert d["kvconnect_pd_remote_prefill_ready_total"] + d["kvconnect_pd_remote_prefill_timeouts_total"] == len(everything), (d, p)
    assert d["kvconnect_stored_chunks_total"] == 0  # the consumer stores nothing
    assert p["kvconnect_retrieved_tokens_total"] == 0 and p["kvconnect_lookups_total"] == 0  # the producer loads nothing
    assert p["kvconnect_pd_remote_decode_prefills_total"] == len(everything)
    assert d["request_success_total"] == len(everything)  # no request failed on the decode side
    # every chunk the decode side loaded was cut out of the TP 1 producer's objects, which only
    # Mooncake holds: nothing is ever stored under a TP 2 rank's own names (its own Mooncake
    # lookups find nothing; the writer's objects are read through a follower client per writer)
    assert mooncake_series(c, "consumer", "kvconnect_tier_hits_total") == 0
    assert d["kvconnect_retrieved_tokens_total"] > 0
    assert mooncake_series(c, "consumer", "kvconnect_tier_errors_total") == 0
    assert c.mooncake_holder.proc.poll() is None and c.mooncake_master.proc.poll() is None
