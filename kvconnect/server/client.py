"""``SharedPoolClient``: the node cache server's pool, with ``ChunkPool``'s API.

The engine uses it in place of ``ChunkPool`` when ``KVCONNECT_SERVER_URL`` is set (see
``kvconnect.server.make_pool``): ``buffer`` is a uint8 tensor over the server's shared
segment, slots are page numbers in it, and the engine's kernels gather into / scatter out
of it directly. Only control messages (masks, acquire/release, reserve/commit/abort) go
over the socket, each bounded by ``timeout_s``.

Failure contract (never an exception into the engine, never a wrong byte):
- A call that times out or is refused counts an error and returns what an empty pool
  returns (misses, no slots). The client is then *disconnected*: every call returns a miss
  at once while a background thread says hello again with backoff.
- Reconnecting uses a fresh client id and happens only when the engine holds no pin and
  no reservation of the old one, so the old id's pages (freed by ``bye`` or the server's
  lease) are never still being read or written here. If the server restarted, the hello
  reply names a new segment instance, which is mapped before ``buffer`` is swapped.
- A heartbeat every lease/4 keeps this client's pins alive on the server; a process that
  dies simply stops heartbeating and the server frees its pins after the lease. Hence the
  one assumption: a single gather or scatter never outlasts the lease (default 10 s).

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
import os
import secrets
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import zmq

from ..chunks.chunk_format import ChunkHeader, compute_checksum
from ..errors import StorageError
from ..layout.spec import ChunkKey, Fingerprint
from ..throttled_warning import RepeatingWarning
from ..storage.pool import PoolEntry, PoolStats, SlotViews, notify_evicted
from . import protocol
from .index import STATS_FIELDS
from .channel import Channel
from .protocol import OK, STALE_INSTANCE, UNKNOWN_CLIENT, Limits, ProtocolError
from .shm import DATA_OFFSET, SHM_DIR, Segment, register_host_memory, unregister_host_memory

logger = logging.getLogger(__name__)

_FAILED = object()  # a call that did not complete
_VERIFIED_ENTRIES = 1 << 16  # entry ids whose checksum this process checked (LRU beyond that)


class _UntrustedServer(StorageError):
    """The socket at the URL belongs to a user this client has no reason to trust."""


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
        self._token = protocol.token_bytes(token)
        self.url = protocol.check_url(url, token=self._token, allow_remote=True)
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.fingerprint = fingerprint
        self.limits = limits
        self.on_evict: list[Callable[[PoolEntry], None]] = []
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.num_slots = 0
        self.counters: Counter = Counter()  # errors by kind, reconnects, dropped commits
        self._pin_memory = pin_memory
        self._shm_dir = shm_dir
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # the main channel and the connection state below
        self._main: Optional[Channel] = None  # engine calls, under the lock
        self._client_id: Optional[bytes] = None
        self._instance: Optional[bytes] = None
        self._segment: Optional[Segment] = None
        self._registered = False
        self._page_bytes = 1
        self._run_pages = 1
        self._num_pages = 0
        self._incarnation = 0
        self._connected = False
        self._heartbeat_s = 1.0
        self._reserved: set[int] = set()
        self._pins: Counter = Counter()  # entry_id -> pins the engine holds (this incarnation)
        self._verified: "OrderedDict[tuple[bytes, int], None]" = OrderedDict()  # (server instance, entry id)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.prefaulted = threading.Event()  # set once the mapping's pages are all faulted in
        self._unreachable = RepeatingWarning(logger.warning if warn_unreachable else logger.debug)
        self._beat = self._channel()  # hello and heartbeats: __init__, then the keeper thread only
        self._try_connect()  # synchronously once, so the first store can already use the server
        self._keeper = threading.Thread(target=self._keep, name="kvconnect-server-client", daemon=True)
        self._keeper.start()

    # -- readers ---------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        """Group mask of each key's entry, None where absent (no LRU touch)."""
        out: list[Optional[int]] = []
        for batch in _batches(list(keys), self.limits.max_keys):
            result = self._call("masks", [batch])
            if result is _FAILED or not _is_list(result, 1) or not _is_list(result[0], len(batch)) \
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
            incarnation = self._incarnation
            result = self._call("acquire", [batch], incarnation)
            if result is _FAILED or not _is_list(result, 1) or type(result[0]) is not list or not 0 < len(result[0]) <= len(batch):
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
                self._call("remove", [key], incarnation)
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
                if e.incarnation == self._incarnation and self._pins[e.entry_id] > 0:
                    self._pins[e.entry_id] -= 1
                    if not self._pins[e.entry_id]:
                        del self._pins[e.entry_id]
                    ids.append(e.entry_id)
            incarnation = self._incarnation
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
            incarnation = self._incarnation
            result = self._call("reserve", [want], incarnation)
            if result is _FAILED or not _is_list(result, 2) or not _is_list(result[0], want, exact=False):
                self._bad_reply(result)
                break
            got = [s for s in result[0] if type(s) is int and 0 <= s <= self._num_pages - self._run_pages]
            if len(got) != len(result[0]):
                self._bad_reply(result)
            with self._lock:
                if incarnation != self._incarnation:
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
            incarnation = self._incarnation
            owned = slot in self._reserved
            self._reserved.discard(slot)
        if owned and not header.checksum:  # the slot is ours until committed: its bytes are final
            header = dataclasses.replace(header, checksum=compute_checksum(header, self._payload(slot, header.payload_bytes)))
        entry = SharedEntry(key=key, header=header, slot=slot, live=False, incarnation=incarnation)
        if not owned:
            self.counters["dropped_commits"] += 1
            return entry
        args = [bytes(key), protocol.header_to_wire(header), slot]
        with self._lock:  # no wait for the reply: the server reads requests in order, so this
            # client's next call already sees the entry; a refused commit frees its run there
            if self._connected and incarnation == self._incarnation and self._main.post("commit", args, self._client_id, self._instance):
                entry.live = True
                return entry
        result = self._call("commit", args, incarnation)  # queue full or disconnected: ask and wait
        if result is _FAILED or not _is_list(result, 1) or type(result[0]) is not int:
            self._bad_reply(result)
            self.counters["dropped_commits"] += 1
            return entry
        entry.entry_id, entry.live = result[0], True
        return entry

    def abort(self, slots: Sequence[int]) -> None:
        with self._lock:
            incarnation = self._incarnation
            mine = [s for s in slots if s in self._reserved]
            self._reserved.difference_update(mine)
        for batch in _batches(mine, self.limits.max_keys):
            self._call("abort", [batch], incarnation)

    def remove(self, key: ChunkKey) -> bool:
        """Drop an entry (e.g. found corrupt); its pages are freed once no reader holds it."""
        result = self._call("remove", [bytes(key)])
        return _is_list(result, 1) and result[0] is True

    def clear(self) -> None:
        """Drop every entry of this client's layout (every entry when no fingerprint is set)."""
        self._call("clear", [None if self.fingerprint is None else bytes(self.fingerprint)])

    def demote(self, keys: Sequence[ChunkKey]) -> int:
        """No eviction hints to the server: its LRU serves every engine's prompts. Moves none."""
        return 0

    def reinstate(self, keys: Sequence[ChunkKey]) -> None:
        """See ``demote``: nothing was demoted."""

    # -- views and stats -------------------------------------------------------------
    def slot_offset(self, slot: int) -> int:
        return DATA_OFFSET + slot * self._page_bytes

    def server_stats(self) -> Optional[dict[str, int]]:
        """The server's counters (see ``index.STATS_FIELDS``), None when unreachable."""
        result = self._call("stats", [])
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
            extra: dict[str, Any] = {"pinned": pinned, "connected": self._connected, "client": dict(self.counters), "server": server}
        used_pages = server.get("used_pages", 0)
        return PoolStats(
            num_slots=self.num_slots, slot_bytes=self.slot_bytes, used_slots=-(-used_pages // self._run_pages),
            evictions=server.get("evictions", 0), reserve_shortfalls=server.get("reserve_shortfalls", 0),
            commits=server.get("commits", 0), extra=extra,
        )

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def page_locked(self) -> bool:
        """True when the mapping is registered with CUDA (cudaHostRegister)."""
        return self._registered

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat, say bye (frees this client's pins at once), unmap."""
        self._stop.set()
        self._wake.set()
        self._keeper.join(timeout=self.timeout_s + 1.0)
        with self._lock:
            if self._connected and self._main is not None:
                self._main.post("bye", [], self._client_id, self._instance)
            self._connected = False
            for channel in (self._main, self._beat):
                if channel is not None:
                    channel.close(linger_ms=100)
            self._main = None
            self._drop_segment()
        if self._keeper.is_alive():  # stuck in a call: term() would wait for its socket forever
            logger.warning("kvconnect: cache-server client thread did not stop; leaving its context open")
        else:
            self._ctx.term()

    # -- connection ------------------------------------------------------------------
    def _channel(self) -> Channel:
        return Channel(self._ctx, self.url, token=self._token, limits=self.limits, timeout_s=self.timeout_s)

    def _call(self, op: str, args: list, incarnation: Optional[int] = None) -> Any:
        """The result of ``op`` on the main socket, or _FAILED (counted; disconnects when due).

        ``incarnation``: send only if the session is still that one (ids and slots in
        ``args`` mean nothing to a newer session).
        """
        with self._lock:
            if not self._connected or (incarnation is not None and incarnation != self._incarnation):
                self.counters["calls_while_disconnected"] += 1
                return _FAILED
            try:
                status, result = self._main.request(op, args, self._client_id, self._instance)
            except StorageError as exc:
                self._disconnect("timeouts", exc)
                return _FAILED
            if status == OK:
                return result
            if status in (UNKNOWN_CLIENT, STALE_INSTANCE):
                self._disconnect("lost_sessions", result)
            else:
                self.counters["refused_calls"] += 1
                if self.counters["refused_calls"] in (1, 100, 10000):
                    logger.warning("kvconnect: cache server refused %s: %s", op, result)
            return _FAILED

    def _disconnect(self, reason: str, detail: Any) -> None:
        """Called with the lock held: from now on calls miss until the keeper reconnects."""
        if self._connected:
            logger.warning("kvconnect: cache server %s unreachable (%s); serving misses until it is back", self.url, detail)
        self._connected = False
        self.counters[reason] += 1
        self._wake.set()

    def _try_connect(self) -> bool:
        """Say hello under a fresh client id and, if that works, switch to it (keeper thread)."""
        with self._lock:
            if self._reserved or self._pins:  # the engine still uses the old session's pages
                return False
        new_id = secrets.token_bytes(protocol.ID_BYTES)
        args = [os.getpid(), None if self.fingerprint is None else bytes(self.fingerprint), self.slot_bytes]
        try:
            owner_uid = self._server_uid()
            status, result = self._beat.request("hello", args, new_id, None)
            info, lease_s = protocol.check_hello_reply(status, result)
            segment = self._segment
            if segment is None or segment.info != info:
                segment = Segment.attach(info, shm_dir=self._shm_dir, owner_uid=owner_uid)
        except _UntrustedServer as exc:
            self.counters["failed_hellos"] += 1
            self._unreachable.failed("kvconnect: not using the cache server %s: %s. Serving misses; retrying", self.url, exc)
            return False
        except (StorageError, ProtocolError) as exc:
            self._beat.reset()  # drop whatever is queued towards a dead peer
            self.counters["failed_hellos"] += 1
            self._unreachable.failed(
                "kvconnect: no answer from the cache server %s (%s): is `kvconnect server` running there, and is "
                "KVCONNECT_SERVER_TOKEN the server's token? (the server drops frames with a wrong or missing token, "
                "which looks like no answer). Serving misses; retrying", self.url, exc)
            return False
        with self._lock:
            old_id, old_instance = self._client_id, self._instance
            if segment is not self._segment:
                self._drop_segment()
                self._segment = segment
                self._registered = self._pin_memory and register_host_memory(segment.buffer)
                self.buffer = segment.buffer
                self.prefaulted.clear()
                if self._registered:  # registration already faulted every page in
                    self.prefaulted.set()
                else:
                    threading.Thread(target=self._prefault, args=(segment,), name="kvconnect-prefault", daemon=True).start()
            self._page_bytes, self._num_pages = info.page_bytes, info.num_pages
            self._run_pages = -(-self.slot_bytes // info.page_bytes)
            self.num_slots = info.num_pages // self._run_pages
            if self._main is not None:
                self._main.close()
            self._main = self._channel()
            self._client_id, self._instance = new_id, info.instance
            self._heartbeat_s = min(max(lease_s / 4, 0.05), 30.0)
            self._incarnation += 1
            self._connected = True
            self.counters["connects"] += 1
        if old_id is not None:  # best effort: the old session's pins and reservations go now, not at lease end
            self._beat.post("bye", [], old_id, old_instance)
        self._unreachable.cleared()
        logger.info("kvconnect: connected to cache server %s (%d pages of %d bytes)", self.url, info.num_pages, info.page_bytes)
        return True

    def _server_uid(self) -> Optional[int]:
        """The uid owning an ``ipc://`` server's socket, whose segment alone this client maps.

        Without a token nothing proves who answers, so the socket must belong to this user or
        root: a socket another user created first at the path (``/tmp`` is everyone's) would
        otherwise hand this engine that user's segment, with checksums that user computed.
        With a token the replies prove the server holds it. None for tcp:// (a token is
        required there) and when the path does not exist yet (then the hello cannot succeed).
        """
        path = protocol.ipc_path(self.url)
        if path is None:
            return None
        try:
            owner = os.stat(path).st_uid
        except OSError:
            return None
        if self._token is None and owner not in (os.geteuid(), 0):
            self.counters["untrusted_servers"] += 1
            raise _UntrustedServer(f"the socket {path} belongs to uid {owner}, not to this user (uid {os.geteuid()}) or root: "
                               "set KVCONNECT_SERVER_TOKEN (the server's token) to use a server of another user")
        return owner

    def _keep(self) -> None:
        """Heartbeat while connected; reconnect with backoff while not."""
        backoff_s = 0.05
        while not self._stop.is_set():
            if self._connected:
                self._wake.wait(self._heartbeat_s)
                self._wake.clear()
                if self._stop.is_set() or not self._connected:
                    continue
                client_id, instance = self._client_id, self._instance
                try:
                    status, _ = self._beat.request("ping", [], client_id, instance)
                except StorageError as exc:
                    status = -1
                    detail: Any = exc
                    self._beat.reset()
                else:
                    detail = f"status {status}"
                if status != OK:
                    with self._lock:
                        if self._client_id == client_id:
                            self._disconnect("lost_heartbeats", detail)
                backoff_s = 0.05
            elif not self._try_connect():
                self._wake.wait(backoff_s)
                self._wake.clear()
                backoff_s = min(backoff_s * 2, 2.0)

    def _prefault(self, segment: Segment) -> None:
        try:
            segment.prefault(self._stop)
        finally:
            self.prefaulted.set()

    def _drop_segment(self) -> None:
        if self._segment is None:
            return
        if self._registered:
            unregister_host_memory(self._segment.buffer)
            self._registered = False
        self._segment.close()
        self._segment = None

    # -- helpers ---------------------------------------------------------------------
    def _entry_of(self, key: bytes, item: Any, incarnation: int) -> Optional[SharedEntry]:
        """A pinned entry from an acquire reply item, or None (miss or unusable)."""
        if item is None:
            return None
        try:
            if type(item) is not list or len(item) != 3 or type(item[0]) is not int or type(item[1]) is not int:
                raise ProtocolError("acquire item is [entry_id, slot, header]")
            header = protocol.header_from_wire(protocol.check_header(item[2], self.limits))
            run_pages = -(-header.payload_bytes // self._page_bytes)
            if header.key != key or (self.fingerprint is not None and header.fingerprint != self.fingerprint):
                raise ProtocolError("entry stored under another key or layout")
            if header.payload_bytes > self.slot_bytes or item[1] + run_pages > self._num_pages:
                raise ProtocolError("entry does not fit this layout's slot or the segment")
        except ProtocolError:
            self.counters["bad_entries"] += 1
            return None
        with self._lock:
            if incarnation != self._incarnation:
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
            seen = (self._instance, entry.entry_id)
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
            if entry.incarnation == self._incarnation and self._pins[entry.entry_id] > 0:
                self._pins[entry.entry_id] -= 1
                if not self._pins[entry.entry_id]:
                    del self._pins[entry.entry_id]

    def _send_release(self, ids: list[int], incarnation: int) -> None:
        for batch in _batches(ids, self.limits.max_keys):  # a newer session skips them: bye released them
            self._call("release", [batch], incarnation)

    def _bad_reply(self, result: Any) -> None:
        if result is not _FAILED:
            self.counters["bad_replies"] += 1


def _is_list(value: Any, n: int, *, exact: bool = True) -> bool:
    return type(value) is list and (len(value) == n if exact else len(value) <= n)


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
