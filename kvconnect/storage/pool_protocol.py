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

A ``PoolFactory`` makes an engine's pool once it knows its slot size: ``private_pool``
here, or ``kvconnect.server.make_pool``, which gives the node server's shared pool when
``Config.server_url`` is set (the adapters pass it; the core never imports the server).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch

from ..chunks.chunk_format import ChunkHeader
from ..config import Config
from ..errors import ConfigError
from ..layout.spec import ChunkKey, Fingerprint
from .pool import ChunkPool, PoolEntry, PoolStats


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


class PoolFactory(Protocol):
    def __call__(self, config: Config, slot_bytes: int, *, pin_memory: bool,
                 fingerprint: Optional[Fingerprint] = None) -> Pool: ...


def private_pool(config: Config, slot_bytes: int, *, pin_memory: bool, fingerprint: Optional[Fingerprint] = None) -> ChunkPool:
    """A ``ChunkPool`` of ``config.private_pool_bytes`` (with ``local_cpu`` false: only the
    buffer the lower tiers go through, 0 without one, as in LMCache). Raises ConfigError when
    ``config.server_url`` names a node server: the engine was given this factory in place of the
    default one that reaches the server, and a private pool would silently share nothing."""
    if config.server_url:
        raise ConfigError(f"server_url ({config.server_url}) is set but this engine was given pool_factory=private_pool: "
                          "leave pool_factory at its default (kvconnect.server.make_pool), which reaches the server")
    return ChunkPool(config.private_pool_bytes, slot_bytes, pin_memory=pin_memory, eviction=config.eviction,
                     prefault=config.pool_prefault)
