"""StorageManager: the one object the engine asks for chunks, whatever tier holds them.

Today it fronts the CPU pool; lower tiers (disk, remote) plug in behind it without the
engine changing. Contract used by the engine:

    masks(keys)              -> group mask per key (None = miss), cheapest tier first
    acquire(keys)            -> pinned pool entries (promoting from lower tiers), release()
    reserve(n) / commit / abort   write path into the pool
    export_chunk(key)        -> the canonical encoded bytes (header + checksum + payload)
    import_chunk(data, ...)  verify and insert encoded bytes (a corrupt chunk is refused)
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from .. import chunk_format
from ..errors import CorruptChunkError
from ..spec import ChunkKey, Fingerprint
from .pool import ChunkPool, PoolEntry

logger = logging.getLogger(__name__)


class StorageManager:
    def __init__(self, pool: ChunkPool, fingerprint: Fingerprint) -> None:
        self.pool = pool
        self.fingerprint = fingerprint
        self.corrupt_chunks = 0

    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        return self.pool.masks(keys)

    def acquire(self, keys: Sequence[ChunkKey]) -> list[Optional[PoolEntry]]:
        return self.pool.acquire(keys)

    def release(self, entries: Sequence[Optional[PoolEntry]]) -> None:
        self.pool.release(entries)

    def reserve(self, n: int) -> list[int]:
        return self.pool.reserve(n)

    def commit(self, key: ChunkKey, header: chunk_format.ChunkHeader, slot: int) -> PoolEntry:
        return self.pool.commit(key, header, slot)

    def abort(self, slots: Sequence[int]) -> None:
        self.pool.abort(slots)

    def drop(self, key: ChunkKey) -> None:
        """Forget a chunk found unusable, in every tier."""
        self.corrupt_chunks += 1
        self.pool.remove(key)

    def export_chunk(self, key: ChunkKey) -> Optional[bytes]:
        (entry,) = self.pool.acquire([key])
        if entry is None:
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
        return True
