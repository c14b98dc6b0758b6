"""vLLM's KV-connector stats: the payload, its merging, and vLLM's Prometheus hook.

``vllm_payload`` / ``merge_payloads`` are cumulative per rank, so that vLLM's per-worker and
per-interval aggregation cannot double count; ``PayloadDeltas`` turns them into the
increments vLLM's Prometheus hook records (``VllmPromMetrics``); ``ReportGate`` decides when
to report. Part of ``kvconnect.metrics``.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from .catalogue import CATALOGUE, COUNTER, GAUGE, LATENCY_BUCKETS_S, Figures


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
