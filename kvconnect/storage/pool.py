"""The CPU pool (L1): fixed-size slots in one host buffer, an eviction policy, reference pins.

Every chunk of a layout fits one slot (slot_bytes = the layout's largest chunk), so the
allocator cannot fragment: a free slot always fits, and when none is free the eviction
policy (eviction.py: S3-FIFO by default, 2Q or LRU) names an *unpinned* entry to evict. A pinned entry (being read or written) is never
evicted or reused; when every slot is pinned, ``reserve`` returns fewer slots than asked
and the caller skips those chunks. Nothing ever spins or waits.

Use, in order:
    slots = pool.reserve(n)                      # writer owns these slots
    ... gather rows into pool.slot_view(slot) ...
    pool.commit(key, header, slot) / pool.abort([slot])
    entries = pool.acquire(keys)                 # readers pin entries (None = miss); touch=False
                                                 # pins without counting a use (write-behind)
    ... scatter rows from pool.entry_view(e) ...
    pool.release(entries)
    pool.demote(keys)                            # known to be worth less (parts.py: a prefix
                                                 # chunk no restore point reaches): evicted first

Thread-safe: one lock guards the index; bytes move outside it, protected by the pins.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..chunks.chunk_format import ChunkHeader
from ..layout.spec import ChunkKey
from .eviction import DEFAULT_POLICY, make_policy
from .host_memory import allocate, prefault_in_background

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PoolEntry:
    key: ChunkKey
    header: ChunkHeader
    slot: int
    refs: int = 0
    live: bool = True  # False once replaced or evicted while pinned: freed at last release


@dataclass
class PoolStats:
    num_slots: int = 0
    slot_bytes: int = 0
    used_slots: int = 0
    evictions: int = 0
    reserve_shortfalls: int = 0
    commits: int = 0
    demotions: int = 0
    extra: dict = field(default_factory=dict)


def notify_evicted(listeners: Sequence[Callable], victims: Sequence) -> None:
    """Tell every eviction listener about every victim; a failing listener never breaks a pool."""
    for victim in victims:
        for callback in listeners:
            try:
                callback(victim)
            except Exception:
                logger.exception("kvconnect: pool eviction listener failed")


class SlotViews:
    """Byte views of slots and entries, for any pool that defines ``buffer``, ``slot_bytes``
    and ``slot_offset`` (the private ChunkPool and the cache server's shared pool)."""

    def slot_view(self, slot: int) -> torch.Tensor:
        start = self.slot_offset(slot)
        return self.buffer[start : start + self.slot_bytes]

    def entry_view(self, entry: PoolEntry) -> torch.Tensor:
        start = self.slot_offset(entry.slot)
        return self.buffer[start : start + entry.header.payload_bytes]


class ChunkPool(SlotViews):
    shared = False  # this engine's own: see pool_protocol.Pool

    def __init__(self, capacity_bytes: int, slot_bytes: int, *, pin_memory: bool = False,
                 eviction: str = DEFAULT_POLICY, prefault: bool = False,
                 what: str = "max_local_cpu_size (LMCACHE_MAX_LOCAL_CPU_SIZE)") -> None:
        """A pool of ``capacity_bytes`` cut into ``slot_bytes`` slots.

        Raises ConfigError (naming ``what``, the setting that sized it) when this host
        cannot hold the pool.
        """
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = max(0, capacity_bytes // slot_bytes)
        self.buffer = allocate(self.num_slots * slot_bytes, pin_memory=pin_memory,
                               what=f"{what} = {capacity_bytes / (1 << 30):g} GB")
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._entries: dict[ChunkKey, PoolEntry] = {}  # eviction order is the policy's
        self._policy = make_policy(eviction, self.num_slots)
        self._demoted: "OrderedDict[ChunkKey, None]" = OrderedDict()  # out of the policy, evicted first
        self.eviction = self._policy.name
        self._lock = threading.Lock()
        self._stats = PoolStats(num_slots=self.num_slots, slot_bytes=slot_bytes)
        self.on_evict: list[Callable[[PoolEntry], None]] = []
        # pages mapped ahead of the first store (host_memory.py); None when off or unavailable
        self.prefault = prefault_in_background(self.buffer) if prefault and self.num_slots else None

    # -- readers ---------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        """Group mask of each key's entry, None where absent (not a use: no eviction touch)."""
        with self._lock:
            return [(e.header.group_mask if (e := self._entries.get(k)) is not None else None) for k in keys]

    def acquire(self, keys: Sequence[ChunkKey], *, touch: bool = True) -> list[Optional[PoolEntry]]:
        """Pin each present entry (and, with ``touch``, count a use); None where absent."""
        out: list[Optional[PoolEntry]] = []
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    e.refs += 1
                    if touch:
                        if k in self._demoted:  # used after all: back under the policy
                            del self._demoted[k]
                            self._policy.insert(k)
                        self._policy.access(k)
                out.append(e)
        return out

    def release(self, entries: Sequence[Optional[PoolEntry]]) -> None:
        with self._lock:
            for e in entries:
                if e is None:
                    continue
                if e.refs <= 0:
                    raise AssertionError(f"release of an unpinned pool entry (slot {e.slot})")
                e.refs -= 1
                if e.refs == 0 and not e.live:
                    self._free.append(e.slot)

    # -- writers ---------------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """Up to ``n`` slots owned by the caller, evicting unpinned entries as the policy says."""
        evicted: list[PoolEntry] = []
        with self._lock:
            slots: list[int] = []
            while len(slots) < n:
                if self._free:
                    slots.append(self._free.pop())
                    continue
                key = self._demoted_victim()
                if key is None:
                    key = self._policy.victim(self._is_pinned)
                if key is None:
                    self._stats.reserve_shortfalls += 1
                    break
                victim = self._entries.pop(key)
                victim.live = False
                self._stats.evictions += 1
                evicted.append(victim)
                slots.append(victim.slot)
        notify_evicted(self.on_evict, evicted)
        return slots

    def commit(self, key: ChunkKey, header: ChunkHeader, slot: int) -> PoolEntry:
        """Publish a written slot under ``key``, replacing an older entry (freed when unpinned)."""
        if header.payload_bytes > self.slot_bytes:
            raise ValueError(f"payload of {header.payload_bytes} bytes exceeds the {self.slot_bytes}-byte slot")
        entry = PoolEntry(key=key, header=header, slot=slot)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                old.live = False
                if old.refs == 0:
                    self._free.append(old.slot)
                if key in self._demoted:  # rewritten: worth keeping again
                    del self._demoted[key]
                    self._policy.insert(key)
            else:
                self._policy.insert(key)  # a replaced key keeps its place and counts
            self._entries[key] = entry
            self._stats.commits += 1
        return entry

    def abort(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def remove(self, key: ChunkKey) -> bool:
        """Drop an entry (e.g. found corrupt); its slot is freed once unpinned."""
        with self._lock:
            e = self._entries.pop(key, None)
            if e is None:
                return False
            if key in self._demoted:
                del self._demoted[key]
            else:
                self._policy.remove(key)
            e.live = False
            if e.refs == 0:
                self._free.append(e.slot)
            return True

    def close(self) -> None:
        """The owner is done with the pool: stop populating its pages and forget every chunk."""
        if self.prefault is not None:
            self.prefault.stop()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            for e in self._entries.values():
                e.live = False
                if e.refs == 0:
                    self._free.append(e.slot)
            self._entries.clear()
            self._policy.clear()
            self._demoted.clear()

    def demote(self, keys: Sequence[ChunkKey]) -> int:
        """Make present entries the first to be evicted (the caller knows no lookup can use them
        now); a later use or rewrite puts them back under the policy. Returns how many moved."""
        moved = 0
        with self._lock:
            for k in keys:
                if k in self._entries and k not in self._demoted:
                    self._policy.remove(k)
                    self._demoted[k] = None
                    moved += 1
            self._stats.demotions += moved
        return moved

    def reinstate(self, keys: Sequence[ChunkKey]) -> None:
        """Put demoted entries back under the policy (a store made them reachable again); not a use."""
        with self._lock:
            for k in keys:
                if k in self._demoted:
                    del self._demoted[k]
                    self._policy.insert(k)

    def _demoted_victim(self) -> Optional[ChunkKey]:
        """The oldest demoted unpinned key, forgotten; None when there is none."""
        for k in self._demoted:
            if not self._is_pinned(k):
                del self._demoted[k]
                return k
        return None

    def _is_pinned(self, key: ChunkKey) -> bool:
        return self._entries[key].refs > 0

    # -- views and stats -------------------------------------------------------------
    def slot_offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> PoolStats:
        with self._lock:
            s = PoolStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})
            s.used_slots = self.num_slots - len(self._free)
            s.extra = {"pinned": sum(1 for e in self._entries.values() if e.refs)}
            return s
