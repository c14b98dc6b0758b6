"""The cheap recorders used on the hot path: ``LatencyHistogram``, ``TierMeter``, ``OpLog``.

The hot path only bumps the counters it already keeps (EngineStats, the pool's, each tier's
and writer's) plus these; an observation costs a bisect and a lock. ``TierMeter`` keeps the
per-tier hits, misses, raised calls and call latencies of a StorageManager; ``OpLog`` the
recent store / retrieve operations (drained by ``sglang``). Part of
``kvconnect.metrics``.
"""

from __future__ import annotations

import bisect
import collections
import threading
from dataclasses import dataclass

from .catalogue import LATENCY_BUCKETS_S


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
