"""Prefill/decode disaggregation of a sliding-window hybrid through vLLM's P/D router, on Redis.

A tiny random Gemma 3 (one sliding-window layer of 64 tokens, one full layer: two KV-cache
groups under vLLM's hybrid allocator), a ``kv_producer`` and a ``kv_consumer`` ``vllm serve``
sharing a real ``redis-server`` on loopback (``remote_url``: the tier is written behind the
producer's stores and read by the consumer's loads), ``vllm-router --vllm-pd-disaggregation``
in front. The decode side must report a hit only where both groups restore (kvconnect's
restore gate) and its outputs must equal one plain ``vllm serve``'s.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest

import pd_cluster as pc
from support.redis_server import RedisNode, redis_available  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
    pytest.mark.skipif(not pc.router_available(), reason="vllm-router is not installed (.ci/install_vllm_router.sh)"),
    pytest.mark.skipif(redis_available() is not None, reason=str(redis_available())),
]

CHUNK, BLOCK, WINDOW = 64, 32, 64


SEQUENTIAL = pc.prompts(11, (300, 520, 610, 777))
CONCURRENT = pc.prompts(12, (510, 450, 680, 390))


@pytest.fixture(scope="module")
def pd_gemma(tmp_path_factory):
    from support import tiny_models

    work = tmp_path_factory.mktemp("pd_gemma")
    model = tiny_models.make_gemma3(str(work / "gemma3"), sliding_window=WINDOW)
    redis = RedisNode(work / "redis").start()
    cluster = pc.PDCluster(model, work, chunk_tokens=CHUNK, block_size=BLOCK, tier="redis", redis_url=redis.url)
    plain = pc.PlainServer(model, work, block_size=BLOCK)
    try:
        try:
            cluster.start(plain)
            cluster.reference = {tuple(p): pc.completion(plain.url, model, p) for p in SEQUENTIAL + CONCURRENT}
        finally:
            plain.stop()
        cluster.model = model
        yield cluster
    except Exception:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()
        redis.stop()


def figures(cluster: pc.PDCluster, role: str) -> dict[str, float]:
    text = cluster.metrics(role)
    return {name: pc.metric(text, "vllm:" + name) for name in (
        "kvconnect_retrieved_tokens_total", "kvconnect_stored_chunks_total", "kvconnect_lookups_total",
        "kvconnect_pd_remote_prefill_ready_total", "kvconnect_pd_remote_prefill_timeouts_total",
        "kvconnect_pd_remote_decode_prefills_total", "kvconnect_load_failures_total", "kvconnect_tier_errors_total",
        "kvconnect_write_queue_dropped_total", "prompt_tokens_total")}


def test_hybrid_sequential_and_concurrent_equal_one_plain_server(pd_gemma):
    c = pd_gemma
    for p in SEQUENTIAL:
        assert pc.completion(c.router_url, c.model, p) == c.reference[tuple(p)], len(p)
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = pc.completion(c.router_url, c.model, CONCURRENT[i])
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, p in enumerate(CONCURRENT):
        assert results[i] == c.reference[tuple(p)], (i, results[i])

    everything = SEQUENTIAL + CONCURRENT
    loadable = sum(len(p) // BLOCK * BLOCK for p in everything)
    deadline, d = time.monotonic() + 30, figures(c, "consumer")
    while d["kvconnect_retrieved_tokens_total"] < loadable and time.monotonic() < deadline:
        time.sleep(0.5)
        d = figures(c, "consumer")
    p = figures(c, "producer")
    assert d["prompt_tokens_total"] == sum(len(x) for x in everything)
    # both groups restored up to each prompt's last block edge (Redis reads can time out on a loaded
    # 2-core machine: then that request recomputes, which the 90% bound of the issue allows)
    assert loadable >= d["kvconnect_retrieved_tokens_total"] >= 0.9 * d["prompt_tokens_total"], (d, p, c.logs())
    assert d["kvconnect_pd_remote_prefill_ready_total"] == len(everything) and d["kvconnect_pd_remote_prefill_timeouts_total"] == 0
    assert d["kvconnect_load_failures_total"] == 0, (d, p)
    assert d["kvconnect_stored_chunks_total"] == 0  # the consumer stores nothing
    assert p["kvconnect_retrieved_tokens_total"] == 0 and p["kvconnect_lookups_total"] == 0  # the producer loads nothing
    assert p["kvconnect_pd_remote_decode_prefills_total"] == len(everything)
