"""Metrics: the one import path that names, collects and formats kvconnect's figures.

Everything an operator watches is defined once, in ``CATALOGUE`` (Prometheus names with
units: ``_bytes``, ``_seconds``, ``_total``). Figures are *pulled*: the hot path only bumps
the counters it already keeps (EngineStats, the pool's, each tier's and writer's) plus two
cheap recorders (``LatencyHistogram``, ``TierMeter``); a ``Figures`` snapshot is built from
them when someone asks, and turned into

- Prometheus samples (``KVConnectCollector``, one per registry, serving every engine of the
  process under an ``instance`` label: several engines never register twice);
- vLLM's KV-connector stats payload (``vllm_payload`` / ``merge_payloads``, cumulative per
  rank, so that vLLM's per-worker and per-interval aggregation cannot double count) and the
  increments its Prometheus hook records (``PayloadDeltas``);
- SGLang's storage-metrics shape (``sglang_storage_metrics``: pages and GB/s per operation);
- an opt-in HTTP exporter (``start_exporter``; loopback unless configured otherwise).

Histograms keep fixed buckets (``LATENCY_BUCKETS_S``); an observation costs a bisect and a
lock. See docs/operations.md for what each figure means and its healthy values.

The code lives in one module per concept, all re-exported here (import from here):

- ``metrics_catalogue``: ``CATALOGUE``, ``Metric``, the buckets, the ``Figures`` snapshot;
- ``metrics_recorders``: the hot-path recorders ``LatencyHistogram``, ``TierMeter``, ``OpLog``;
- ``metrics_figures``: ``storage_figures``, ``engine_figures``, ``server_figures``;
- ``metrics_prometheus``: the collector, ``register_engine``, ``start_exporter``;
- ``metrics_vllm``: vLLM's payload, ``PayloadDeltas``, ``VllmPromMetrics``, ``ReportGate``;
- ``metrics_sglang``: ``sglang_storage_metrics``.

They sit below the engine and the storage manager (both import them) and import neither.
"""

from __future__ import annotations

import importlib
from typing import Any

from .metrics_catalogue import CATALOGUE, COUNTER, GAUGE, HISTOGRAM, LATENCY_BUCKETS_S, Figures, Metric
from .metrics_figures import EngineLike, StorageLike, engine_figures, server_figures, storage_figures
from .metrics_prometheus import (
    KVConnectCollector, collector, logger, prometheus_text, register_engine, start_exporter, unregister,
)
from .metrics_recorders import LatencyHistogram, OpLog, OpRecord, TierMeter
from .metrics_sglang import StorageMetricsShape, sglang_storage_metrics
from .metrics_vllm import (
    VLLM_PREFIX, PayloadDeltas, ReportGate, VllmPromMetrics, merge_payloads, payload_figures, vllm_payload,
)

__all__ = [
    "CATALOGUE", "COUNTER", "GAUGE", "HISTOGRAM", "LATENCY_BUCKETS_S", "Figures", "Metric",
    "EngineLike", "StorageLike", "engine_figures", "server_figures", "storage_figures",
    "KVConnectCollector", "collector", "logger", "prometheus_text", "register_engine", "start_exporter", "unregister",
    "LatencyHistogram", "OpLog", "OpRecord", "TierMeter",
    "StorageMetricsShape", "sglang_storage_metrics",
    "VLLM_PREFIX", "PayloadDeltas", "ReportGate", "VllmPromMetrics", "merge_payloads", "payload_figures", "vllm_payload",
]

# The private helpers and state, still reachable here as before, read live from their module
# (``_EXPORTER`` is rebound by ``start_exporter``: a copy taken at import would go stale).
_PRIVATE = {
    "_add": "metrics_catalogue", "_families": "metrics_prometheus", "_COLLECTORS": "metrics_prometheus",
    "_COLLECTORS_LOCK": "metrics_prometheus", "_EXPORTER_LOCK": "metrics_prometheus",
    "_EXPORTER": "metrics_prometheus", "_key": "metrics_vllm",
}


def __getattr__(name: str) -> Any:
    module = _PRIVATE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
