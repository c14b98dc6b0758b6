"""kvconnect's figures through vLLM's KV-connector stats interface (vLLM >= 0.11 defines it).

Each worker's connector returns a ``KVConnectStats`` from ``get_kv_connector_stats`` (its
engine's figures, cumulative, at most once per ``INTERVAL_S``); the scheduler's connector
adds the lookup figures (counted once there, not per TP rank). vLLM merges them across
workers and steps (``aggregate``: latest snapshot per rank), ships the dict to the API
server, and calls ``KVConnectPromMetrics.observe``, which turns the cumulative figures into
increments of vLLM-made Prometheus metrics named as in ``kvconnect.metrics.CATALOGUE`` —
so ``vllm serve``'s own ``/metrics`` carries them, labelled like vLLM's (model_name, engine).
All arithmetic lives in kvconnect.metrics; this module only fits vLLM's classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import logging

from kvconnect.metrics.catalogue import Figures
from kvconnect.metrics.figures import engine_figures
from kvconnect.metrics.vllm import merge_payloads, payload_figures, ReportGate, vllm_payload, VllmPromMetrics

logger = logging.getLogger(__name__)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover - a vLLM without the stats interface: no stats, still a connector
    KVConnectorStats = None
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:  # pragma: no cover - stats are logged, not exported
    KVConnectorPromMetrics = None

INTERVAL_S = 5.0  # besides every change of the counters (ReportGate)


def available() -> bool:
    return KVConnectorStats is not None


if KVConnectorStats is not None:

    @dataclass
    class KVConnectStats(KVConnectorStats):
        def __post_init__(self) -> None:
            if "ranks" not in self.data:
                self.reset()

        def reset(self) -> None:
            self.data = {"ranks": {}}

        def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
            if other is not None and not other.is_empty():
                self.data = merge_payloads(self.data, other.data)
            return self

        def reduce(self) -> dict[str, int | float]:
            """Scalar figures summed over ranks, for vLLM's periodic log line."""
            out: dict[str, int | float] = {}
            for name, series in payload_figures(self.data).values.items():
                for labels, value in series.items():
                    if not isinstance(value, tuple):
                        out[name.removeprefix("kvconnect_") + "".join(f"[{v}]" for v in labels)] = value
            return out

        def is_empty(self) -> bool:
            return not self.data.get("ranks")


if KVConnectorPromMetrics is not None:

    class KVConnectPromMetrics(KVConnectorPromMetrics):
        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list, per_engine_labelvalues: dict) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._impl = VllmPromMetrics(metric_types, labelnames, per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            self._impl.observe(transfer_stats_data, engine_idx)


def build(data: Optional[dict]) -> Any:
    if KVConnectorStats is None:
        return None
    return KVConnectStats(data=data) if data is not None else KVConnectStats()


def build_prom(vllm_config: Any, metric_types: dict, labelnames: list, per_engine_labelvalues: dict) -> Any:
    if KVConnectorPromMetrics is None:
        return None
    try:
        return KVConnectPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
    except TypeError:  # another vLLM's hook signature: its /metrics lacks kvconnect's figures, nothing else
        logger.warning("kvconnect: this vLLM's Prometheus hook differs; kvconnect metrics are not exported", exc_info=True)
        return None


def worker_stats(worker: Any, rank: str, gate: ReportGate) -> Any:
    """The worker's figures (engine + load/save failures), or None when nothing changed."""
    if KVConnectorStats is None or worker.engine is None:
        return None
    with worker._lock:
        signature = (tuple(vars(worker.engine.stats).values()), tuple(worker.counters.values()))
    if not gate.ready(signature):
        return None
    figures = engine_figures(worker.engine, lookups=False)
    with worker._lock:
        figures.set("kvconnect_load_failures_total", worker.counters["load_failures"])
        figures.set("kvconnect_save_failures_total", worker.counters["save_failures"])
        figures.set("kvconnect_step_save_wait_seconds_total", worker.counters["save_wait_us"] / 1e6)
    return KVConnectStats(data=vllm_payload(rank, figures))


def scheduler_stats(client: Any, gate: ReportGate, pd_counters: Optional[dict[str, int]] = None) -> Any:
    """The lookup figures as the scheduler saw them, plus the P/D counters (pd.COUNTERS), or
    None when nothing changed."""
    pd_counters = pd_counters or {}
    signature = (client.num_lookups, client.requested_tokens, client.hit_tokens, client.num_timeouts,
                 tuple(pd_counters.values()))
    if KVConnectorStats is None or not gate.ready(signature):
        return None
    figures = Figures()
    figures.set("kvconnect_lookups_total", client.num_lookups)
    figures.set("kvconnect_lookup_requested_tokens_total", client.requested_tokens)
    figures.set("kvconnect_lookup_hit_tokens_total", client.hit_tokens)
    figures.set("kvconnect_lookup_timeouts_total", client.num_timeouts)
    for name, value in pd_counters.items():  # P/D (pd.py): kvconnect_pd_<counter>_total
        if name.endswith("_us"):
            figures.set(f"kvconnect_pd_{name[:-3]}_seconds_total", value / 1e6)
        else:
            figures.set(f"kvconnect_pd_{name}_total", value)
    return KVConnectStats(data=vllm_payload("scheduler", figures))
