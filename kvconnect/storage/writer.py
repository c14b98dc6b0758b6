"""Write-behind: copies committed pool entries into one lower tier on a background thread.

    writer = WriteBehind(tier, pool, max_pending_bytes=...)
    writer.submit(key)          # engine thread: pin the pool entry and queue it (never blocks)
    writer.submit_delete(key)   # queue a delete (ordered after earlier puts of the key)
    writer.flush(timeout_s)     # wait until everything queued so far is written
    writer.close(timeout_s)     # flush, stop the thread, release what is left

The queue holds pool entries, never copies: the payload stays in its pool slot and the
thread encodes it (checksum) and hands it to the tier. The checksum is computed once per pool
entry, by whichever tier's writer takes it first, and kept on the entry for the others
(``sealed``): a chunk written to disk and to a remote store is hashed once, not per tier. Up to ``max_pending_bytes`` of queued
payload is *pinned* (guaranteed to be written; pinned slots cannot be evicted, so this also
caps how much of the pool a slow tier can hold). Beyond that, up to ``max_queue_items``
more keys are queued unpinned and written if still in the pool when their turn comes
(``evicted_before_write`` counts those that were not). Past both bounds a submit is dropped
and counted (``dropped_full``): a slow tier never blocks the engine's step and never grows
memory.

Retries. A put that fails while its tier is unhealthy (a breaker open: a remote store down
or stalled for a moment) is queued again, still pinned, up to MAX_PUT_ATTEMPTS in all; before
each retry the thread waits (at most RETRY_WAIT_S) for the tier to become healthy again.
``retried`` counts the re-queued puts, ``failed`` only those finally dropped. A put that
fails while the tier is healthy (disk full, a value the store refuses) is not retried.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ..chunks import chunk_format
from ..chunks.chunk_format import ChunkHeader
from ..layout.spec import ChunkKey
from .pool import ChunkPool, PoolEntry
from .tier import LowerTier, StoreItem

logger = logging.getLogger(__name__)

MAX_PUT_ATTEMPTS = 3  # a put refused while its tier is unhealthy is tried this often in all
RETRY_WAIT_S = 2.0  # before a retry, wait at most this long for the tier to be healthy again
_SEAL_LOCK = threading.Lock()  # the writers of all tiers: an entry's checksum is computed once


def sealed(entry: PoolEntry, payload) -> ChunkHeader:
    """``entry``'s header with its checksum over ``payload`` (its pool bytes, final while the
    entry lives): computed by the first writer to ask, kept on the entry for the others. An
    entry whose header already carries one (a shared-pool entry, verified when acquired) keeps it."""
    header = entry.header
    if header.checksum:
        return header
    with _SEAL_LOCK:  # a second tier's writer waits for the first's checksum rather than computing its own
        header = entry.header
        if not header.checksum:
            header = dataclasses.replace(header, checksum=chunk_format.compute_checksum(header, payload))
            entry.header = header
    return header


@dataclass
class WriterStats:
    tier: str = ""
    submitted: int = 0
    written: int = 0
    written_bytes: int = 0
    failed: int = 0  # puts finally not written (after their retries)
    retried: int = 0  # puts queued again because the tier was unhealthy when they failed
    dropped_full: int = 0  # refused at submit: the queue was at both of its bounds
    evicted_before_write: int = 0  # queued unpinned and gone from the pool when its turn came
    dropped_closed: int = 0  # still queued when the writer was closed
    deletes: int = 0
    pending: int = 0
    pending_bytes: int = 0


@dataclass(eq=False)
class _Op:
    kind: str  # "put" | "delete"
    key: ChunkKey
    entry: Optional[PoolEntry] = None  # pinned at submit; None: looked up when written
    pinned_bytes: int = 0  # counted in the writer's pending bytes until the op is done
    attempts: int = 0  # puts of this op that failed so far
    requeued: bool = False  # queued again by the batch that just ran (keeps its pin)


class WriteBehind:
    def __init__(self, tier: LowerTier, pool: ChunkPool, *, max_pending_bytes: int, max_queue_items: int = 4096,
                 max_batch_bytes: int = 64 << 20, max_batch_items: int = 64) -> None:
        self.tier = tier
        self.pool = pool
        self.max_pending_bytes = max_pending_bytes
        self.max_queue_items = max_queue_items
        self.max_batch_bytes = max_batch_bytes
        self.max_batch_items = max_batch_items
        self._queue: "collections.deque[_Op]" = collections.deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0  # queued + in flight
        self._in_flight = 0
        self._closing = False
        self._stats = WriterStats(tier=tier.name)
        # called on the writer's thread with the keys written / deleted (kvconnect.events); a
        # failing listener is logged, never raised
        self.on_written: list = []
        self.on_deleted: list = []
        self._thread = threading.Thread(target=self._run, name=f"kvconnect-writer-{tier.name}", daemon=True)
        self._thread.start()

    # -- engine side -----------------------------------------------------------------
    def submit(self, key: ChunkKey) -> bool:
        """Queue the pool's current entry for ``key``; False when absent, closed or full."""
        (entry,) = self.pool.acquire([key], touch=False)  # a pin to write it, not a use
        if entry is None:
            return False
        size = entry.header.payload_bytes
        with self._cond:
            pinned = self._pending_bytes + size <= self.max_pending_bytes
            accepted = not self._closing and (pinned or len(self._queue) < self.max_queue_items)
            if accepted:
                self._queue.append(_Op("put", key, entry, size) if pinned else _Op("put", key))
                self._pending_bytes += size if pinned else 0
                self._stats.submitted += 1
                self._cond.notify()
            else:
                self._stats.dropped_full += not self._closing
        if not (accepted and pinned):
            self.pool.release([entry])
        return accepted

    def submit_delete(self, key: ChunkKey) -> bool:
        with self._cond:
            if self._closing:
                return False
            self._queue.append(_Op("delete", key))
            self._cond.notify()
        return True

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until the queue is empty and nothing is in flight; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Flush up to ``timeout_s``, stop the thread, release pins of what was not written."""
        flushed = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            left = list(self._queue)
            self._queue.clear()
            self._stats.dropped_closed += sum(op.kind == "put" for op in left)
            self._pending_bytes -= sum(op.pinned_bytes for op in left)
            self._cond.notify_all()
        self.pool.release([op.entry for op in left if op.entry is not None])
        self._thread.join(timeout_s)
        return flushed and not left

    def stats(self) -> WriterStats:
        with self._cond:
            s = dataclasses.replace(self._stats)
            s.pending = len(self._queue) + self._in_flight
            s.pending_bytes = self._pending_bytes
            return s

    # -- writer thread ---------------------------------------------------------------
    def _next_batch(self) -> list[_Op]:
        """Consecutive ops of one kind, up to the batch bounds (at least one)."""
        batch = [self._queue.popleft()]
        size = self.pool.slot_bytes
        while self._queue and len(batch) < self.max_batch_items:
            op = self._queue[0]
            if op.kind != batch[0].kind or size + self.pool.slot_bytes > self.max_batch_bytes:
                break
            batch.append(self._queue.popleft())
            size += self.pool.slot_bytes
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                batch = self._next_batch()
                self._in_flight = len(batch)
            try:
                self._process(batch)
            except Exception:  # a tier must not raise; if one does, the batch is failed, not the thread
                logger.exception("kvconnect: %s writer failed a batch", self.tier.name)
                with self._cond:
                    self._stats.failed += sum(op.kind == "put" and not op.requeued for op in batch)
            finally:
                with self._cond:
                    # retried first, in their order: a later delete of the same key stays after them;
                    # once closing (close() took the queue already) they are dropped instead
                    retry = [op for op in batch if op.requeued and not self._closing]
                    self._stats.dropped_closed += sum(op.requeued for op in batch) - len(retry)
                    for op in batch:
                        op.requeued = False
                    self._queue.extendleft(reversed(retry))
                    done = [op for op in batch if op not in retry]
                    self._pending_bytes -= sum(op.pinned_bytes for op in done)
                    self._in_flight = 0
                    self._cond.notify_all()
                self.pool.release([op.entry for op in done if op.entry is not None])

    def _notify(self, listeners: list, keys: list) -> None:
        for listener in listeners if keys else ():
            try:
                listener(keys)
            except Exception:
                logger.exception("kvconnect: a %s writer listener failed", self.tier.name)

    def _process(self, batch: list[_Op]) -> None:
        if batch[0].kind == "delete":
            gone = self.tier.delete([op.key for op in batch])
            with self._cond:
                self._stats.deletes += len(batch)
            self._notify(self.on_deleted, [op.key for op, g in zip(batch, gone or ()) if g])
            return
        late = [op for op in batch if op.entry is None]
        for op, entry in zip(late, self.pool.acquire([op.key for op in late], touch=False)):
            op.entry = entry  # pinned now; released with the batch
        ready = [op for op in batch if op.entry is not None]
        items = []
        for op in ready:
            payload = memoryview(self.pool.entry_view(op.entry).numpy()).cast("B")
            items.append(StoreItem(key=op.key, header=sealed(op.entry, payload), payload=payload))
        ok = self.tier.put(items) if items else []
        self._notify(self.on_written, [op.key for op, good in zip(ready, ok) if good])
        failed = [op for op, good in zip(ready, ok) if not good]
        retry = self._retry(failed)
        with self._cond:
            self._stats.evicted_before_write += len(batch) - len(ready)
            self._stats.written += sum(ok)
            self._stats.written_bytes += sum(op.entry.header.payload_bytes for op, good in zip(ready, ok) if good)
            self._stats.failed += len(failed) - len(retry)
            self._stats.retried += len(retry)

    def _retry(self, failed: list[_Op]) -> list[_Op]:
        """The failed puts to queue again (marked ``requeued``): those refused while the tier is
        unhealthy with attempts left. Waits up to RETRY_WAIT_S for the tier to recover first."""
        for op in failed:
            op.attempts += 1
        if not failed or self.tier.healthy():
            return []
        retry = [op for op in failed if op.attempts < MAX_PUT_ATTEMPTS]
        if not retry:
            return []
        deadline = time.monotonic() + RETRY_WAIT_S
        with self._cond:
            while not self._closing and not self.tier.healthy() and time.monotonic() < deadline:
                self._cond.wait(0.05)
            if self._closing:
                return []
        for op in retry:
            op.requeued = True
        return retry
