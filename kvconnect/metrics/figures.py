"""``Figures`` snapshots of an engine, its storage and the node cache server.

Figures are *pulled*: these read the counters and recorders the hot path keeps and build a
``Figures`` when someone asks. Part of ``kvconnect.metrics``.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from .catalogue import Figures
from .recorders import OpLog, TierMeter

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
    verifier: Any  # restore.verify.Verifier: snapshot() -> (checks by (group kind, result), requests, retired)

    def stats_snapshot(self) -> dict[str, int]: ...


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
    checks, verified_requests, retired = engine.verifier.snapshot()
    for (kind, result), count in sorted(checks.items()):
        f.set("kvconnect_verify_checks_total", count, kind, result)
    f.set("kvconnect_verify_requests_total", verified_requests)
    f.set("kvconnect_verify_retired", int(retired))
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
