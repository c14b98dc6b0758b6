"""``SharedPoolClient``: the node cache server's pool, with ``ChunkPool``'s API.

The engine uses it in place of ``ChunkPool`` when ``KVCONNECT_SERVER_URL`` is set (see
``kvconnect.server.make_pool``): ``buffer`` is a uint8 tensor over the server's shared
segment, slots are page numbers in it, and the engine's kernels gather into / scatter out
of it directly. Only control messages (masks, acquire/release, reserve/commit/abort) go
over the socket, each bounded by ``timeout_s``.

Failure contract (never an exception into the engine, never a wrong byte): a call that
times out or is refused counts an error and returns what an empty pool returns (misses, no
slots); the session (``session.ServerSession``: hello, heartbeat, reconnect, the mapped
segment, whose server to trust) reconnects behind, and only once the engine holds no pin and no
reservation of the old session. A heartbeat every lease/4 keeps this client's pins alive on
the server; hence the one assumption: a single gather or scatter never outlasts the lease
(default 10 s).

Checksums: ``commit`` fills in the header's XXH3 checksum over header and payload (when the
caller's header has none: a chunk promoted from a lower tier already carries the one that
tier verified), and ``acquire`` verifies it before handing an entry out, once per entry
(entries are immutable while they live). An entry whose bytes fail it (a forged or garbled
commit) is a miss, counted as ``bad_checksums``, unpinned and removed from the server, so it
cannot keep shadowing the key.

``on_evict`` listeners are called for entries of this client's layout that the server
evicted to make room for this client's ``reserve``, and only when the evicted run lies
inside a run handed to this client (its bytes are intact until the caller writes).

Pinned memory: when ``pin_memory`` is set (the layout lives on a GPU) the mapping is
page-locked with ``cudaHostRegister`` so device copies run at full speed and async;
failure leaves it pageable (logged).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..chunks.chunk_format import ChunkHeader, compute_checksum
from ..layout.spec import ChunkKey, Fingerprint
from ..storage.pool import PoolEntry, PoolStats, SlotViews, notify_evicted
from . import protocol
from .index import STATS_FIELDS
from .protocol import Limits, ProtocolError
from .session import FAILED, ServerSession
from .shm import DATA_OFFSET, SHM_DIR

logger = logging.getLogger(__name__)

_VERIFIED_ENTRIES = 1 << 16  # entry ids whose checksum this process checked (LRU beyond that)


@dataclass(eq=False)
class SharedEntry(PoolEntry):
    entry_id: int = -1
    incarnation: int = 0


class SharedPoolClient(SlotViews):
    shared = True  # other engines read its entries: see storage.pool_protocol.Pool

    def __init__(
        self,
        url: str,
        slot_bytes: int,
        *,
        token: Optional[str] = None,
        timeout_s: float = 1.0,
        pin_memory: bool = False,
        fingerprint: Optional[Fingerprint] = None,
        limits: Limits = Limits(),
        shm_dir: str = SHM_DIR,
        warn_unreachable: bool = True,
    ) -> None:
        """``warn_unreachable``: log a WARNING when the server does not answer (the first time,
        then once a minute while it lasts); False for one-shot callers that report it themselves."""
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.fingerprint = fingerprint
        self.limits = limits
        self.on_evict: list[Callable[[PoolEntry], None]] = []
        self.counters: Counter = Counter()  # errors by kind, reconnects, dropped commits
        self._reserved: set[int] = set()
        self._pins: Counter = Counter()  # entry_id -> pins the engine holds (this incarnation)
        self._verified: "OrderedDict[tuple[bytes, int], None]" = OrderedDict()  # (server instance, entry id)
        self._session = ServerSession(url, token=token, slot_bytes=slot_bytes, timeout_s=timeout_s,
                                      fingerprint=fingerprint, limits=limits, pin_memory=pin_memory, shm_dir=shm_dir,
                                      warn_unreachable=warn_unreachable, counters=self.counters,
                                      may_reconnect=lambda: not (self._reserved or self._pins))
        self.url = self._session.url
        self._lock = self._session.lock  # pins and reservations change with the session, under its lock

    @property
    def buffer(self):
        """The server's segment as a uint8 tensor (swapped when the server restarted)."""
        return self._session.buffer

    @property
    def num_slots(self) -> int:
        return self._session.num_slots

    @property
    def prefaulted(self):
        """Set once the mapping's pages are all faulted in."""
        return self._session.prefaulted

    # -- readers ---------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        """Group mask of each key's entry, None where absent (no LRU touch)."""
        out: list[Optional[int]] = []
        for batch in _batches(list(keys), self.limits.max_keys):
            result = self._session.call("masks", [batch])
            if result is FAILED or not _is_list(result, 1) or not _is_list(result[0], len(batch)) \
                    or not all(m is None or type(m) is int for m in result[0]):
                self._bad_reply(result)
                return out + [None] * (len(keys) - len(out))
            out.extend(result[0])
        return out

    def acquire(self, keys: Sequence[ChunkKey], *, touch: bool = True) -> list[Optional[SharedEntry]]:
        """Pin and touch each present entry; None where absent or unreachable (``touch`` is
        ChunkPool's: the server's own LRU index counts every acquire)."""
        keys = list(keys)
        out: list[Optional[SharedEntry]] = []
        while len(out) < len(keys):
            batch = keys[len(out) : len(out) + self.limits.max_keys]
            incarnation = self._session.incarnation
            result = self._session.call("acquire", [batch], incarnation)
            if result is FAILED or not _is_list(result, 1) or type(result[0]) is not list or not 0 < len(result[0]) <= len(batch):
                self._bad_reply(result)
                break
            bad_ids: list[int] = []
            forged: list[bytes] = []
            for key, item in zip(batch, result[0]):
                entry = self._entry_of(key, item, incarnation)
                if entry is not None and not self._checksum_ok(entry):
                    self._forget_pin(entry)
                    forged.append(bytes(key))
                    entry = None
                if entry is None and item is not None and type(item) is list and item and type(item[0]) is int:
                    bad_ids.append(item[0])  # pinned on the server but unusable here: unpin
                out.append(entry)
            if bad_ids:
                self._send_release(bad_ids, incarnation)
            for key in forged:  # else masks() keeps saying "stored" and the engine never rewrites it
                self._session.call("remove", [key], incarnation)
        return out + [None] * (len(keys) - len(out))

    def release(self, entries: Sequence[Optional[PoolEntry]]) -> None:
        ids: list[int] = []
        with self._lock:
            for e in entries:
                if e is None:
                    continue
                if not isinstance(e, SharedEntry) or e.refs <= 0:
                    raise AssertionError(f"release of an unpinned pool entry (slot {e.slot})")
                e.refs -= 1
                if e.incarnation == self._session.incarnation and self._pins[e.entry_id] > 0:
                    self._pins[e.entry_id] -= 1
                    if not self._pins[e.entry_id]:
                        del self._pins[e.entry_id]
                    ids.append(e.entry_id)
            incarnation = self._session.incarnation
        if ids:
            self._send_release(ids, incarnation)

    # -- writers ---------------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """Up to ``n`` slots (first pages of runs) owned by the caller; fewer when the pool is
        full of pinned entries or the server is unreachable."""
        slots: list[int] = []
        evicted: list[SharedEntry] = []
        while len(slots) < n:
            want = min(n - len(slots), self.limits.max_keys)
            incarnation = self._session.incarnation
            result = self._session.call("reserve", [want], incarnation)
            if result is FAILED or not _is_list(result, 2) or not _is_list(result[0], want, exact=False):
                self._bad_reply(result)
                break
            got = [s for s in result[0] if type(s) is int and 0 <= s <= self._session.num_pages - self._session.run_pages]
            if len(got) != len(result[0]):
                self._bad_reply(result)
            with self._lock:
                if incarnation != self._session.incarnation:
                    break  # reconnected meanwhile: those slots belong to a forgotten client id
                self._reserved.update(got)
            slots.extend(got)
            evicted.extend(self._evicted_of(result[1], incarnation))
            if len(result[0]) < want:
                break
        notify_evicted(self.on_evict, evicted)
        return slots

    def commit(self, key: ChunkKey, header: ChunkHeader, slot: int) -> SharedEntry:
        """Publish a written slot under ``key`` (dropped, counted, when the server is gone).

        Sent without waiting for the reply: other processes see the entry once the server
        has read it (microseconds later), this one on its next call. The returned entry
        has no server id (``entry_id`` -1) and is not pinned, like ``ChunkPool.commit``'s.
        """
        if header.payload_bytes > self.slot_bytes:
            raise ValueError(f"payload of {header.payload_bytes} bytes exceeds the {self.slot_bytes}-byte slot")
        with self._lock:
            incarnation = self._session.incarnation
            owned = slot in self._reserved
            self._reserved.discard(slot)
        if owned and not header.checksum:  # the slot is ours until committed: its bytes are final
            header = dataclasses.replace(header, checksum=compute_checksum(header, self._payload(slot, header.payload_bytes)))
        entry = SharedEntry(key=key, header=header, slot=slot, live=False, incarnation=incarnation)
        if not owned:
            self.counters["dropped_commits"] += 1
            return entry
        args = [bytes(key), protocol.header_to_wire(header), slot]
        # no wait for the reply: the server reads requests in order, so this client's next call
        # already sees the entry; a refused commit frees its run there
        if self._session.post("commit", args, incarnation):
            entry.live = True
            return entry
        result = self._session.call("commit", args, incarnation)  # queue full or disconnected: ask and wait
        if result is FAILED or not _is_list(result, 1) or type(result[0]) is not int:
            self._bad_reply(result)
            self.counters["dropped_commits"] += 1
            return entry
        entry.entry_id, entry.live = result[0], True
        return entry

    def abort(self, slots: Sequence[int]) -> None:
        with self._lock:
            incarnation = self._session.incarnation
            mine = [s for s in slots if s in self._reserved]
            self._reserved.difference_update(mine)
        for batch in _batches(mine, self.limits.max_keys):
            self._session.call("abort", [batch], incarnation)

    def remove(self, key: ChunkKey) -> bool:
        """Drop an entry (e.g. found corrupt); its pages are freed once no reader holds it."""
        result = self._session.call("remove", [bytes(key)])
        return _is_list(result, 1) and result[0] is True

    def clear(self) -> None:
        """Drop every entry of this client's layout (every entry when no fingerprint is set)."""
        self._session.call("clear", [None if self.fingerprint is None else bytes(self.fingerprint)])

    def demote(self, keys: Sequence[ChunkKey]) -> int:
        """No eviction hints to the server: its LRU serves every engine's prompts. Moves none."""
        return 0

    def reinstate(self, keys: Sequence[ChunkKey]) -> None:
        """See ``demote``: nothing was demoted."""

    # -- views and stats -------------------------------------------------------------
    def slot_offset(self, slot: int) -> int:
        return DATA_OFFSET + slot * self._session.page_bytes

    def server_stats(self) -> Optional[dict[str, int]]:
        """The server's counters (see ``index.STATS_FIELDS``), None when unreachable."""
        result = self._session.call("stats", [])
        if not _is_list(result, 1) or not _is_list(result[0], len(STATS_FIELDS)) or not all(type(v) is int for v in result[0]):
            return None
        return dict(zip(STATS_FIELDS, result[0]))

    def __len__(self) -> int:
        server = self.server_stats()
        return server["namespace_entries"] if server else 0

    def stats(self) -> PoolStats:
        server = self.server_stats() or {}
        with self._lock:
            pinned = sum(1 for v in self._pins.values() if v)
            extra: dict[str, Any] = {"pinned": pinned, "connected": self._session.connected, "client": dict(self.counters), "server": server}
        used_pages = server.get("used_pages", 0)
        return PoolStats(
            num_slots=self.num_slots, slot_bytes=self.slot_bytes, used_slots=-(-used_pages // self._session.run_pages),
            evictions=server.get("evictions", 0), reserve_shortfalls=server.get("reserve_shortfalls", 0),
            commits=server.get("commits", 0), extra=extra,
        )

    @property
    def connected(self) -> bool:
        return self._session.connected

    @property
    def page_locked(self) -> bool:
        """True when the mapping is registered with CUDA (cudaHostRegister)."""
        return self._session.page_locked

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat, say bye (frees this client's pins at once), unmap."""
        self._session.close()

    # -- helpers ---------------------------------------------------------------------
    def _entry_of(self, key: bytes, item: Any, incarnation: int) -> Optional[SharedEntry]:
        """A pinned entry from an acquire reply item, or None (miss or unusable)."""
        if item is None:
            return None
        try:
            if type(item) is not list or len(item) != 3 or type(item[0]) is not int or type(item[1]) is not int:
                raise ProtocolError("acquire item is [entry_id, slot, header]")
            header = protocol.header_from_wire(protocol.check_header(item[2], self.limits))
            run_pages = -(-header.payload_bytes // self._session.page_bytes)
            if header.key != key or (self.fingerprint is not None and header.fingerprint != self.fingerprint):
                raise ProtocolError("entry stored under another key or layout")
            if header.payload_bytes > self.slot_bytes or item[1] + run_pages > self._session.num_pages:
                raise ProtocolError("entry does not fit this layout's slot or the segment")
        except ProtocolError:
            self.counters["bad_entries"] += 1
            return None
        with self._lock:
            if incarnation != self._session.incarnation:
                return None
            self._pins[item[0]] += 1
        return SharedEntry(key=ChunkKey(key), header=header, slot=item[1], refs=1, entry_id=item[0], incarnation=incarnation)

    def _evicted_of(self, items: Any, incarnation: int) -> list[SharedEntry]:
        out = []
        for item in items if type(items) is list else []:
            try:
                if type(item) is not list or len(item) != 2 or type(item[0]) is not int:
                    raise ProtocolError("evicted item is [slot, header]")
                header = protocol.header_from_wire(protocol.check_header(item[1], self.limits))
            except ProtocolError:
                continue
            out.append(SharedEntry(key=ChunkKey(header.key), header=header, slot=item[0], live=False, incarnation=incarnation))
        return out

    def _payload(self, slot: int, payload_bytes: int):
        start = self.slot_offset(slot)
        return self.buffer[start : start + payload_bytes].numpy()

    def _checksum_ok(self, entry: SharedEntry) -> bool:
        """Whether ``entry``'s bytes match its header's checksum (checked once per entry)."""
        with self._lock:  # engine threads acquire concurrently; the hash itself runs unlocked
            seen = (self._session.instance, entry.entry_id)
            if seen in self._verified:
                self._verified.move_to_end(seen)
                return True
        if compute_checksum(entry.header, self._payload(entry.slot, entry.header.payload_bytes)) != entry.header.checksum:
            with self._lock:
                self.counters["bad_checksums"] += 1
                bad = self.counters["bad_checksums"]
            if bad in (1, 100, 10000):
                logger.warning("kvconnect: %d shared-pool entries failed their checksum (forged or garbled); served as "
                               "misses and removed", bad)
            return False
        with self._lock:
            self._verified[seen] = None
            if len(self._verified) > _VERIFIED_ENTRIES:
                self._verified.popitem(last=False)
        return True

    def _forget_pin(self, entry: SharedEntry) -> None:
        """Undo ``_entry_of``'s local pin count (the server's pin is released by the caller)."""
        with self._lock:
            if entry.incarnation == self._session.incarnation and self._pins[entry.entry_id] > 0:
                self._pins[entry.entry_id] -= 1
                if not self._pins[entry.entry_id]:
                    del self._pins[entry.entry_id]

    def _send_release(self, ids: list[int], incarnation: int) -> None:
        for batch in _batches(ids, self.limits.max_keys):  # a newer session skips them: bye released them
            self._session.call("release", [batch], incarnation)

    def _bad_reply(self, result: Any) -> None:
        if result is not FAILED:
            self.counters["bad_replies"] += 1


def _is_list(value: Any, n: int, *, exact: bool = True) -> bool:
    return type(value) is list and (len(value) == n if exact else len(value) <= n)


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
