"""Eviction policies of the CPU pool: which unpinned entry gives up its slot.

The pool (pool.py) owns entries, slots and pins; a policy only orders keys. The pool calls,
always under its own lock (policies are not thread-safe on their own):

    policy.insert(key)            a new key was committed
    policy.access(key)            a reader used the key (a lookup hit or a retrieve)
    policy.remove(key)            the key left the pool for another reason (replaced, dropped, cleared)
    policy.victim(is_pinned)      -> the key to evict, already forgotten by the policy; None when
                                     every key is pinned. Never returns a key for which
                                     ``is_pinned(key)`` is true.
    policy.resize(capacity)       the store now holds about ``capacity`` keys (the node server,
                                     whose entries' sizes depend on its clients' layouts)

Every operation is O(1), ``victim`` amortised: a pinned key met at the eviction point is
rotated past (at most one pass over the keys per call), a frequency bit is paid for by the
access that set it. Policies (``KVCONNECT_EVICTION``):

- ``lru``: least recently used first. Cyclic prefix traffic over a pool smaller than its
  working set evicts every prefix just before its next use (0 hits), and one long prompt of
  unique tokens flushes the whole pool.
- ``2q`` (Johnson & Shasha, VLDB'94): new keys enter a FIFO (a quarter of the pool); keys
  evicted from it are remembered in a ghost list (half the pool's keys); a key stored again
  while remembered enters the main LRU. Scan resistant, not frequency aware within the main part.
- ``arc`` (Megiddo & Modha, FAST'03): a recency list (keys used once) and a frequency list
  (keys used again), each with a ghost list; a key stored again while in a ghost list moves
  the target split towards the list that lost it. Scan resistant and self-tuning: it grows
  the recency part back to LRU when reuses come from there (a conversation's next turn).
- ``s3fifo`` (Yang et al., SOSP'23): a small FIFO (a tenth of the pool) filters one-hit wonders
  (unique prompt suffixes); a key accessed while there, or stored again while in the ghost
  list, moves to the main FIFO, where each access buys one more pass (2-bit counter). Scan
  resistant and frequency aware; the default (benchmarks/eviction.py, docs/performance.md):
  the only one that keeps part of a cycle longer than the pool, best or tied on skewed and
  scan traces. Weak on a first reuse farther away than its small FIFO (a conversation's next
  turn after many other requests): ``2q`` or ``lru`` serve that pattern better.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional, Protocol

POLICIES = ("s3fifo", "arc", "2q", "lru")
DEFAULT_POLICY = "s3fifo"

IsPinned = Callable[[Hashable], bool]


class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: Hashable) -> None: ...
    def access(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def victim(self, is_pinned: IsPinned) -> Optional[Hashable]: ...
    def resize(self, capacity: int) -> None: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` for a pool of ``capacity`` slots (ValueError if unknown)."""
    if name == "lru":
        return LRU()
    if name == "2q":
        return TwoQ(capacity)
    if name == "s3fifo":
        return S3FIFO(capacity)
    if name == "arc":
        return ARC(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")


def _remember(ghost: "OrderedDict[Hashable, None]", key: Hashable, limit: int) -> None:
    """Add an evicted key to a ghost FIFO, forgetting its oldest key past ``limit``."""
    ghost[key] = None
    if len(ghost) > limit:
        ghost.popitem(last=False)


def _pop_unpinned(queue: "OrderedDict[Hashable, object]", is_pinned: IsPinned) -> Optional[Hashable]:
    """Remove and return the oldest unpinned key of ``queue``; pinned ones met are rotated to
    the back (at most one pass). None when every key is pinned."""
    for _ in range(len(queue)):
        key, value = queue.popitem(last=False)
        if not is_pinned(key):
            return key
        queue[key] = value
    return None


class LRU:
    """Least recently used first (insert and access move a key to the back)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, is_pinned: IsPinned) -> Optional[Hashable]:
        # pinned keys stay in place (rotating them would make them look recently used)
        for key in self._order:
            if not is_pinned(key):
                del self._order[key]
                return key
        return None

    def resize(self, capacity: int) -> None:
        return  # LRU has no capacity-dependent part

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)


class TwoQ:
    """2Q: FIFO probation (A1in), ghost keys (A1out), LRU main part (Am)."""

    name = "2q"

    def __init__(self, capacity: int, in_fraction: float = 0.25, ghost_fraction: float = 0.5) -> None:
        self._fractions = (in_fraction, ghost_fraction)
        self.resize(capacity)
        self._in: "OrderedDict[Hashable, None]" = OrderedDict()
        self._main: "OrderedDict[Hashable, None]" = OrderedDict()
        self._ghost: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self._in or key in self._main:
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None  # stored again while remembered: a re-used key
        else:
            self._in[key] = None

    def resize(self, capacity: int) -> None:
        self.in_target = max(1, int(capacity * self._fractions[0]))
        self.ghost_limit = max(1, int(capacity * self._fractions[1]))

    def access(self, key: Hashable) -> None:
        if key in self._main:
            self._main.move_to_end(key)
        # a key in A1in is not moved: its first references are correlated

    def remove(self, key: Hashable) -> None:
        self._in.pop(key, None)
        self._main.pop(key, None)

    def victim(self, is_pinned: IsPinned) -> Optional[Hashable]:
        if len(self._in) > self.in_target or not self._main:
            key = _pop_unpinned(self._in, is_pinned)
            if key is not None:
                _remember(self._ghost, key, self.ghost_limit)
                return key
        for key in self._main:
            if not is_pinned(key):
                del self._main[key]
                return key
        key = _pop_unpinned(self._in, is_pinned)  # main all pinned: take from A1in after all
        if key is not None:
            _remember(self._ghost, key, self.ghost_limit)
        return key

    def clear(self) -> None:
        self._in.clear()
        self._main.clear()
        self._ghost.clear()

    def __len__(self) -> int:
        return len(self._in) + len(self._main)


class S3FIFO:
    """S3-FIFO: small FIFO, main FIFO with a 2-bit access counter, ghost FIFO of keys."""

    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        self._small_fraction = small_fraction
        self.resize(capacity)
        self._small: "OrderedDict[Hashable, None]" = OrderedDict()
        self._main: "OrderedDict[Hashable, None]" = OrderedDict()
        self._ghost: "OrderedDict[Hashable, None]" = OrderedDict()
        self._freq: dict[Hashable, int] = {}

    def resize(self, capacity: int) -> None:
        self.small_target = max(1, int(capacity * self._small_fraction))
        self.ghost_limit = max(1, capacity)

    def insert(self, key: Hashable) -> None:
        if key in self._freq:
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None  # stored again soon after its eviction: worth keeping
        else:
            self._small[key] = None

    def access(self, key: Hashable) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < self.MAX_FREQ:
            self._freq[key] = freq + 1

    def remove(self, key: Hashable) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def victim(self, is_pinned: IsPinned) -> Optional[Hashable]:
        # Each step evicts, promotes a key from small to main, spends an access bit, or
        # rotates a pinned key: bounded by the keys' count and their counters.
        small_rotations = 0
        budget = (self.MAX_FREQ + 2) * (len(self._small) + len(self._main)) + 1
        for _ in range(budget):
            from_small = self._small and small_rotations < len(self._small) and (
                len(self._small) >= self.small_target or not self._main)
            if from_small:
                key, _ = self._small.popitem(last=False)
                if is_pinned(key):
                    self._small[key] = None
                    small_rotations += 1
                elif self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = None
                else:
                    del self._freq[key]
                    _remember(self._ghost, key, self.ghost_limit)
                    return key
                continue
            if not self._main:
                if self._small and small_rotations < len(self._small):
                    continue
                return None
            key, _ = self._main.popitem(last=False)
            if is_pinned(key):
                self._main[key] = None
            elif self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = None
            else:
                del self._freq[key]
                return key
        return None

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._ghost.clear()
        self._freq.clear()

    def __len__(self) -> int:
        return len(self._freq)


def _first_unpinned(queue: "OrderedDict[Hashable, None]", is_pinned: IsPinned) -> Optional[Hashable]:
    for key in queue:
        if not is_pinned(key):
            return key
    return None


class ARC:
    """Adaptive Replacement Cache: T1 (used once), T2 (used again), ghosts B1 / B2, target p."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0  # target size of T1
        self._t1: "OrderedDict[Hashable, None]" = OrderedDict()
        self._t2: "OrderedDict[Hashable, None]" = OrderedDict()
        self._b1: "OrderedDict[Hashable, None]" = OrderedDict()
        self._b2: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self._t1 or key in self._t2:
            return
        if key in self._b1:  # lost from the recency side too early: give it more room
            self.p = min(float(self.capacity), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:  # lost from the frequency side: give that side more room
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def access(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def victim(self, is_pinned: IsPinned) -> Optional[Hashable]:
        prefer_t1 = self._t1 and (len(self._t1) > self.p or not self._t2)
        order = ((self._t1, self._b1), (self._t2, self._b2))
        for live, ghost in (order if prefer_t1 else order[::-1]):
            key = _first_unpinned(live, is_pinned)
            if key is not None:
                del live[key]
                ghost[key] = None
                self._trim_ghosts()
                return key
        return None

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = min(self.p, float(self.capacity))
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * self.capacity:
            self._b2.popitem(last=False)

    def clear(self) -> None:
        for q in (self._t1, self._t2, self._b1, self._b2):
            q.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
