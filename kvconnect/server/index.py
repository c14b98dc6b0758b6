"""The cache server's state: entries over page runs, eviction order, pins and reservations per client.

Pure bookkeeping, single-threaded (the server's loop owns it); no byte of chunk payload
is touched here. Every pin and reservation belongs to one client id and is released when
that client says ``bye`` or its lease lapses (no request for ``lease_s``), so a worker
killed mid-operation can never hold pages forever.

An entry's run is reused only when it is neither live nor pinned: eviction and replacement
mark it dead, and the last release frees the pages (a reader keeps what it acquired).

Which unpinned entry is evicted is the CPU pool's policy (kvconnect/storage/eviction.py,
``KVCONNECT_EVICTION``, S3-FIFO by default): engines sharing a node see the same prefix traffic
a private pool does. The policy's capacity (in entries) is recomputed at each new client: pages
/ the longest run among the clients registered then.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..storage.eviction import DEFAULT_POLICY, make_policy
from .allocator import PageAllocator

MAX_CLIENTS = 4096  # sessions at once: a flood of hellos cannot grow the server without bound
MAX_CLIENTS_PER_PRINCIPAL = 1024  # one peer (uid, or the token's holders) cannot take every session

STATS_FIELDS = (
    "num_pages", "page_bytes", "used_pages", "num_entries", "pinned_entries", "reserved_runs", "num_clients",
    "evictions", "reserve_shortfalls", "commits", "expired_clients", "refused_requests", "namespace_entries",
    "refused_peers", "refused_sessions",
)


class RequestError(ValueError):
    """A well-formed request that this state refuses (unknown slot, oversized payload, ...)."""


@dataclass(eq=False)
class Entry:
    entry_id: int
    key: bytes
    header: list  # the validated wire header, sent back verbatim to readers
    fingerprint: bytes
    first_page: int
    num_pages: int
    refs: int = 0
    live: bool = True


@dataclass(eq=False)
class ClientState:
    client_id: bytes
    pid: int
    fingerprint: Optional[bytes]
    slot_bytes: int
    run_pages: int
    last_seen_s: float
    principal: str  # who said hello (admission.Gate): only that peer may use this session
    pins: Counter = field(default_factory=Counter)  # entry_id -> pins held
    reserved: set = field(default_factory=set)  # first pages of runs handed out, not yet committed


class CacheIndex:
    def __init__(self, num_pages: int, page_bytes: int, *, lease_s: float, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS, max_clients_per_principal: int = MAX_CLIENTS_PER_PRINCIPAL,
                 eviction: str = DEFAULT_POLICY) -> None:
        self.page_bytes = page_bytes
        self.max_clients = max_clients
        self.max_clients_per_principal = max_clients_per_principal
        self.principal_sessions: Counter = Counter()
        self.lease_s = lease_s
        self.clock = clock
        self.allocator = PageAllocator(num_pages)
        self.entries: dict[bytes, Entry] = {}  # live entries (eviction order is the policy's)
        self._policy = make_policy(eviction, num_pages)
        self.eviction = self._policy.name
        self.by_id: dict[int, Entry] = {}  # live entries and dead ones still pinned
        self.clients: dict[bytes, ClientState] = {}
        self.namespace_counts: Counter = Counter()
        self.counters: Counter = Counter()
        self._next_id = 1

    # -- clients ---------------------------------------------------------------------
    def hello(self, client_id: bytes, pid: int, fingerprint: Optional[bytes], slot_bytes: int, *,
              principal: str = "self") -> ClientState:
        """Register a client (or refresh one that says hello again with the same layout).

        ``principal``: the peer saying hello (admission.Gate); its sessions are bounded by
        ``max_clients_per_principal``, and only it may use this client id afterwards.
        """
        old = self.clients.get(client_id)
        if old is not None and old.principal != principal:
            raise RequestError("this client id belongs to another peer")
        if old is not None and (old.slot_bytes, old.fingerprint) != (slot_bytes, fingerprint):
            self.drop_client(old)
            old = None
        if old is not None:
            old.last_seen_s = self.clock()
            return old
        if len(self.clients) >= self.max_clients:
            raise RequestError(f"{self.max_clients} client sessions are open; try again after some expire")
        if self.principal_sessions[principal] >= self.max_clients_per_principal:
            self.counters["refused_sessions"] += 1
            raise RequestError(f"this peer ({principal}) holds {self.max_clients_per_principal} sessions, its limit; "
                               "try again after some expire")
        run_pages = -(-slot_bytes // self.page_bytes)
        state = ClientState(client_id, pid, fingerprint, slot_bytes, run_pages, self.clock(), principal)
        self.clients[client_id] = state
        self.principal_sessions[principal] += 1
        self._resize_policy()
        return state

    def touch(self, client_id: bytes, principal: str = "self") -> Optional[ClientState]:
        """The session of ``client_id``, its lease renewed; None when unknown; RequestError when
        another peer than the one that said hello uses it."""
        state = self.clients.get(client_id)
        if state is not None:
            if state.principal != principal:
                raise RequestError("this client id belongs to another peer")
            state.last_seen_s = self.clock()
        return state

    def drop_client(self, state: ClientState) -> None:
        """Release every pin and reservation of ``state`` and forget it."""
        for entry_id, count in state.pins.items():
            entry = self.by_id.get(entry_id)
            if entry is not None:
                entry.refs -= count
                self._maybe_free(entry)
        for first_page in state.reserved:
            self.allocator.free(first_page, state.run_pages)
        state.pins.clear()
        state.reserved.clear()
        if self.clients.pop(state.client_id, None) is not None:
            self.principal_sessions[state.principal] -= 1
            if not self.principal_sessions[state.principal]:
                del self.principal_sessions[state.principal]

    def expire(self) -> list[bytes]:
        """Drop clients silent for longer than the lease; returns their ids."""
        deadline = self.clock() - self.lease_s
        gone = [c for c in self.clients.values() if c.last_seen_s < deadline]
        for state in gone:
            self.drop_client(state)
        self.counters["expired_clients"] += len(gone)
        return [c.client_id for c in gone]

    # -- readers ---------------------------------------------------------------------
    def masks(self, keys: list) -> list:
        return [(e.header[4] if (e := self.entries.get(k)) is not None else None) for k in keys]

    def acquire(self, state: ClientState, keys: list, budget_bytes: int) -> list:
        """Pin and touch each present entry: [entry_id, first_page, header] or None per key.

        Stops early (a shorter list) before the reply would exceed ``budget_bytes``; the
        client asks again for the rest.
        """
        out: list = []
        used = 0
        for k in keys:
            e = self.entries.get(k)
            cost = 16 + (_header_bytes(e.header) if e is not None else 0)
            if out and used + cost > budget_bytes:
                break
            used += cost
            if e is None:
                out.append(None)
                continue
            e.refs += 1
            state.pins[e.entry_id] += 1
            self._policy.access(k)
            out.append([e.entry_id, e.first_page, e.header])
        return out

    def release(self, state: ClientState, entry_ids: list) -> int:
        """Drop one pin per id; ids this client does not hold are ignored (and counted)."""
        released = 0
        for entry_id in entry_ids:
            if state.pins.get(entry_id, 0) <= 0:
                self.counters["bad_releases"] += 1
                continue
            state.pins[entry_id] -= 1
            if not state.pins[entry_id]:
                del state.pins[entry_id]
            entry = self.by_id[entry_id]
            entry.refs -= 1
            self._maybe_free(entry)
            released += 1
        return released

    # -- writers ---------------------------------------------------------------------
    def reserve(self, state: ClientState, n: int) -> tuple[list[int], list[Entry]]:
        """Up to ``n`` runs of the client's run length, evicting unpinned entries as the policy says.

        Returns (first pages, evicted entries lying wholly inside the returned runs: their
        bytes are intact until this client writes, so it may still read them).
        """
        slots: list[int] = []
        evicted: list[Entry] = []
        run = state.run_pages
        if run > self.allocator.num_pages:
            self.counters["reserve_shortfalls"] += 1
            return slots, evicted
        while len(slots) < n:
            first = self.allocator.alloc(run)
            while first is None:
                key = self._policy.victim(self._is_pinned)
                if key is None:
                    break
                victim = self.entries[key]
                self._kill(victim)
                self.counters["evictions"] += 1
                evicted.append(victim)
                first = self.allocator.alloc(run)
            if first is None:
                self.counters["reserve_shortfalls"] += 1
                break
            slots.append(first)
            state.reserved.add(first)
        inside = [v for v in evicted if any(s <= v.first_page and v.first_page + v.num_pages <= s + run for s in slots)]
        return slots, inside

    def commit(self, state: ClientState, key: bytes, header: list, first_page: int) -> int:
        """Publish a reserved run under ``key``; returns the new entry id.

        A refused commit of a reserved run gives the run back: the client has let go of
        that slot either way (commits may be sent without waiting for the reply).
        """
        if first_page not in state.reserved:
            raise RequestError(f"slot {first_page} is not reserved by this client")
        problem = None
        if header[1] != key:
            problem = "header key differs from the key committed"
        elif state.fingerprint is not None and header[0] != state.fingerprint:
            problem = "header fingerprint differs from the client's layout"
        elif header[6] > state.slot_bytes:
            problem = f"payload of {header[6]} bytes exceeds the client's {state.slot_bytes}-byte slot"
        state.reserved.discard(first_page)
        if problem is not None:
            self.allocator.free(first_page, state.run_pages)
            raise RequestError(problem)
        old = self.entries.get(key)
        if old is not None:
            self._kill(old)
        entry = Entry(self._next_id, key, header, header[0], first_page, state.run_pages)
        self._next_id += 1
        self.entries[key] = entry
        self._policy.insert(key)
        self.by_id[entry.entry_id] = entry
        self.namespace_counts[entry.fingerprint] += 1
        self.counters["commits"] += 1
        return entry.entry_id

    def abort(self, state: ClientState, slots: list) -> int:
        aborted = 0
        for first_page in slots:
            if first_page in state.reserved:
                state.reserved.discard(first_page)
                self.allocator.free(first_page, state.run_pages)
                aborted += 1
        return aborted

    def remove(self, key: bytes) -> bool:
        entry = self.entries.get(key)
        if entry is None:
            return False
        self._kill(entry)
        return True

    def clear(self, fingerprint: Optional[bytes]) -> int:
        victims = [e for e in self.entries.values() if fingerprint is None or e.fingerprint == fingerprint]
        for entry in victims:
            self._kill(entry)
        return len(victims)

    # -- internals -------------------------------------------------------------------
    def _kill(self, entry: Entry) -> None:
        """Unpublish ``entry``; its pages return once no reader holds it."""
        del self.entries[entry.key]
        self._policy.remove(entry.key)  # a victim is already forgotten: no-op then
        entry.live = False
        self.namespace_counts[entry.fingerprint] -= 1
        if not self.namespace_counts[entry.fingerprint]:
            del self.namespace_counts[entry.fingerprint]
        self._maybe_free(entry)

    def _is_pinned(self, key: bytes) -> bool:
        return self.entries[key].refs > 0

    def _resize_policy(self) -> None:
        longest = max((c.run_pages for c in self.clients.values()), default=1)
        self._policy.resize(max(1, self.allocator.num_pages // max(1, longest)))

    def _maybe_free(self, entry: Entry) -> None:
        if entry.refs == 0 and not entry.live:
            self.allocator.free(entry.first_page, entry.num_pages)
            self.by_id.pop(entry.entry_id, None)

    def stats(self, fingerprint: Optional[bytes]) -> list[int]:
        values = {
            "num_pages": self.allocator.num_pages,
            "page_bytes": self.page_bytes,
            "used_pages": self.allocator.num_pages - self.allocator.free_pages,
            "num_entries": len(self.entries),
            "pinned_entries": sum(1 for e in self.by_id.values() if e.refs),
            "reserved_runs": sum(len(c.reserved) for c in self.clients.values()),
            "num_clients": len(self.clients),
            "namespace_entries": self.namespace_counts.get(fingerprint, 0) if fingerprint is not None else len(self.entries),
        }
        return [int(values.get(name, self.counters.get(name, 0))) for name in STATS_FIELDS]


def _header_bytes(header: list) -> int:
    """Upper bound of a header's msgpack size (fixed fields + the plane rows blob)."""
    return 96 + len(header[5])
