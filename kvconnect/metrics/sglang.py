"""SGLang's storage-metrics shape: pages and GB/s per operation, drained from an ``OpLog``.

Part of ``kvconnect.metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .recorders import OpLog


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
