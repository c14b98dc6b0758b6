"""The contract of a lower storage tier (disk, remote store, ...) behind the CPU pool.

A tier stores encoded chunks (``chunk_format``: header + checksum + payload) under their
chunk keys, for one layout fingerprint. Every call is batched and answers per key,
because in a cache partial success is the normal case. Calls never raise for a failure
of the medium: a failed read is a miss, a failed write is ``False``, and both are counted
in ``stats()``. Methods, in the order a caller uses them:

    masks(keys)   -> group mask per key, None where absent (cheap: no payload moves)
    get(keys)     -> verified encoded chunk per key, None where absent or bad
                     (a bad entry is deleted from the tier and counted)
    read_into(key, out) -> verified header, payload written into ``out`` (e.g. a pool
                     slot), or None; tiers that can do so without an extra copy set
                     ``reads_into = True`` (the default copies from ``get``)
    read_many_into(keys, outs, on_abandoned=) -> ``read_into`` per key (a tier may batch
                     it: one call to its store for many chunks, bounded by its timeout; a
                     tier may abandon a stalled call and lend the caller's outs until it ends)
    attach_pool(pool) -> the CPU pool chunks move from and to (a tier that moves bytes
                     zero-copy registers its buffer; the default does nothing)
    put(items)    -> True per item written (header + payload; the tier encodes)
    delete(keys)  -> True per key that was present
    healthy()     -> False while the tier is known to be failing (callers may skip it)
    stats()       -> TierStats counters
    failure_counts() -> the store's own failure counters by kind (e.g. Mooncake's RPC
                     timeouts), beside ``stats().errors``; empty by default
    close()       -> release files, sockets, threads

Tiers are thread-safe: the engine's thread reads while a write-behind thread writes.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


from ..chunks import chunk_format
from ..chunks.chunk_format import ChunkHeader
from ..errors import CorruptChunkError
from ..layout.spec import ChunkKey, Fingerprint


@dataclass(frozen=True, kw_only=True)
class StoreItem:
    """One chunk to write: its header and a view of its payload. The header's checksum, when
    not 0, is the caller's, computed once over this payload for every tier (the write-behind
    does, ``writer.sealed``; the shared pool's commit does): a tier never computes it again."""

    key: ChunkKey
    header: ChunkHeader
    payload: memoryview

    def sealed_header(self) -> bytes:
        """The packed header with the checksum over header and payload filled in."""
        return self.header.pack(self.header.checksum or chunk_format.compute_checksum(self.header, self.payload))


@dataclass
class TierStats:
    """Counters of one tier; ``errors`` counts every failure that became a miss or a False."""

    name: str = ""
    lookups: int = 0
    lookup_hits: int = 0
    gets: int = 0
    get_hits: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0
    deletes: int = 0
    evictions: int = 0
    errors: int = 0
    corrupt: int = 0
    skipped_unhealthy: int = 0
    entries: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class LowerTier(abc.ABC):
    """Base of every tier below the CPU pool; see the module docstring for the contract."""

    name: str = "tier"
    reads_into: bool = False

    def __init__(self, fingerprint: Fingerprint) -> None:
        self.fingerprint = fingerprint
        self._stats = TierStats(name=self.name)
        self._stats_lock = threading.Lock()

    @abc.abstractmethod
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]: ...

    @abc.abstractmethod
    def get(self, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]: ...

    @abc.abstractmethod
    def put(self, items: Sequence[StoreItem]) -> list[bool]: ...

    @abc.abstractmethod
    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def read_into(self, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        """Verified header of ``key``'s chunk with its payload copied into ``out``; None on a miss.

        ``out`` may be partly written on a miss: the caller must not use it then.
        """
        (data,) = self.get([key])
        if data is None:
            return None
        header = copy_payload(data, out)
        if header is None:
            self._count(errors=1, corrupt=1)
        return header

    def read_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview], *,
                       on_abandoned: Optional[Callable[[list[int]], Callable[[], None]]] = None,
                       ) -> list[Optional[ChunkHeader]]:
        """``read_into`` for each key and its ``out``; a miss is None (its ``out`` unusable).

        A tier whose reads may stall past its deadline (Mooncake) stops waiting when the
        caller gives ``on_abandoned``: the outs the abandoned call may still write come back
        None after ``on_abandoned(indices)``, and the callable it returns is called once that
        call has returned. Until then those outs must not be reused. This one never abandons."""
        return [self.read_into(key, out) for key, out in zip(keys, outs)]

    def attach_pool(self, pool) -> None:
        """Chunks of ``pool`` are what this tier writes and reads into (nothing to do by default)."""

    def healthy(self) -> bool:
        return True

    def stats(self) -> TierStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def failure_counts(self) -> dict[str, int]:
        """Failures by kind, as the store reports them (cumulative); none by default."""
        return {}

    def close(self) -> None:
        pass

    # -- helpers for implementations --------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _verify(self, data, key: ChunkKey) -> bool:
        return verified(data, self.fingerprint, key)


def verified(data, fingerprint: Fingerprint, key: ChunkKey) -> bool:
    """True when ``data`` is a complete, intact chunk of this layout stored under ``key``."""
    try:
        chunk_format.decode(data, fingerprint=fingerprint, key=key)
        return True
    except CorruptChunkError:
        return False


def copy_payload(data, out: memoryview) -> Optional[ChunkHeader]:
    """The header of ``data`` (an encoded chunk ``get`` verified) with its payload copied into
    ``out``; None when the payload does not fit ``out`` (the caller counts it corrupt)."""
    header = chunk_format.decode_header(data)
    if header.payload_bytes > len(out):
        return None
    out[: header.payload_bytes] = memoryview(data).cast("B")[header.header_bytes :]
    return header


def peek_mask(data, fingerprint: Fingerprint, key: ChunkKey) -> Optional[int]:
    """Group mask from the first bytes of an encoded chunk, None unless its identity matches.

    Reads only the fixed header (magic, version, fingerprint, key): the checksum is
    verified later, when the whole chunk is read.
    """
    try:
        fp, chunk_key, mask = chunk_format.peek_identity(data)
    except CorruptChunkError:
        return None
    return mask if fp == bytes(fingerprint) and chunk_key == bytes(key) else None


def read_header(view, *, fingerprint: Fingerprint, key: ChunkKey, payload_bytes: int) -> ChunkHeader:
    """The header of a chunk whose payload (``payload_bytes`` long) is held apart from it.

    ``view`` is exactly the header's bytes. Checks magic, version, sizes and identity, the
    same checks as ``chunk_format.decode`` short of the checksum: the caller verifies it
    with ``chunk_format.compute_checksum(header, payload)`` once the payload is read.
    Raises CorruptChunkError.
    """
    header = chunk_format.decode_detached_header(view, payload_bytes=payload_bytes)
    if header.fingerprint != bytes(fingerprint) or header.key != bytes(key):
        raise CorruptChunkError("chunk belongs to another layout or key")
    return header


class Breaker:
    """Skip a failing tier for a while instead of paying its timeout on every call.

    After a failure the tier is skipped for ``retry_after_s`` (doubling per consecutive
    failure up to ``max_retry_after_s``); the first call after that probes it again.
    """

    def __init__(self, retry_after_s: float = 0.5, max_retry_after_s: float = 10.0) -> None:
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0

    def allow(self) -> bool:
        with self._lock:
            return self._failures == 0 or time.monotonic() >= self._open_until

    def success(self) -> None:
        with self._lock:
            self._failures = 0

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            backoff = min(self.max_retry_after_s, self.retry_after_s * (2 ** min(self._failures - 1, 16)))
            self._open_until = time.monotonic() + backoff

    @property
    def failing(self) -> bool:
        """Whether the last call failed (open, or about to be probed again)."""
        with self._lock:
            return self._failures > 0

    @property
    def open(self) -> bool:
        return not self.allow()
