"""The catalogue of kvconnect's figures and the ``Figures`` snapshot they are carried in.

Everything an operator watches is defined once, in ``CATALOGUE`` (Prometheus names with
units: ``_bytes``, ``_seconds``, ``_total``). Histograms keep fixed buckets
(``LATENCY_BUCKETS_S``). A ``Figures`` is a snapshot of catalogue names to labelled values,
built when someone asks (``figures``) and formatted by ``prometheus``,
``vllm`` and ``sglang``. Part of ``kvconnect.metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    Metric("kvconnect_window_parts_stored_total", COUNTER, "restore points whose window part a store wrote (kvconnect/restore/parts.py)"),
    Metric("kvconnect_window_pieces_stored_total", COUNTER, "window-part pieces written into the CPU pool"),
    Metric("kvconnect_window_pieces_evicted_total", COUNTER, "window-part pieces evicted from the CPU pool"),
    Metric("kvconnect_restore_point_hits_total", COUNTER, "retrieves that resumed at a restore point (prefix parts + one window part)"),
    Metric("kvconnect_prefix_chunks_demoted_total", COUNTER, "prefix parts a lookup found past every usable restore point (evicted first)"),
    Metric("kvconnect_verify_checks_total", COUNTER,
           "stored objects compared with freshly computed rows (KVCONNECT_VERIFY_RATE), by group kind and result: "
           "exact, within_tolerance, mismatch, unverifiable", ("group_kind", "result")),
    Metric("kvconnect_verify_requests_total", COUNTER, "hits served as misses so that the engine computes them and they are verified"),
    Metric("kvconnect_verify_retired", GAUGE, "1 once a verification mismatch retired this layout fingerprint (no hits, loads or stores)"),
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
    Metric("kvconnect_pd_remote_prefill_other_tp_total", COUNTER, "... admitted from a producer of another TP size"),
    Metric("kvconnect_pd_remote_prefill_wait_seconds_total", COUNTER, "time decode requests waited for a producer's chunks"),
    # -- node cache server ------------------------------------------------------------------
    Metric("kvconnect_server_used_bytes", GAUGE, "shared pool bytes in use"),
    Metric("kvconnect_server_capacity_bytes", GAUGE, "shared pool size"),
    Metric("kvconnect_server_entries", GAUGE, "chunks in the shared pool"),
    Metric("kvconnect_server_clients", GAUGE, "engines connected to the server"),
    Metric("kvconnect_server_evictions_total", COUNTER, "chunks the server evicted"),
    Metric("kvconnect_server_refused_requests_total", COUNTER, "malformed or unauthenticated requests refused"),
)}


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
