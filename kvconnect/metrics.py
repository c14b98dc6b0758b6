"""Metrics: the one module that names, collects and formats kvconnect's figures.

Everything an operator watches is defined once, in ``CATALOGUE`` (Prometheus names with
units: ``_bytes``, ``_seconds``, ``_total``). Figures are *pulled*: the hot path only bumps
the counters it already keeps (EngineStats, the pool's, each tier's and writer's) plus two
cheap recorders defined here (``LatencyHistogram``, ``TierMeter``); a ``Figures`` snapshot
is built from them when someone asks, and turned into

- Prometheus samples (``KVConnectCollector``, one per registry, serving every engine of the
  process under an ``instance`` label: several engines never register twice);
- vLLM's KV-connector stats payload (``vllm_payload`` / ``merge_payloads``, cumulative per
  rank, so that vLLM's per-worker and per-interval aggregation cannot double count) and the
  increments its Prometheus hook records (``PayloadDeltas``);
- SGLang's storage-metrics shape (``sglang_storage_metrics``: pages and GB/s per operation);
- an opt-in HTTP exporter (``start_exporter``; loopback unless configured otherwise).

Histograms keep fixed buckets (``LATENCY_BUCKETS_S``); an observation costs a bisect and a
lock. See docs/operations.md for what each figure means and its healthy values.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Protocol

if TYPE_CHECKING:
    from .config import Config

# What the figures read of an engine and its storage, as protocols: this module sits below
# the engine and the storage manager (both import it) and imports neither.


class StorageLike(Protocol):
    """What ``storage_figures`` reads of a ``storage.StorageManager``."""

    pool: Any
    tiers: list
    writers: list
    corrupt_chunks: int
    meter: "TierMeter"


class EngineLike(Protocol):
    """What ``engine_figures`` reads of a ``KVCacheEngine``."""

    ops: "OpLog"
    storage: StorageLike

    def stats_snapshot(self) -> dict[str, int]: ...

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()


CATALOGUE: dict[str, Metric] = {m.name: m for m in (
    # -- engine API (per engine) ------------------------------------------------------------
    Metric("kvconnect_lookups_total", COUNTER, "prefix lookups answered"),
    Metric("kvconnect_lookup_requested_tokens_total", COUNTER, "tokens asked about by lookups"),
    Metric("kvconnect_lookup_hit_tokens_total", COUNTER, "tokens lookups found restorable from token 0"),
    Metric("kvconnect_stored_chunks_total", COUNTER, "chunks written into the CPU pool"),
    Metric("kvconnect_stored_bytes_total", COUNTER, "payload bytes written into the CPU pool"),
    Metric("kvconnect_store_skipped_chunks_total", COUNTER, "chunks not written: already stored, or no free slot"),
    Metric("kvconnect_retrieved_chunks_total", COUNTER, "chunks loaded into the engine's KV cache"),
    Metric("kvconnect_retrieved_bytes_total", COUNTER, "payload bytes loaded into the engine's KV cache"),
    Metric("kvconnect_retrieved_tokens_total", COUNTER, "tokens restored into the engine's KV cache"),
    Metric("kvconnect_corrupt_chunks_dropped_total", COUNTER, "chunks found inconsistent and dropped (a miss, never wrong bytes)"),
    Metric("kvconnect_window_parts_stored_total", COUNTER, "restore points whose window part a store wrote (kvconnect/parts.py)"),
    Metric("kvconnect_window_pieces_stored_total", COUNTER, "window-part pieces written into the CPU pool"),
    Metric("kvconnect_window_pieces_evicted_total", COUNTER, "window-part pieces evicted from the CPU pool"),
    Metric("kvconnect_restore_point_hits_total", COUNTER, "retrieves that resumed at a restore point (prefix parts + one window part)"),
    Metric("kvconnect_prefix_chunks_demoted_total", COUNTER, "prefix parts a lookup found past every usable restore point (evicted first)"),
    Metric("kvconnect_store_seconds", HISTOGRAM, "duration of one store call"),
    Metric("kvconnect_retrieve_seconds", HISTOGRAM, "duration of one retrieve call that loaded (misses are not timed)"),
    # -- CPU pool ---------------------------------------------------------------------------
    Metric("kvconnect_pool_used_bytes", GAUGE, "CPU pool bytes held by chunks (slot granularity)"),
    Metric("kvconnect_pool_capacity_bytes", GAUGE, "CPU pool size"),
    Metric("kvconnect_pool_evictions_total", COUNTER, "chunks evicted from the CPU pool to make room"),
    Metric("kvconnect_pool_reserve_shortfalls_total", COUNTER, "writes that found every slot pinned"),
    # -- tiers (tier = cpu | disk | remote) ----------------------------------------------------
    Metric("kvconnect_tier_hits_total", COUNTER, "chunks a tier was asked about and held", ("tier",)),
    Metric("kvconnect_tier_misses_total", COUNTER, "chunks a tier was asked about and did not hold", ("tier",)),
    Metric("kvconnect_tier_errors_total", COUNTER, "tier failures turned into misses", ("tier",)),
    Metric("kvconnect_tier_seconds", HISTOGRAM, "duration of one batched tier call", ("tier", "op")),
    Metric("kvconnect_tier_used_bytes", GAUGE, "bytes a lower tier holds", ("tier",)),
    Metric("kvconnect_tier_evictions_total", COUNTER, "chunks a lower tier evicted", ("tier",)),
    Metric("kvconnect_write_queue_depth", GAUGE, "chunks queued or in flight to a lower tier", ("tier",)),
    Metric("kvconnect_write_queue_dropped_total", COUNTER, "lower-tier writes dropped", ("tier", "reason")),
    Metric("kvconnect_remote_breaker_open", GAUGE, "1 while a tier's circuit breaker skips it", ("tier",)),
    Metric("kvconnect_tier_failures_total", COUNTER,
           "a tier's failures by the store's own kind (Mooncake: rpc_timeouts, rpc_failures, parts_missing, ...)",
           ("tier", "kind")),
    Metric("kvconnect_write_retries_total", COUNTER, "lower-tier writes queued again after failing on an unhealthy tier",
           ("tier",)),
    # -- vLLM adapter -----------------------------------------------------------------------
    Metric("kvconnect_lookup_timeouts_total", COUNTER, "lookup-channel calls a worker did not answer in time (a miss)"),
    Metric("kvconnect_load_failures_total", COUNTER, "planned loads that restored less than promised (vLLM recomputes)"),
    Metric("kvconnect_save_failures_total", COUNTER, "saves that raised (a future miss)"),
    Metric("kvconnect_step_save_wait_seconds_total", COUNTER,
           "engine-step time spent waiting for earlier saves to land (preemptions, window layouts, backlog)"),
    # -- vLLM adapter, prefill/decode disaggregation (kvconnect/integrations/vllm/pd.py) ---------
    Metric("kvconnect_pd_remote_decode_prefills_total", COUNTER, "prefills for a remote decode whose stored tokens were named"),
    Metric("kvconnect_pd_remote_prefills_total", COUNTER, "decode requests whose kv_transfer_params named a producer's chunks"),
    Metric("kvconnect_pd_remote_prefill_ready_total", COUNTER, "... whose chunks were all found in the shared tier"),
    Metric("kvconnect_pd_remote_prefill_timeouts_total", COUNTER, "... not all found within pd_wait_timeout_s (recomputed)"),
    Metric("kvconnect_pd_remote_prefill_rejected_total", COUNTER, "... whose params were unusable or named another prompt"),
    Metric("kvconnect_pd_remote_prefill_wait_seconds_total", COUNTER, "time decode requests waited for a producer's chunks"),
    # -- node cache server ------------------------------------------------------------------
    Metric("kvconnect_server_used_bytes", GAUGE, "shared pool bytes in use"),
    Metric("kvconnect_server_capacity_bytes", GAUGE, "shared pool size"),
    Metric("kvconnect_server_entries", GAUGE, "chunks in the shared pool"),
    Metric("kvconnect_server_clients", GAUGE, "engines connected to the server"),
    Metric("kvconnect_server_evictions_total", COUNTER, "chunks the server evicted"),
    Metric("kvconnect_server_refused_requests_total", COUNTER, "malformed or unauthenticated requests refused"),
)}

# -- cheap recorders used on the hot path ------------------------------------------------------


class LatencyHistogram:
    """Bucket counts of durations (``LATENCY_BUCKETS_S``, last bucket is +Inf) and their sum."""

    __slots__ = ("_counts", "_sum", "_lock")

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[tuple[int, ...], float]:
        with self._lock:
            return tuple(self._counts), self._sum


class TierMeter:
    """Per tier: chunks found / not found and call latency per operation (StorageManager's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits: collections.Counter = collections.Counter()
        self._misses: collections.Counter = collections.Counter()
        self._raised: collections.Counter = collections.Counter()  # a tier raised (a bug): counted as its error
        self._latency: dict[tuple[str, str], LatencyHistogram] = {}

    def found(self, tier: str, hits: int, misses: int) -> None:
        with self._lock:
            self._hits[tier] += hits
            self._misses[tier] += misses

    def raised(self, tier: str) -> None:
        with self._lock:
            self._raised[tier] += 1

    def timed(self, tier: str, op: str, seconds: float) -> None:
        h = self._latency.get((tier, op))
        if h is None:
            h = self._latency.setdefault((tier, op), LatencyHistogram())
        h.observe(seconds)

    def snapshot(self) -> tuple[dict, dict, dict, dict]:
        with self._lock:
            return (dict(self._hits), dict(self._misses), dict(self._raised),
                    {k: v.snapshot() for k, v in list(self._latency.items())})


@dataclass
class OpRecord:
    chunks: int
    nbytes: int
    seconds: float


class OpLog:
    """Recent store / retrieve operations (bounded), drained by ``sglang_storage_metrics``."""

    def __init__(self, maxlen: int = 4096) -> None:
        self.stores: collections.deque = collections.deque(maxlen=maxlen)
        self.retrieves: collections.deque = collections.deque(maxlen=maxlen)
        self.store_seconds = LatencyHistogram()
        self.retrieve_seconds = LatencyHistogram()

    def stored(self, chunks: int, nbytes: int, seconds: float) -> None:
        self.store_seconds.observe(seconds)
        if chunks:
            self.stores.append(OpRecord(chunks, nbytes, seconds))

    def retrieved(self, chunks: int, nbytes: int, seconds: float) -> None:
        self.retrieve_seconds.observe(seconds)
        if chunks:
            self.retrieves.append(OpRecord(chunks, nbytes, seconds))


# -- figures -------------------------------------------------------------------------------


@dataclass
class Figures:
    """A snapshot: metric name -> {label values: value}; a histogram's value is (counts, sum)."""

    values: dict[str, dict[tuple[str, ...], Any]] = field(default_factory=dict)

    def set(self, name: str, value: Any, *labels: str) -> None:
        if name not in CATALOGUE:
            raise KeyError(f"{name} is not in kvconnect.metrics.CATALOGUE")
        self.values.setdefault(name, {})[tuple(labels)] = value

    def get(self, name: str, *labels: str, default: Any = 0) -> Any:
        return self.values.get(name, {}).get(tuple(labels), default)

    def merge(self, other: "Figures") -> "Figures":
        """Sum counters, gauges and histograms of two sources (e.g. two engines or ranks)."""
        out = Figures({k: dict(v) for k, v in self.values.items()})
        for name, series in other.values.items():
            mine = out.values.setdefault(name, {})
            for labels, value in series.items():
                mine[labels] = _add(mine[labels], value) if labels in mine else value
        return out


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return tuple(x + y for x, y in zip(a[0], b[0])), a[1] + b[1]
    return a + b


def storage_figures(storage: StorageLike, out: Optional[Figures] = None) -> Figures:
    """Pool, tier, write-behind and breaker figures of a StorageManager."""
    f = out or Figures()
    pool = storage.pool.stats()
    f.set("kvconnect_pool_used_bytes", pool.used_slots * pool.slot_bytes)
    f.set("kvconnect_pool_capacity_bytes", pool.num_slots * pool.slot_bytes)
    f.set("kvconnect_pool_evictions_total", pool.evictions)
    f.set("kvconnect_pool_reserve_shortfalls_total", pool.reserve_shortfalls)
    f.set("kvconnect_corrupt_chunks_dropped_total", storage.corrupt_chunks)
    hits, misses, raised, latency = storage.meter.snapshot()
    for tier in sorted(set(hits) | set(misses)):
        f.set("kvconnect_tier_hits_total", hits.get(tier, 0), tier)
        f.set("kvconnect_tier_misses_total", misses.get(tier, 0), tier)
    for (tier, op), hist in sorted(latency.items()):
        f.set("kvconnect_tier_seconds", hist, tier, op)
    for tier, writer in zip(storage.tiers, storage.writers):
        ts, ws = tier.stats(), writer.stats()
        f.set("kvconnect_tier_errors_total", ts.errors + raised.get(tier.name, 0), tier.name)
        f.set("kvconnect_tier_used_bytes", ts.used_bytes, tier.name)
        f.set("kvconnect_tier_evictions_total", ts.evictions, tier.name)
        f.set("kvconnect_write_queue_depth", ws.pending, tier.name)
        f.set("kvconnect_write_queue_dropped_total", ws.dropped_full, tier.name, "queue_full")
        f.set("kvconnect_write_queue_dropped_total", ws.evicted_before_write, tier.name, "evicted_before_write")
        f.set("kvconnect_write_queue_dropped_total", ws.dropped_closed, tier.name, "closed")
        f.set("kvconnect_remote_breaker_open", int(not tier.healthy()), tier.name)
        f.set("kvconnect_write_retries_total", ws.retried, tier.name)
        for kind, count in sorted(tier.failure_counts().items()):
            f.set("kvconnect_tier_failures_total", count, tier.name, kind)
    return f


def engine_figures(engine: EngineLike, *, lookups: bool = True) -> Figures:
    """Every figure of one KVCacheEngine. ``lookups=False`` leaves the lookup family out
    (vLLM counts lookups once in its scheduler; every TP rank's engine answers them)."""
    f = Figures()
    s = engine.stats_snapshot()
    if lookups:
        f.set("kvconnect_lookups_total", s["lookups"])
        f.set("kvconnect_lookup_requested_tokens_total", s["lookup_requested_tokens"])
        f.set("kvconnect_lookup_hit_tokens_total", s["lookup_hit_tokens"])
    f.set("kvconnect_stored_chunks_total", s["stored_chunks"])
    f.set("kvconnect_stored_bytes_total", s["stored_bytes"])
    f.set("kvconnect_store_skipped_chunks_total", s["skipped_chunks"])
    f.set("kvconnect_retrieved_chunks_total", s["retrieved_chunks"])
    f.set("kvconnect_retrieved_bytes_total", s["retrieved_bytes"])
    f.set("kvconnect_retrieved_tokens_total", s["retrieved_tokens"])
    f.set("kvconnect_window_parts_stored_total", s["window_parts_stored"])
    f.set("kvconnect_window_pieces_stored_total", s["window_pieces_stored"])
    f.set("kvconnect_window_pieces_evicted_total", s["window_pieces_evicted"])
    f.set("kvconnect_restore_point_hits_total", s["restore_point_hits"])
    f.set("kvconnect_prefix_chunks_demoted_total", s["prefix_chunks_demoted"])
    f.set("kvconnect_store_seconds", engine.ops.store_seconds.snapshot())
    f.set("kvconnect_retrieve_seconds", engine.ops.retrieve_seconds.snapshot())
    storage_figures(engine.storage, f)
    return f


def server_figures(stats: dict) -> Figures:
    """Figures of the node cache server from its counters (``index.STATS_FIELDS``)."""
    f = Figures()
    f.set("kvconnect_server_used_bytes", stats["used_pages"] * stats["page_bytes"])
    f.set("kvconnect_server_capacity_bytes", stats["num_pages"] * stats["page_bytes"])
    f.set("kvconnect_server_entries", stats["num_entries"])
    f.set("kvconnect_server_clients", stats["num_clients"])
    f.set("kvconnect_server_evictions_total", stats["evictions"])
    f.set("kvconnect_server_refused_requests_total", stats["refused_requests"])
    return f


# -- Prometheus (standalone) ------------------------------------------------------------------


def _families(figures: Figures, extra_labels: dict[str, str]) -> dict[str, Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    fams: dict[str, Any] = {}
    names, values = list(extra_labels), list(extra_labels.values())
    for name, series in figures.values.items():
        m = CATALOGUE[name]
        labelnames = names + list(m.labels)
        if m.kind == COUNTER:
            fam = CounterMetricFamily(name, m.help, labels=labelnames)
        elif m.kind == GAUGE:
            fam = GaugeMetricFamily(name, m.help, labels=labelnames)
        else:
            fam = HistogramMetricFamily(name, m.help + " (seconds)", labels=labelnames)
        for labels, value in series.items():
            if m.kind == HISTOGRAM:
                counts, total = value
                cumulative = list(itertools.accumulate(counts))
                bounds = [repr(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
                fam.add_metric(values + list(labels), list(zip(bounds, cumulative)), total)
            else:
                fam.add_metric(values + list(labels), value)
        fams[name] = fam
    return fams


class KVConnectCollector:
    """Serves every registered source of this process; registered once per registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, Callable[[], Optional[Figures]]] = {}
        self._counter = itertools.count()

    def add(self, source: Callable[[], Optional[Figures]], instance: Optional[str] = None) -> str:
        with self._lock:
            name = instance or f"engine-{next(self._counter)}"
            while name in self._sources:
                name = f"{instance or 'engine'}-{next(self._counter)}"
            self._sources[name] = source
            return name

    def remove(self, instance: str) -> None:
        with self._lock:
            self._sources.pop(instance, None)

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._sources)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            sources = list(self._sources.items())
        merged: dict[str, Any] = {}
        for instance, source in sources:
            try:
                figures = source()
            except Exception:  # a closing engine must not break the scrape of the others
                logger.debug("kvconnect: metrics source %s failed", instance, exc_info=True)
                continue
            if figures is None:
                continue
            for name, fam in _families(figures, {"instance": instance}).items():
                if name in merged:
                    merged[name].samples.extend(fam.samples)
                else:
                    merged[name] = fam
        return list(merged.values())


_COLLECTORS: "weakref.WeakKeyDictionary[Any, KVConnectCollector]" = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()


def collector(registry: Any = None) -> KVConnectCollector:
    """The process's collector in ``registry`` (default: prometheus_client's REGISTRY), made once."""
    from prometheus_client import REGISTRY

    registry = REGISTRY if registry is None else registry
    with _COLLECTORS_LOCK:
        c = _COLLECTORS.get(registry)
        if c is None:
            c = _COLLECTORS[registry] = KVConnectCollector()
            registry.register(c)
        return c


def register_engine(engine: EngineLike, instance: Optional[str] = None, registry: Any = None) -> Optional[str]:
    """Serve ``engine``'s figures from the process's collector; its instance label, or None
    when prometheus_client is not installed (the engine works without metrics)."""
    try:
        c = collector(registry)
    except ImportError:
        return None
    ref = weakref.ref(engine)

    def source() -> Optional[Figures]:
        e = ref()
        return engine_figures(e) if e is not None else None

    name = c.add(source, instance)
    weakref.finalize(engine, c.remove, name)  # an engine dropped without close() leaves no entry
    return name


def unregister(instance: Optional[str], registry: Any = None) -> None:
    if instance is None:
        return
    try:
        collector(registry).remove(instance)
    except ImportError:
        pass


def prometheus_text(registry: Any = None) -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY if registry is None else registry).decode()


_EXPORTER_LOCK = threading.Lock()
_EXPORTER: Optional[tuple[str, int]] = None


def start_exporter(config: "Config") -> Optional[tuple[str, int]]:
    """Start the process's HTTP exporter once (``KVCONNECT_METRICS_PORT`` > 0), on
    ``KVCONNECT_METRICS_HOST`` (loopback by default). Returns (host, port) or None when off.
    A port already taken is logged, never raised: metrics must not stop an engine."""
    global _EXPORTER
    if config.metrics_port <= 0:
        return None
    with _EXPORTER_LOCK:
        if _EXPORTER is None:
            try:
                from prometheus_client import start_http_server

                collector()
                start_http_server(config.metrics_port, addr=config.metrics_host)
                _EXPORTER = (config.metrics_host, config.metrics_port)
                logger.info("kvconnect: metrics on http://%s:%d/metrics", *_EXPORTER)
            except (ImportError, OSError) as exc:
                logger.warning("kvconnect: metrics exporter not started on %s:%d: %s", config.metrics_host, config.metrics_port, exc)
                return None
        return _EXPORTER


# -- vLLM's KV-connector stats ---------------------------------------------------------------
# Payload: {"ranks": {rank: {key: value}}}, cumulative per rank; key = "name|labelvalue|...".
# Merging keeps each rank's latest snapshot, so vLLM may aggregate workers and intervals freely.


def _key(name: str, labels: tuple[str, ...]) -> str:
    return "|".join((name, *labels))


def vllm_payload(rank: str, figures: Figures) -> dict:
    flat: dict[str, Any] = {}
    for name, series in figures.values.items():
        for labels, value in series.items():
            flat[_key(name, labels)] = [list(value[0]), value[1]] if isinstance(value, tuple) else value
    return {"ranks": {rank: flat}}


def merge_payloads(a: dict, b: dict) -> dict:
    ranks = dict(a.get("ranks", {}))
    ranks.update(b.get("ranks", {}))
    return {"ranks": ranks}


def payload_figures(payload: dict) -> Figures:
    """The sum over ranks of a payload's figures."""
    f = Figures()
    for flat in payload.get("ranks", {}).values():
        one = Figures()
        for key, value in flat.items():
            name, *labels = key.split("|")
            if name not in CATALOGUE:
                continue  # a newer kvconnect's figure: ignored, not fatal
            one.set(name, (tuple(value[0]), value[1]) if isinstance(value, list) else value, *labels)
        f = f.merge(one)
    return f


class PayloadDeltas:
    """Turns cumulative per-rank payloads into what Prometheus counters must be increased by.

    ``update(payload)`` -> (counter increments, gauge values, histogram bucket increments), each
    keyed by (name, labels). A rank whose counter went backwards restarted: its value counts anew.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], Any] = {}

    def update(self, payload: dict) -> tuple[dict, dict, dict]:
        incs: dict = collections.defaultdict(float)
        gauges: dict = collections.defaultdict(float)
        hists: dict = {}
        for rank, flat in payload.get("ranks", {}).items():
            for key, value in flat.items():
                name, *labels = key.split("|")
                m = CATALOGUE.get(name)
                if m is None:
                    continue
                ident = (name, tuple(labels))
                if m.kind == GAUGE:
                    gauges[ident] += value
                    continue
                last = self._last.get((rank, key))
                self._last[(rank, key)] = value
                if m.kind == COUNTER:
                    delta = value - last if last is not None and value >= last else value
                    if delta:
                        incs[ident] += delta
                else:
                    counts = value[0]
                    prev = last[0] if last is not None and sum(last[0]) <= sum(counts) else [0] * len(counts)
                    d = [c - p for c, p in zip(counts, prev)]
                    if any(d):
                        acc = hists.setdefault(ident, [0] * len(d))
                        hists[ident] = [x + y for x, y in zip(acc, d)]
        return dict(incs), dict(gauges), hists


VLLM_PREFIX = "vllm:"


class VllmPromMetrics:
    """The metrics objects behind vLLM's Prometheus hook, made with vLLM's metric classes
    (which handle its multiprocess mode), one child per engine index. Named ``vllm:`` +
    the catalogue name, as vLLM names its connectors' metrics: vLLM unregisters ``vllm:``
    collectors when it rebuilds its loggers, and the names never collide with a standalone
    collector's in the same process."""

    def __init__(self, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self._per_engine = per_engine_labelvalues
        self._metrics: dict[str, Any] = {}
        for m in CATALOGUE.values():
            if m.name.startswith("kvconnect_server_"):
                continue  # the node server has its own exporter
            names, full = list(labelnames) + list(m.labels), VLLM_PREFIX + m.name
            if m.kind == COUNTER:
                self._metrics[m.name] = metric_types[Counter](name=full, documentation=m.help, labelnames=names)
            elif m.kind == GAUGE:
                self._metrics[m.name] = metric_types[Gauge](name=full, documentation=m.help, labelnames=names,
                                                            multiprocess_mode="mostrecent")  # as vLLM's own gauges
            else:
                self._metrics[m.name] = metric_types[Histogram](name=full, documentation=m.help, labelnames=names,
                                                                buckets=list(LATENCY_BUCKETS_S))
        self._deltas: dict[int, PayloadDeltas] = collections.defaultdict(PayloadDeltas)

    def observe(self, payload: dict, engine_idx: int = 0) -> None:
        incs, gauges, hists = self._deltas[engine_idx].update(payload)
        base = list(self._per_engine.get(engine_idx, []))
        incs = {k: v for k, v in incs.items() if k[0] in self._metrics}
        gauges = {k: v for k, v in gauges.items() if k[0] in self._metrics}
        for (name, labels), delta in incs.items():
            self._metrics[name].labels(*base, *labels).inc(delta)
        for (name, labels), value in gauges.items():
            self._metrics[name].labels(*base, *labels).set(value)
        for (name, labels), counts in hists.items():
            child = self._metrics[name].labels(*base, *labels)
            bounds = list(LATENCY_BUCKETS_S) + [LATENCY_BUCKETS_S[-1] * 2]
            for bound, n in zip(bounds, counts):  # replay at each bucket's bound: exact counts, bounded sum
                for _ in range(n):
                    child.observe(bound)


class ReportGate:
    """Whether to report now: the figures' cheap ``signature`` changed since the last report,
    or ``interval_s`` passed (gauges move without it). Building figures every engine step
    would cost a pool scan; reporting only on time could strand the last change of an idle
    engine (vLLM asks only while it steps)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._last: Any = None

    def ready(self, signature: Any = None) -> bool:
        now = time.monotonic()
        if signature == self._last and now < self._next:
            return False
        self._last, self._next = signature, now + self.interval_s
        return True


# -- SGLang's storage metrics ----------------------------------------------------------------


@dataclass
class StorageMetricsShape:
    """SGLang 0.5.23's ``StorageMetrics`` fields (sglang.srt.observability.metrics_collector),
    used when SGLang is not importable: one entry per operation since the last call."""

    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


def sglang_storage_metrics(ops: OpLog, *, pages_per_chunk: int = 1) -> Any:
    """Drain ``ops`` into SGLang's storage-metrics object: pages moved per retrieve (prefetch)
    and per store (backup) operation, and each operation's bandwidth in GB/s (bytes / 1e9 / s).
    A chunk is ``pages_per_chunk`` SGLang pages. The object is SGLang's own class when importable."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics as cls
    except Exception:  # not installed, or a version that keeps it elsewhere
        cls = StorageMetricsShape
    out = cls()
    for queue, pages, bandwidth in ((ops.retrieves, out.prefetch_pgs, out.prefetch_bandwidth),
                                    (ops.stores, out.backup_pgs, out.backup_bandwidth)):
        while True:
            try:
                rec = queue.popleft()
            except IndexError:
                break
            pages.append(rec.chunks * pages_per_chunk)
            bandwidth.append(rec.nbytes / 1e9 / max(rec.seconds, 1e-9))
    return out
