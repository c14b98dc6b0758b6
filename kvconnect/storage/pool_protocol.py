"""``Pool``: what the engine may ask of its CPU pool, private (``pool.ChunkPool``) or the node
cache server's shared one (``kvconnect.server.client.SharedPoolClient``).

Every object of a tier passes through a pool slot: a store reserves slots, gathers rows
into them and commits headers; a retrieve acquires (pins) entries and scatters from their
slots. In the order a caller uses them:

    masks(keys)                        -> stored group mask per key (None: absent)
    reserve(n) -> slots; commit(key, header, slot) / abort(slots)
    acquire(keys, touch=) -> entries;  release(entries)
    slot_offset(slot)                  -> byte offset of a slot in ``buffer``
    demote(keys) / reinstate(keys)     eviction hints (a shared pool ignores them)
    remove(key), clear(), close(), stats()

``shared``: other engines read this pool's entries, so ``clear`` is never this engine's to
call and a replica has no pool of its own to keep. ``on_evict``: listeners called with each
entry of this engine's layout the pool evicts.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch

from ..chunks.chunk_format import ChunkHeader
from ..layout.spec import ChunkKey
from .pool import PoolEntry, PoolStats


class Pool(Protocol):
    shared: bool
    slot_bytes: int
    num_slots: int
    buffer: torch.Tensor
    on_evict: list[Callable[[PoolEntry], None]]

    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]: ...

    def reserve(self, n: int) -> list[int]: ...

    def commit(self, key: ChunkKey, header: ChunkHeader, slot: int) -> PoolEntry: ...

    def abort(self, slots: Sequence[int]) -> None: ...

    def acquire(self, keys: Sequence[ChunkKey], *, touch: bool = True) -> list[Optional[PoolEntry]]: ...

    def release(self, entries: Sequence[Optional[PoolEntry]]) -> None: ...

    def slot_offset(self, slot: int) -> int: ...

    def demote(self, keys: Sequence[ChunkKey]) -> int: ...

    def reinstate(self, keys: Sequence[ChunkKey]) -> None: ...

    def remove(self, key: ChunkKey) -> bool: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> PoolStats: ...
