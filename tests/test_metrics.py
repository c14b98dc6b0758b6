"""kvconnect.metrics: figure values after a scripted sequence, the Prometheus text, vLLM's
payload arithmetic and SGLang's storage-metrics shape."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from support import zoo
from kvconnect import KVCacheEngine
from kvconnect.metrics.catalogue import Figures, LATENCY_BUCKETS_S
from kvconnect.metrics.figures import engine_figures, storage_figures
from kvconnect.metrics.prometheus import collector, prometheus_text, register_engine, start_exporter
from kvconnect.metrics.recorders import LatencyHistogram, OpLog
from kvconnect.metrics.sglang import sglang_storage_metrics
from kvconnect.metrics.vllm import merge_payloads, payload_figures, PayloadDeltas, vllm_payload
from kvconnect.chunks import chunk_format as cf
from kvconnect.restore.plan import max_chunk_payload_bytes

prometheus_client = pytest.importorskip("prometheus_client")

CHUNK = 64


def _scrape_value(text: str, name: str, **labels: str) -> float:
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            got = set(head[head.find("{") + 1 : -1].split(",")) if "{" in head else set()
            if want <= got:
                return float(value)
    raise AssertionError(f"{name} {labels} not in the scrape")


def test_scripted_sequence(tmp_path, rng):
    """store / lookup / retrieve / eviction / corrupt chunk / remote tier down, figure by figure."""
    case = zoo.build("llama-flash")
    layout = case.layout()
    chunk_bytes = max_chunk_payload_bytes(layout, CHUNK)
    config = zoo.small_config(
        CHUNK, max_local_cpu_size=4 * chunk_bytes / (1 << 30), local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01,
        remote_url="redis://127.0.0.1:1", remote_timeout_s=0.2,
        eviction="lru",  # the script below evicts prompt 0 first: LRU order, not S3-FIFO's (which keeps a reused chunk)
    )
    engine = KVCacheEngine(layout, config)
    try:
        prompts = [zoo.random_tokens(rng, 2 * CHUNK) for _ in range(4)]
        tables = zoo.random_tables(case, 2 * CHUNK, rng)
        assert engine.store(prompts[0], tables) == 2 * CHUNK
        assert engine.lookup(prompts[0]) == 2 * CHUNK
        assert engine.retrieve(prompts[0], zoo.random_tables(case, 2 * CHUNK, rng)) == 2 * CHUNK
        f = engine_figures(engine)
        assert f.get("kvconnect_stored_chunks_total") == 2
        assert f.get("kvconnect_stored_bytes_total") == 2 * chunk_bytes
        assert (f.get("kvconnect_lookups_total"), f.get("kvconnect_lookup_requested_tokens_total"),
                f.get("kvconnect_lookup_hit_tokens_total")) == (1, 2 * CHUNK, 2 * CHUNK)
        assert f.get("kvconnect_retrieved_chunks_total") == 2
        assert f.get("kvconnect_retrieved_bytes_total") == 2 * chunk_bytes
        assert f.get("kvconnect_retrieved_tokens_total") == 2 * CHUNK
        assert f.get("kvconnect_pool_used_bytes") == 2 * chunk_bytes
        assert f.get("kvconnect_pool_capacity_bytes") == 4 * chunk_bytes
        assert f.get("kvconnect_pool_evictions_total") == 0
        assert sum(f.get("kvconnect_store_seconds")[0]) == 1 and sum(f.get("kvconnect_retrieve_seconds")[0]) == 1

        # three more prompts into a 4-slot pool: 4 evictions; the disk tier keeps them all
        assert engine.storage.flush(10.0)
        for p in prompts[1:]:
            engine.store(p, zoo.random_tables(case, 2 * CHUNK, rng))
            assert engine.storage.flush(10.0)  # each prompt reaches the disk before the next evicts it
        f = engine_figures(engine)
        assert f.get("kvconnect_pool_evictions_total") == 4
        assert f.get("kvconnect_pool_used_bytes") == 4 * chunk_bytes
        assert f.get("kvconnect_tier_used_bytes", "disk") > 8 * chunk_bytes
        assert f.get("kvconnect_write_queue_dropped_total", "disk", "evicted_before_write") == 0
        assert f.get("kvconnect_write_queue_depth", "disk") == 0
        # the remote store is down: its writes failed, its breaker is open
        assert f.get("kvconnect_tier_errors_total", "remote") >= 1
        assert f.get("kvconnect_remote_breaker_open", "remote") == 1
        assert f.get("kvconnect_remote_breaker_open", "disk") == 0

        # prompt 0 was evicted: served by the disk tier
        hits_before = f.get("kvconnect_tier_hits_total", "disk")
        assert engine.lookup(prompts[0]) == 2 * CHUNK
        f = engine_figures(engine)
        assert f.get("kvconnect_tier_hits_total", "disk") == hits_before + 2
        assert f.get("kvconnect_tier_misses_total", "cpu") >= 2
        assert sum(f.get("kvconnect_tier_seconds", "disk", "masks")[0]) >= 1

        # a chunk whose rows do not add up to its payload: a miss, counted, dropped
        src = KVCacheEngine(case.layout(), zoo.small_config(CHUNK))
        try:
            bad = zoo.random_tokens(rng, CHUNK)
            src.store(bad, zoo.random_tables(case, CHUNK, rng))
            (c,) = src.chunks(bad, include_partial=False)
            header, payload = cf.decode(src.storage.export_chunk(c.key), fingerprint=layout.fingerprint, key=c.key)
            row = layout.planes[0].row_bytes
            forged = dataclasses.replace(header, plane_rows=header.plane_rows[:1], payload_bytes=CHUNK * row)
            assert engine.storage.import_chunk(cf.encode(forged, bytes(payload)[: CHUNK * row]), c.key)
        finally:
            src.close()
        assert engine.retrieve(bad, zoo.random_tables(case, CHUNK, rng)) == 0
        f = engine_figures(engine)
        assert f.get("kvconnect_corrupt_chunks_dropped_total") == 1

        # the same figures in the Prometheus text, under this engine's instance label
        text = prometheus_text()
        inst = engine.metrics_instance
        assert _scrape_value(text, "kvconnect_stored_chunks_total", instance=inst) == 4 * 2
        assert _scrape_value(text, "kvconnect_pool_evictions_total", instance=inst) >= 4
        assert _scrape_value(text, "kvconnect_corrupt_chunks_dropped_total", instance=inst) == 1
        assert _scrape_value(text, "kvconnect_remote_breaker_open", instance=inst, tier="remote") == 1
        assert _scrape_value(text, "kvconnect_retrieve_seconds_count", instance=inst) == 1
    finally:
        engine.close()
    assert inst not in collector().instances()


def test_several_engines_one_process_one_registration():
    """Engines share the one collector: distinct instance labels, no duplicate registration."""
    case = zoo.build("llama-flash")
    registry = prometheus_client.CollectorRegistry()
    engines = [KVCacheEngine(case.layout(), zoo.small_config(CHUNK)) for _ in range(3)]
    try:
        names = [register_engine(e, registry=registry) for e in engines]
        names.append(register_engine(engines[0], "prefill", registry=registry))
        names.append(register_engine(engines[1], "prefill", registry=registry))
        assert len(set(names)) == 5 and "prefill" in names
        text = prometheus_text(registry)
        assert text.count("kvconnect_lookups_total{") == 5
        assert text.count("# TYPE kvconnect_lookups_total counter") == 1
    finally:
        for e in engines:
            e.close()


def test_vllm_payload_cumulative_per_rank():
    """Workers' and intervals' payloads merge by rank; the hook adds only what grew."""
    def figs(lookups, depth, counts):
        f = Figures()
        f.set("kvconnect_lookups_total", lookups)
        f.set("kvconnect_write_queue_depth", depth, "disk")
        f.set("kvconnect_store_seconds", (tuple(counts), 0.1))
        return f

    n = len(LATENCY_BUCKETS_S) + 1
    one = [1] + [0] * (n - 1)
    deltas = PayloadDeltas()
    p = merge_payloads(vllm_payload("0", figs(3, 2, one)), vllm_payload("1", figs(4, 1, one)))
    incs, gauges, hists = deltas.update(p)
    assert incs[("kvconnect_lookups_total", ())] == 7
    assert gauges[("kvconnect_write_queue_depth", ("disk",))] == 3
    assert hists[("kvconnect_store_seconds", ())][0] == 2
    # an interval where rank 0 reported twice (merged: latest wins) and rank 1 not at all
    p = merge_payloads(vllm_payload("0", figs(5, 0, one)), vllm_payload("0", figs(6, 0, [2] + [0] * (n - 1))))
    incs, gauges, hists = deltas.update(p)
    assert incs == {("kvconnect_lookups_total", ()): 3}
    assert hists[("kvconnect_store_seconds", ())][0] == 1
    # rank 1 restarted: its counter starts over
    incs, _, _ = deltas.update(vllm_payload("1", figs(2, 0, one)))
    assert incs[("kvconnect_lookups_total", ())] == 2
    assert payload_figures(p).get("kvconnect_lookups_total") == 6


def test_sglang_storage_metrics_shape():
    ops = OpLog()
    ops.retrieved(4, 4_000_000, 0.002)
    ops.stored(2, 1_000_000, 0.001)
    ops.stored(0, 0, 0.001)  # nothing written: not an operation SGLang counts
    m = sglang_storage_metrics(ops, pages_per_chunk=4)
    fields = {f.name for f in dataclasses.fields(m)}
    assert {"prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"} <= fields
    assert m.prefetch_pgs == [16] and m.backup_pgs == [8]
    assert m.prefetch_bandwidth == pytest.approx([2.0]) and m.backup_bandwidth == pytest.approx([1.0])
    again = sglang_storage_metrics(ops)  # drained, as SGLang's backends do
    assert again.prefetch_pgs == [] and again.backup_pgs == []


def test_exporter_is_opt_in_and_loopback(monkeypatch):
    from kvconnect.config import Config

    assert start_exporter(Config()) is None
    assert Config().metrics_host == "127.0.0.1"
    assert Config.from_env({"KVCONNECT_METRICS_PORT": "9464"}).metrics_port == 9464
    with pytest.raises(Exception):
        Config.from_env({"KVCONNECT_METRICS_PORT": "70000"})


def test_histogram_buckets():
    h = LatencyHistogram()
    for s in (0.00005, 0.003, 100.0):
        h.observe(s)
    counts, total = h.snapshot()
    assert counts[0] == 1 and counts[-1] == 1 and sum(counts) == 3 and total == pytest.approx(100.00305)
    assert np.argmax(counts[1:-1]) + 1 == LATENCY_BUCKETS_S.index(0.005)


def test_a_raising_tier_is_counted_as_its_error():
    from kvconnect.layout.spec import ChunkKey, Fingerprint
    from kvconnect.storage import ChunkPool, StorageManager
    from kvconnect.storage.tier import LowerTier

    class Broken(LowerTier):
        name = "broken"

        def masks(self, keys):
            raise RuntimeError("a bug in the tier")

        def get(self, keys):
            raise RuntimeError("a bug in the tier")

        def put(self, items):
            return [False] * len(items)

        def delete(self, keys):
            return [False] * len(keys)

    fp = Fingerprint(bytes(16))
    manager = StorageManager(ChunkPool(1 << 16, 1024), fp, [Broken(fp)])
    try:
        assert manager.masks([ChunkKey(bytes(16)), ChunkKey(bytes(range(16)))]) == [None, None]
        f = storage_figures(manager)
        assert f.get("kvconnect_tier_errors_total", "broken") == 1
        assert f.get("kvconnect_tier_misses_total", "cpu") == 2
        assert f.get("kvconnect_tier_hits_total", "broken") == 0  # it never answered
    finally:
        manager.close()


def test_lookup_channel_figures(tmp_path):
    """The scheduler's lookup figures: requested and hit tokens (minimum over workers), timeouts."""
    import time as _time

    from kvconnect.integrations.vllm.lookup_channel import LookupClient, LookupServer, rank_address

    class Hits:
        def __init__(self, hit, delay_s=0.0):
            self.hit, self.delay_s = hit, delay_s

        def lookup(self, tokens, namespace=b"", generation=None, media=()):
            _time.sleep(self.delay_s)
            return self.hit

        def stats(self):
            return {}

        def clear(self, generation=None, retire=None):
            pass

    base = f"ipc://{tmp_path}/kvc"
    handlers = [Hits(256), Hits(128)]
    servers = [LookupServer(rank_address(base, i), h) for i, h in enumerate(handlers)]
    client = LookupClient([rank_address(base, i) for i in range(2)], timeout_s=0.3)
    try:
        assert client.lookup(np.arange(300)) == 128
        handlers[1].delay_s = 0.6
        assert client.lookup(np.arange(400)) == 0  # a silent worker: a miss, counted
        assert (client.num_lookups, client.requested_tokens, client.hit_tokens, client.num_timeouts) == (2, 700, 128, 1)
    finally:
        client.close()
        for s in servers:
            s.close()
