"""StorageManager: the one object the engine asks for chunks, whatever tier holds them.

Tiers, fastest first: the CPU pool, then the lower tiers (``tiers``: local disk, then the
remote store). Contract used by the engine:

    masks(keys)              -> group mask per key (None = miss): pool, then each lower
                                tier for the keys still missing (one batched call per tier)
    acquire(keys)            -> pinned pool entries; a key missing from the pool is fetched
                                from the first lower tier holding it, verified, and promoted
                                into the pool (and written to the tiers above its source)
    release(entries)
    reserve(n) / commit / abort   write path into the pool; ``commit`` queues the chunk for
                                every lower tier (write-behind, bounded: never blocks)
    drop(key)                -> forget a bad chunk in every tier
    export_chunk(key)        -> the canonical encoded bytes (header + checksum + payload)
    import_chunk(data, ...)  verify and insert encoded bytes (a corrupt chunk is refused)
    flush() / close()        wait for / stop the write-behind threads

A *replica* manager (``writes_shared=False``: a TP rank of KV that another rank writes, see
``KVCacheEngine(shared_writer=False)``) reads every tier but queues nothing for them: what it
commits stays in its private pool, and the writer rank's copy is the one in the shared tiers.

A failure of a lower tier is a miss and a counted error (``tier_stats``), never an
exception into the engine.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar

from ..chunks import chunk_format
from ..errors import ConfigError, CorruptChunkError
from ..layout.spec import ChunkKey, Fingerprint
from ..metrics.recorders import TierMeter
from .pool import ChunkPool, PoolEntry
from .tier import LowerTier
from .writer import WriteBehind

if TYPE_CHECKING:
    from ..config import Config

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
FETCH_BATCH_BYTES = 256 << 20  # bound on encoded chunks held in memory while promoting
MAX_PENDING_WRITE_BYTES = 1 << 30  # per lower tier, further capped to a quarter of the pool


def open_tiers(config: "Config", fingerprint: Fingerprint, *, writes_shared: bool = True) -> list[LowerTier]:
    """The lower tiers ``config`` asks for, fastest first (disk, then remote). A replica
    (``writes_shared=False``) follows the writer's disk directory (``DiskTier(follow_writer=)``)
    and never removes the writer's Mooncake objects (``MooncakeTier(removes=False)``).

    Raises ConfigError / StorageError for a tier that cannot be set up (bad URL, missing
    ``redis`` package, directory that cannot be created): configuration errors surface at
    start, failures of a running tier become misses.
    """
    tiers: list[LowerTier] = []
    if config.local_disk:
        if config.max_local_disk_bytes <= 0:
            logger.warning("kvconnect: local_disk is set but max_local_disk_size is 0 GB; the disk tier is off (set "
                           "LMCACHE_MAX_LOCAL_DISK_SIZE, in GB, as in LMCache)")
        else:
            from .disk import DiskTier

            tier = DiskTier(config.local_disk, fingerprint, config.max_local_disk_bytes, fsync=config.local_disk_fsync,
                            follow_writer=not writes_shared)
            total = shutil.disk_usage(tier.dir).total
            if config.max_local_disk_bytes > total:
                tier.close()
                raise ConfigError(
                    f"max_local_disk_size (LMCACHE_MAX_LOCAL_DISK_SIZE) = {config.max_local_disk_size:g} GB, but the "
                    f"filesystem of {config.local_disk!r} holds {total / (1 << 30):.1f} GiB in all; set it below "
                    "its free space")
            tiers.append(tier)
    if config.remote_url and config.remote_url.lower().startswith("mooncakestore://"):
        from .mooncake.config import make_spec
        from .mooncake.tier import MooncakeTier

        spec = make_spec(config.remote_url, config.mooncake_config_path, has_node_server=bool(config.server_url))
        tiers.append(MooncakeTier(spec, fingerprint, timeout_s=config.remote_timeout_s, removes=writes_shared))
    elif config.remote_url:
        from .redis_tier import RedisTier

        tiers.append(RedisTier(config.remote_url, fingerprint, timeout_s=config.remote_timeout_s))
    return tiers


class StorageManager:
    def __init__(self, pool: ChunkPool, fingerprint: Fingerprint, tiers: Sequence[LowerTier] = (), *,
                 max_pending_write_bytes: Optional[int] = None, max_queued_writes: int = 4096,
                 writes_shared: bool = True) -> None:
        """Front ``pool`` and the lower ``tiers`` (fastest first; the manager owns and closes them).

        max_pending_write_bytes: payload bytes each tier's write-behind queue keeps pinned
            in the pool (default: 1 GiB, at most a quarter of the pool, at least one slot).
        max_queued_writes: further chunks each queue holds unpinned (see writer.py).
        writes_shared: False for a replica (see the module doc): nothing is written to the lower
            tiers (deletes of corrupt objects still are).
        """
        self.pool = pool
        self.writes_shared = writes_shared
        self.fingerprint = fingerprint
        self.corrupt_chunks = 0
        self.promotions = 0
        self.promotion_failures = 0  # found below but no pool slot to promote into
        self.tier_failures = 0  # a tier raised (it should not); counted, treated as a miss
        self._counter_lock = threading.Lock()
        self.meter = TierMeter()  # per-tier hits, misses and call latency (kvconnect.metrics)
        self.tiers = list(tiers)
        for tier in self.tiers:  # tiers that move bytes zero-copy register the pool's buffer
            tier.attach_pool(pool)
        if max_pending_write_bytes is None:
            pool_bytes = pool.num_slots * pool.slot_bytes or 4 * MAX_PENDING_WRITE_BYTES  # 0: size not known yet
            max_pending_write_bytes = max(pool.slot_bytes, min(MAX_PENDING_WRITE_BYTES, pool_bytes // 4))
        self.writers = [
            WriteBehind(t, pool, max_pending_bytes=max_pending_write_bytes, max_queue_items=max_queued_writes)
            for t in self.tiers
        ]
        self._fetch_batch = max(1, FETCH_BATCH_BYTES // max(pool.slot_bytes, 1))

    @classmethod
    def from_config(cls, pool: ChunkPool, fingerprint: Fingerprint, config: "Config", *,
                    writes_shared: bool = True) -> "StorageManager":
        return cls(pool, fingerprint, open_tiers(config, fingerprint, writes_shared=writes_shared), writes_shared=writes_shared)

    # -- reads -----------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        out = self.pool.masks(keys)
        missing = [i for i, m in enumerate(out) if m is None]
        self.meter.found("cpu", len(keys) - len(missing), len(missing))
        for tier in self.tiers:
            if not missing:
                break
            found = self._call(tier, tier.masks, [keys[i] for i in missing])
            if found is None:
                continue
            for i, m in zip(missing, found):
                out[i] = m
            missing = [i for i in missing if out[i] is None]
        return out

    def acquire(self, keys: Sequence[ChunkKey]) -> list[Optional[PoolEntry]]:
        entries = self.pool.acquire(keys)
        found = sum(e is not None for e in entries)
        self.meter.found("cpu", found, len(keys) - found)
        try:
            self._promote_missing(keys, entries)
        except Exception:  # a bug below the pool must not leak pins or reach the engine
            logger.exception("kvconnect: promotion from lower tiers failed; serving what was found")
            with self._counter_lock:
                self.tier_failures += 1
        return entries

    def _promote_missing(self, keys: Sequence[ChunkKey], entries: list[Optional[PoolEntry]]) -> None:
        """Fill the None entries from the lower tiers, fastest first, in place."""
        missing = [i for i, e in enumerate(entries) if e is None]
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            if not tier.healthy():
                continue
            if tier.reads_into:
                present = self._call(tier, tier.masks, [keys[i] for i in missing]) or []
                found = [i for i, mask in zip(missing, present) if mask is not None]
                for start in range(0, len(found), self._fetch_batch):
                    batch = found[start : start + self._fetch_batch]
                    for i, entry in zip(batch, self._promote_into([keys[i] for i in batch], level)):
                        entries[i] = entry
                missing = [i for i in missing if entries[i] is None]
                continue
            for start in range(0, len(missing), self._fetch_batch):
                batch = missing[start : start + self._fetch_batch]
                fetched = self._call(tier, tier.get, [keys[i] for i in batch])
                for i, data in zip(batch, fetched or ()):
                    if data is not None:
                        entries[i] = self._promote(keys[i], data, level)
            missing = [i for i in missing if entries[i] is None]

    def _promote(self, key: ChunkKey, data, level: int) -> Optional[PoolEntry]:
        """Copy a chunk verified by tier ``level`` into the pool; the pinned entry or None."""
        try:
            header = chunk_format.decode_header(data)
        except CorruptChunkError:  # the tier verified it; a failure here is a tier bug
            logger.exception("kvconnect: a chunk verified by the %s tier has a bad header", self.tiers[level].name)
            return None
        if header.payload_bytes > self.pool.slot_bytes or header.key != key:
            logger.warning("kvconnect: %s tier chunk does not fit this layout's slots; ignoring it", self.tiers[level].name)
            return None
        slots = self.pool.reserve(1)
        if not slots:
            with self._counter_lock:
                self.promotion_failures += 1
            return None
        view = self.pool.slot_view(slots[0])[: header.payload_bytes]
        view.numpy()[:] = memoryview(data).cast("B")[header.header_bytes :]
        return self._publish(key, header, slots[0], level)

    def _promote_into(self, keys: Sequence[ChunkKey], level: int) -> list[Optional[PoolEntry]]:
        """Have tier ``level`` read ``keys`` straight into pool slots (one ``read_many_into``
        call); the pinned entry per key, None for a miss or when no slot was free."""
        tier = self.tiers[level]
        slots = self.pool.reserve(len(keys))
        if len(slots) < len(keys):
            with self._counter_lock:
                self.promotion_failures += len(keys) - len(slots)
        outs = [memoryview(self.pool.slot_view(slot).numpy()) for slot in slots]
        lent: set[int] = set()  # slots an abandoned read may still write: back to the pool once it ended

        def abandoned(indices: list[int]) -> Callable[[], None]:
            lent.update(indices)
            late = [slots[i] for i in indices]
            return lambda: self.pool.abort(late)

        start = time.perf_counter()
        try:
            headers = tier.read_many_into(keys[: len(slots)], outs, on_abandoned=abandoned)
            self.meter.timed(tier.name, "read_into", time.perf_counter() - start)
        except Exception:
            logger.exception("kvconnect: the %s tier raised; treating it as a miss", tier.name)
            self.meter.raised(tier.name)
            with self._counter_lock:
                self.tier_failures += 1
            headers = [None] * len(slots)
        out: list[Optional[PoolEntry]] = [None] * len(keys)
        for j, (key, slot, header) in enumerate(zip(keys, slots, headers)):
            if header is None:
                if j not in lent:
                    self.pool.abort([slot])
            else:
                out[j] = self._publish(key, header, slot, level)
        return out

    def _publish(self, key: ChunkKey, header: chunk_format.ChunkHeader, slot: int, level: int) -> Optional[PoolEntry]:
        """Commit a promoted chunk, pin it for the caller, queue it for the tiers above ``level``."""
        self.pool.commit(key, header, slot)
        (entry,) = self.pool.acquire([key])  # None only if evicted in between: a miss
        self._queue(key, level)
        with self._counter_lock:
            self.promotions += entry is not None
        return entry

    def _call(self, tier: LowerTier, method: Callable[[Sequence[ChunkKey]], _T], keys: Sequence[ChunkKey]) -> Optional[_T]:
        """A tier call that cannot raise into the engine (tiers promise not to; this makes sure)."""
        start = time.perf_counter()
        try:
            result = method(keys)
        except Exception:
            logger.exception("kvconnect: the %s tier raised; treating it as a miss", tier.name)
            self.meter.raised(tier.name)
            with self._counter_lock:
                self.tier_failures += 1
            return None
        self.meter.timed(tier.name, method.__name__, time.perf_counter() - start)
        if method.__name__ in ("masks", "get"):
            found = sum(r is not None for r in result)
            self.meter.found(tier.name, found, len(keys) - found)
        return result

    def release(self, entries: Sequence[Optional[PoolEntry]]) -> None:
        self.pool.release(entries)

    def reserve(self, n: int) -> list[int]:
        return self.pool.reserve(n)

    def commit(self, key: ChunkKey, header: chunk_format.ChunkHeader, slot: int) -> PoolEntry:
        """Publish a written slot and queue the chunk for every lower tier (never blocks)."""
        entry = self.pool.commit(key, header, slot)
        self._queue(key, len(self.writers))
        return entry

    def _queue(self, key: ChunkKey, level: int) -> None:
        """Queue ``key`` for the lower tiers above ``level`` (none for a replica)."""
        if self.writes_shared:
            for writer in self.writers[:level]:
                writer.submit(key)

    def abort(self, slots: Sequence[int]) -> None:
        self.pool.abort(slots)

    def drop(self, key: ChunkKey) -> None:
        """Forget a chunk found unusable, in every tier."""
        with self._counter_lock:
            self.corrupt_chunks += 1
        self.pool.remove(key)
        for writer in self.writers:
            writer.submit_delete(key)

    def export_chunk(self, key: ChunkKey) -> Optional[bytes]:
        (entry,) = self.pool.acquire([key])
        if entry is None:
            for tier in self.tiers:
                fetched = self._call(tier, tier.get, [key]) if tier.healthy() else None
                if fetched and fetched[0] is not None:
                    return bytes(fetched[0])
            return None
        try:
            payload = self.pool.entry_view(entry).numpy()
            return chunk_format.encode(entry.header, payload)
        finally:
            self.pool.release([entry])

    def import_chunk(self, data, key: ChunkKey) -> bool:
        """Verify encoded bytes against this layout and ``key`` and insert them into the pool.

        Raises CorruptChunkError (nothing inserted) when any check fails; returns False
        when the pool has no slot to spare.
        """
        header, payload = chunk_format.decode(data, fingerprint=self.fingerprint, key=key)
        if header.payload_bytes > self.pool.slot_bytes:
            raise CorruptChunkError(f"chunk payload of {header.payload_bytes} bytes exceeds the layout's largest chunk")
        slots = self.pool.reserve(1)
        if not slots:
            return False
        view = self.pool.slot_view(slots[0])[: header.payload_bytes]
        view.numpy()[:] = memoryview(payload)
        self.pool.commit(key, header, slots[0])
        self._queue(key, len(self.writers))
        return True

    # -- lifecycle and stats -----------------------------------------------------------
    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every chunk committed so far reached (or failed to reach) each lower tier."""
        return all([w.flush(timeout_s) for w in self.writers])

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush the write-behind queues (up to ``timeout_s`` each), stop them, close the tiers."""
        for writer in self.writers:
            if not writer.close(timeout_s):
                logger.warning("kvconnect: %s tier writes still queued at close were dropped", writer.tier.name)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("kvconnect: closing the %s tier failed", tier.name)

    def tier_stats(self) -> dict:
        """Counters per lower tier (the tier's own and its writer's) and of promotion."""
        return {
            "promotions": self.promotions,
            "promotion_failures": self.promotion_failures,
            "tier_failures": self.tier_failures,
            "tiers": [{**t.stats().as_dict(), "writer": vars(w.stats())} for t, w in zip(self.tiers, self.writers)],
        }
