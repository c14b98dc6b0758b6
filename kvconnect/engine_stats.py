"""EngineStats: the counters a KVCacheEngine keeps, and ``Counters``, the one lock they are
added under (kvconnect.metrics reads a consistent copy through ``KVCacheEngine.stats_snapshot``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class EngineStats:
    stored_chunks: int = 0
    stored_bytes: int = 0
    skipped_chunks: int = 0  # already stored, or no room in the pool
    retrieved_chunks: int = 0
    retrieved_bytes: int = 0
    retrieved_tokens: int = 0
    lookups: int = 0
    lookup_requested_tokens: int = 0
    lookup_hit_tokens: int = 0
    corrupt_chunks: int = 0
    # restore points (kvconnect/restore/; hybrid layouts only)
    window_parts_stored: int = 0  # restore points whose window part a store wrote (some pieces or all)
    window_pieces_stored: int = 0
    window_bytes_stored: int = 0
    window_pieces_evicted: int = 0  # from the private CPU pool
    restore_point_hits: int = 0  # retrieves that resumed at a restore point
    window_pieces_retrieved: int = 0
    prefix_chunks_demoted: int = 0  # found present but reached by no restore point (restore/window_parts.py)
    replica_stores_left: int = 0  # stores a replica left to the writer (shared pool; KVCacheEngine(shared_writer=False))


class Counters:
    """``stats`` (an EngineStats) and the lock every writer and reader of it takes: the store,
    lookup and retrieve paths run on several threads of an adapter."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(vars(self.stats))
