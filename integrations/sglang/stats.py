"""The backend's counters in SGLang's storage-metrics shape (one small place).

SGLang's ``StorageMetricsCollector`` reads ``storage_backend.get_stats()`` and expects an
object with ``prefetch_pgs``, ``backup_pgs`` (pages per call) and ``prefetch_bandwidth``,
``backup_bandwidth`` (GB/s per call), all lists drained on each read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CallLog:
    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


class StorageCounters:
    """Per-call page counts and bandwidths since the last ``drain``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log = CallLog()

    def record(self, kind: str, pages: int, num_bytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        gbps = num_bytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            getattr(self._log, f"{kind}_pgs").append(pages)
            getattr(self._log, f"{kind}_bandwidth").append(gbps)

    def drain(self):
        """The calls since the last drain, as SGLang's ``StorageMetrics`` (or a look-alike)."""
        with self._lock:
            log, self._log = self._log, CallLog()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # pragma: no cover - SGLang moved it
            return log
        out = StorageMetrics()
        out.prefetch_pgs.extend(log.prefetch_pgs)
        out.backup_pgs.extend(log.backup_pgs)
        out.prefetch_bandwidth.extend(log.prefetch_bandwidth)
        out.backup_bandwidth.extend(log.backup_bandwidth)
        return out
