"""The distributed tier on Mooncake Store: chunks move zero-copy between pool slots and the store.

    tier = MooncakeTier(spec, fingerprint, timeout_s=1.0)   # returns at once; connects behind
    tier.attach_pool(pool)      # the pool's buffer (or the node server's mapping) is registered once

Objects. Each chunk is two Mooncake objects: ``kvc/<fingerprint>/<key>/h``, the packed
header (identity, group mask, plane rows, sizes, checksum over header and payload; 88 + 8 x
planes bytes), and ``.../p``, the payload. The payload object is written straight from the
pool slot (``batch_upsert_from``) and read straight into one (``batch_get_into``): no copy
in kvconnect, and none in Mooncake beyond its transfer. The header object exists so a
lookup learns group masks without moving payloads: ``masks`` is one ``batch_is_exist``
over the header objects, masks of present chunks from what this process has seen (its
writes and reads), and one batched read of the headers it has not seen into a small
registered scratch buffer (which also checks their identity). A write batch is one
``batch_upsert_from`` of the payloads and then their headers; deletes remove the header
first.

Verification. ``read_into`` reads header and payload in one call and checks them as
``chunk_format.decode`` does (magic, version, fingerprint, key, sizes, checksum over both):
a value written by something else, a damaged one, or a header of one write over the
payload of another is a miss, counted as ``corrupt``, and removed.

Semantics. Writes are upserts (Mooncake's ``put`` keeps an old value); removes are forced
(an unforced remove fails for 10 s after any read: a lease, which is Mooncake's business,
never an error here).

Failures. ``setup`` runs on a background thread (with no master it retries for ~90 s):
until it succeeds the tier is unhealthy and every call is a quick miss or False. Lookups
(the only calls on the engine's step path that can meet a dead master first) run on up
to LOOKUP_THREADS worker threads and are abandoned after ``timeout_s``; a lookup that
arrives while ``setup`` runs (the master answered) waits for it, also at most ``timeout_s``; a master that stopped answering makes
Mooncake return -900 after ~4.5 s, so -900s and timeouts open the breaker (tier.Breaker)
and the tier is skipped while it backs off. ``read_into`` runs only after a lookup just
answered, and it cannot be abandoned: Mooncake writes into the pool slot until it returns,
and the slot must not be reused before. A dead segment owner fails a transfer at once
(-800): a miss. Writes run on the write-behind thread and may take their time.

Needs Mooncake (``pip install mooncake-transfer-engine-non-cuda`` and ``libibverbs1``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from .. import chunk_format
from ..chunk_format import ChunkHeader
from ..errors import CorruptChunkError
from ..spec import ChunkKey, Fingerprint
from .mooncake_config import MooncakeSpec, connect_store, import_store
from .tier import Breaker, LowerTier, StoreItem, peek_mask, read_header

logger = logging.getLogger(__name__)

HEADER_SLOT_BYTES = 16 << 10  # room for one header: 88 + 8 x planes (up to ~2000 planes)
BATCH_KEYS = 64  # keys per Mooncake call (bounds the header scratch)
LOOKUP_THREADS = 4  # concurrent lookups (engines look up from more than one thread)
KNOWN_MASKS = 1 << 16  # group masks remembered per process (lookups skip re-reading those headers)
NOT_FOUND = -704
LEASED = -706
BUFFER_TOO_SMALL = -600
TRANSFER_FAIL = -800
RPC_FAIL = -900


def view_address(view) -> int:
    """Address of a contiguous byte buffer (memoryview, numpy array, bytearray)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class _Registered:
    """A registered numpy buffer cut into header slots."""

    def __init__(self, num_slots: int) -> None:
        self.array = np.zeros(num_slots * HEADER_SLOT_BYTES, dtype=np.uint8)
        self.base = self.array.ctypes.data

    def ptr(self, i: int) -> int:
        return self.base + i * HEADER_SLOT_BYTES

    def view(self, i: int, nbytes: int) -> memoryview:
        start = i * HEADER_SLOT_BYTES
        return memoryview(self.array[start : start + nbytes])


class _Workers:
    """Up to ``size`` daemon threads running calls; a caller waits at most ``timeout_s``.

    Each thread owns one slot (0..size-1) that the call receives, e.g. to pick its scratch
    buffer. When every thread is busy (stalled on a master that does not answer) a new call
    is refused at once instead of queueing behind them.
    """

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._jobs: "collections.deque[Callable[[int], None]]" = collections.deque()
        self._idle = 0
        self._threads = 0
        self._size = size

    def run(self, fn: Callable[[int], object], timeout_s: float) -> tuple[str, object]:
        """("done", result); ("busy", None) when every thread is taken (``fn`` not started);
        ("timeout", None) when ``fn`` runs past ``timeout_s`` (it finishes on its thread)."""
        box: dict = {}
        done = threading.Event()

        def job(slot: int) -> None:
            try:
                box["result"] = fn(slot)
            except Exception as exc:  # reported to the caller, never lost
                box["error"] = exc
            finally:
                done.set()

        with self._cond:
            if self._idle == 0:
                if self._threads >= self._size:
                    return "busy", None
                threading.Thread(target=self._run, args=(self._threads,), name=f"{self._name}-{self._threads}",
                                 daemon=True).start()
                self._threads += 1
                self._idle += 1
            self._idle -= 1
            self._jobs.append(job)
            self._cond.notify()
        if not done.wait(timeout_s):
            return "timeout", None
        if "error" in box:
            raise box["error"]
        return "done", box.get("result")

    def _run(self, slot: int) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.popleft()
            try:
                job(slot)
            finally:
                with self._cond:
                    self._idle += 1


class MooncakeTier(LowerTier):
    name = "mooncake"
    reads_into = True

    def __init__(self, spec: MooncakeSpec, fingerprint: Fingerprint, *, timeout_s: float = 1.0,
                 retry_after_s: float = 0.5, max_retry_after_s: float = 10.0) -> None:
        """A tier on the Mooncake master of ``spec``; returns at once and connects in the background.

        Raises StorageError when Mooncake cannot be imported (a configuration error at start).
        """
        super().__init__(fingerprint)
        self.spec = spec
        self.timeout_s = timeout_s
        self._store_cls = import_store(spec)
        self._prefix = "kvc/" + bytes(fingerprint).hex() + "/"
        self._breaker = Breaker(retry_after_s, max_retry_after_s)
        self._state = threading.Condition()
        self._store = None
        self._setting_up = False  # the master answered and setup() is running
        self._closed = False
        self._in_flight = 0
        self._regions: list[tuple[int, int]] = []  # (address, bytes) registered with the store
        self._pools: list = []  # pools whose buffers are registered on first use
        self._lookup_scratch = [_Registered(BATCH_KEYS) for _ in range(LOOKUP_THREADS)]
        self._read_scratch = _Registered(BATCH_KEYS)
        self._write_scratch = _Registered(BATCH_KEYS)
        self._read_lock = threading.Lock()
        self._known: "collections.OrderedDict[ChunkKey, int]" = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._lookups = _Workers("kvconnect-mooncake-lookup", LOOKUP_THREADS)
        self.counters = {"connect_polls": 0, "connected": 0, "timeouts": 0, "rpc_failures": 0,
                         "transfer_failures": 0, "lease_conflicts": 0, "registered_bytes": 0}
        self._stats.capacity_bytes = spec.global_segment_bytes
        self._connector = threading.Thread(target=self._connect_loop, name="kvconnect-mooncake-connect", daemon=True)
        self._connector.start()

    # -- keys ------------------------------------------------------------------------
    def object_keys(self, key: ChunkKey) -> tuple[str, str]:
        """The header and payload object names of ``key``."""
        base = self._prefix + bytes(key).hex()
        return base + "/h", base + "/p"

    # -- connection ------------------------------------------------------------------
    def _connect_loop(self) -> None:
        def wait_stop(seconds: float) -> bool:
            self._bump("connect_polls")
            with self._state:
                return self._state.wait_for(lambda: self._closed, seconds)

        def on_setup(running: bool) -> None:
            with self._state:
                self._setting_up = running
                self._state.notify_all()

        while True:
            store = connect_store(self.spec, self._store_cls, wait_stop, logger.warning, on_setup)
            if store is None or self._adopt(store):
                return

    def _adopt(self, store) -> bool:
        """Register the scratch buffers and publish ``store``; False (store closed) when closing."""
        ok = all(store.register_buffer(scratch.base, scratch.array.nbytes) == 0
                 for scratch in (*self._lookup_scratch, self._read_scratch, self._write_scratch))
        with self._state:
            self._setting_up = False
            self._state.notify_all()
            if ok and not self._closed:
                self._store = store
        if not ok or self._closed:
            if not ok:
                logger.warning("kvconnect: Mooncake refused to register a scratch buffer; retrying setup")
            store.close()
            return self._closed
        self._bump("connected")
        logger.info("kvconnect: Mooncake tier connected to %s (this process contributes %d bytes)",
                    self.spec.master_address, self.spec.global_segment_bytes)
        return True

    @property
    def connected(self) -> bool:
        with self._state:
            return self._store is not None

    def _enter(self):
        """The store for one call, or None when not connected, closed or backing off.

        A call that arrives while ``setup`` is running (the master answered; a fresh engine's
        first lookups) waits for it, at most ``timeout_s``: no longer than a lookup may take.
        With no master answering there is nothing to wait for: a miss at once.
        """
        with self._state:
            if self._store is None and self._setting_up and not self._closed:
                self._state.wait_for(lambda: self._store is not None or not self._setting_up or self._closed,
                                     self.timeout_s)
            if self._store is None or self._closed:
                return None
            if not self._breaker.allow():
                return None
            self._in_flight += 1
            return self._store

    def _exit(self) -> None:
        with self._state:
            self._in_flight -= 1
            self._state.notify_all()

    def healthy(self) -> bool:
        with self._state:
            return self._store is not None and not self._closed and self._breaker.allow()

    def _outcome(self, codes: Sequence[int]) -> None:
        """Feed the breaker and the counters from a call's return codes."""
        rpc = sum(c == RPC_FAIL for c in codes)
        transfer = sum(c == TRANSFER_FAIL for c in codes)
        leased = sum(c == LEASED for c in codes)
        if rpc:
            self._breaker.failure()
        else:
            self._breaker.success()
        if rpc or transfer or leased:
            with self._stats_lock:
                self.counters["rpc_failures"] += rpc
                self.counters["transfer_failures"] += transfer
                self.counters["lease_conflicts"] += leased

    # -- zero-copy buffers -----------------------------------------------------------
    def attach_pool(self, pool) -> None:
        """Register ``pool.buffer`` (a private pool or the node server's mapping) on first use."""
        self._pools.append(pool)

    def _registered(self, store, address: int, nbytes: int) -> bool:
        """Make sure [address, address + nbytes) is registered; registers a pool's whole buffer once."""
        with self._state:
            if any(start <= address and address + nbytes <= start + size for start, size in self._regions):
                return True
        for pool in self._pools:
            buffer = getattr(pool, "buffer", None)
            if buffer is None or buffer.numel() == 0:
                continue
            start, size = buffer.data_ptr(), buffer.numel()
            if start <= address and address + nbytes <= start + size:
                return self._register(store, start, size)
        return False

    def _register(self, store, start: int, size: int) -> bool:
        if store.register_buffer(start, size) != 0:
            self._count(errors=1)
            return False
        with self._state:
            self._regions.append((start, size))
        self._bump("registered_bytes", size)
        return True

    # -- reads -----------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        self._count(lookups=len(keys))
        out: list[Optional[int]] = [None] * len(keys)
        store = self._enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return out
        # the job owns the in-flight mark from here (it may outlive this wait; close waits for it)
        try:
            status, result = self._lookups.run(lambda slot: self._read_headers(store, keys, slot), self.timeout_s)
        except Exception:  # a binding error: the tier's own bug, still only a miss
            logger.exception("kvconnect: Mooncake lookup failed")
            self._count(errors=1)
            return out
        if status == "busy":
            self._exit()
        if status != "done":  # a stalled master (or a lookup still stuck from before): a miss, and back off
            self._bump("timeouts")
            self._breaker.failure()
            self._count(errors=1)
            return out
        out = result
        self._count(lookup_hits=sum(m is not None for m in out))
        return out

    def _read_headers(self, store, keys: Sequence[ChunkKey], slot: int) -> list[Optional[int]]:
        """Group masks per key, on the lookup worker thread (it owns one in-flight mark).

        One ``batch_is_exist`` over the header objects per BATCH_KEYS keys; the masks of keys
        present come from the masks this process has seen (its writes and reads), and a
        second, batched read of the headers fetches those it has not. A remembered mask is
        a hint, as every lookup is: ``read_into`` returns the stored header, and the engine
        restores by what it actually acquired.
        """
        out: list[Optional[int]] = []
        try:
            for start in range(0, len(keys), BATCH_KEYS):
                out.extend(self._read_header_batch(store, keys[start : start + BATCH_KEYS], self._lookup_scratch[slot]))
        finally:
            self._exit()
        return out

    def _read_header_batch(self, store, batch: Sequence[ChunkKey], scratch: _Registered) -> list[Optional[int]]:
        names = [self.object_keys(k)[0] for k in batch]
        exist = store.batch_is_exist(names)
        if any(e < 0 for e in exist):  # the master did not answer for them
            self._breaker.failure()
            self._count(errors=1)
            with self._stats_lock:
                self.counters["rpc_failures"] += 1
        with self._known_lock:
            out = [self._known.get(k) if e == 1 else None for k, e in zip(batch, exist)]
            for k, e in zip(batch, exist):
                if e == 0:
                    self._known.pop(k, None)
        unknown = [i for i, (m, e) in enumerate(zip(out, exist)) if e == 1 and m is None]
        if not unknown:
            return out
        codes = store.batch_get_into([names[i] for i in unknown], [scratch.ptr(j) for j in range(len(unknown))],
                                     [HEADER_SLOT_BYTES] * len(unknown))
        self._outcome(codes)
        bad = []
        for j, (i, code) in enumerate(zip(unknown, codes)):
            mask = peek_mask(scratch.view(j, code), self.fingerprint, batch[i]) if code > 0 else None
            if code > 0 and mask is None or code == BUFFER_TOO_SMALL:
                bad.append(batch[i])  # something else under a kvconnect name
            elif code < 0 and code not in (NOT_FOUND, RPC_FAIL, TRANSFER_FAIL):
                self._count(errors=1)
            out[i] = mask
            self._remember(batch[i], mask)
        if bad:
            self._count(errors=len(bad), corrupt=len(bad))
            self._remove(store, bad)
        return out

    def _remember(self, key: ChunkKey, mask: Optional[int]) -> None:
        """Note (or, with None, forget) the group mask stored under ``key``; bounded, oldest out."""
        with self._known_lock:
            if mask is None:
                self._known.pop(key, None)
                return
            self._known[key] = mask
            self._known.move_to_end(key)
            while len(self._known) > KNOWN_MASKS:
                self._known.popitem(last=False)

    def read_into(self, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        return self.read_many_into([key], [out])[0]

    def read_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[Optional[ChunkHeader]]:
        """``read_into`` for many keys: one ``batch_get_into`` per BATCH_KEYS chunks, each payload
        straight into its ``out`` (pool slots); a verified header per key, None for a miss."""
        self._count(gets=len(keys))
        result: list[Optional[ChunkHeader]] = [None] * len(keys)
        store = self._enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return result
        try:
            direct = []
            for i, (key, out) in enumerate(zip(keys, outs)):
                address = view_address(out)
                if self._registered(store, address, len(out)):
                    direct.append((i, address))
                else:
                    result[i] = self._read_copy(store, key, out)
            with self._read_lock:
                for start in range(0, len(direct), BATCH_KEYS):
                    batch = direct[start : start + BATCH_KEYS]
                    headers = self._read_verified(store, [keys[i] for i, _ in batch], [outs[i] for i, _ in batch],
                                                  [a for _, a in batch])
                    for (i, _), header in zip(batch, headers):
                        result[i] = header
        finally:
            self._exit()
        return result

    def _read_verified(self, store, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                       addresses: Sequence[int]) -> list[Optional[ChunkHeader]]:
        """Headers and payloads of up to BATCH_KEYS chunks in one call, each checked like decode."""
        scratch = self._read_scratch
        names = [self.object_keys(k) for k in keys]
        n = len(keys)
        codes = store.batch_get_into([h for h, _ in names] + [p for _, p in names],
                                     [scratch.ptr(j) for j in range(n)] + list(addresses),
                                     [HEADER_SLOT_BYTES] * n + [len(out) for out in outs])
        self._outcome(codes)
        out_headers: list[Optional[ChunkHeader]] = []
        bad = []
        for j, key in enumerate(keys):
            header_len, payload_len = codes[j], codes[n + j]
            if NOT_FOUND in (header_len, payload_len) or {header_len, payload_len} & {RPC_FAIL, TRANSFER_FAIL}:
                self._count(errors=int(bool({header_len, payload_len} & {RPC_FAIL, TRANSFER_FAIL})))
                out_headers.append(None)  # evicted or never written, master or segment owner gone: a miss
                continue
            try:
                if header_len < 0 or payload_len < 0:
                    raise CorruptChunkError(f"Mooncake read returned {header_len}, {payload_len}")
                header = read_header(scratch.view(j, header_len), fingerprint=self.fingerprint, key=key,
                                     payload_bytes=payload_len)
                if chunk_format.compute_checksum(header, outs[j][:payload_len]) != header.checksum:
                    raise CorruptChunkError("checksum mismatch")
            except CorruptChunkError as exc:
                logger.warning("kvconnect: Mooncake value under %s is not this chunk (%s); removing it", names[j][1], exc)
                self._count(errors=1, corrupt=1)
                bad.append(key)
                out_headers.append(None)
                continue
            self._count(get_hits=1, bytes_read=header_len + payload_len)
            self._remember(key, header.group_mask)
            out_headers.append(header)
        if bad:
            self._remove(store, bad)
        return out_headers

    def _read_copy(self, store, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        """read_into for a buffer outside every attached pool: through a registered copy."""
        (data,) = self._get_many(store, [key])
        if data is None:
            return None
        header = chunk_format.decode_header(data)
        if header.payload_bytes > len(out):
            self._count(errors=1, corrupt=1)
            return None
        out[: header.payload_bytes] = memoryview(data)[header.header_bytes :]
        self._count(get_hits=1, bytes_read=len(data))
        return header

    def get(self, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]:
        self._count(gets=len(keys))
        store = self._enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return [None] * len(keys)
        try:
            out = self._get_many(store, keys)
        finally:
            self._exit()
        self._count(get_hits=sum(d is not None for d in out), bytes_read=sum(len(d) for d in out if d is not None))
        return out

    def _get_many(self, store, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]:
        """Encoded, verified chunks read into fresh buffers (export and copies; not the hot path)."""
        out: list[Optional[bytes]] = []
        with self._read_lock:
            for key in keys:
                header_name, payload_name = self.object_keys(key)
                (code,) = store.batch_get_into([header_name], [self._read_scratch.ptr(0)], [HEADER_SLOT_BYTES])
                self._outcome([code])
                if code <= 0:
                    out.append(None)
                    continue
                try:
                    header = chunk_format.decode_header(bytes(self._read_scratch.view(0, code)))
                except CorruptChunkError:
                    header = None
                if header is None or header.payload_bytes > (1 << 34):
                    self._count(errors=1, corrupt=1)
                    self._remove(store, [key])
                    out.append(None)
                    continue
                buffer = np.empty(header.header_bytes + header.payload_bytes, dtype=np.uint8)
                buffer[: header.header_bytes] = self._read_scratch.array[: header.header_bytes]
                payload = buffer[header.header_bytes :]
                if payload.nbytes and store.register_buffer(payload.ctypes.data, payload.nbytes) != 0:
                    self._count(errors=1)
                    out.append(None)
                    continue
                try:
                    (got,) = store.batch_get_into([payload_name], [payload.ctypes.data], [payload.nbytes])
                finally:
                    if payload.nbytes:
                        store.unregister_buffer(payload.ctypes.data)
                self._outcome([got])
                if got != header.payload_bytes or not self._verify(buffer, key):
                    if got not in (NOT_FOUND, RPC_FAIL, TRANSFER_FAIL):
                        self._count(errors=1, corrupt=1)
                        self._remove(store, [key])
                    out.append(None)
                    continue
                out.append(buffer.tobytes())
        return out

    # -- writes ----------------------------------------------------------------------
    def put(self, items: Sequence[StoreItem]) -> list[bool]:
        results = [False] * len(items)
        store = self._enter()
        if store is None:
            self._count(skipped_unhealthy=1, errors=len(items))
            return results
        try:
            with self._write_lock:
                for start in range(0, len(items), BATCH_KEYS):
                    batch = items[start : start + BATCH_KEYS]
                    results[start : start + len(batch)] = self._put_batch(store, batch)
        finally:
            self._exit()
        written = [item for item, ok in zip(items, results) if ok]
        self._count(puts=len(written), errors=len(items) - len(written),
                    bytes_written=sum(i.header.header_bytes + i.header.payload_bytes for i in written))
        return results

    def _put_batch(self, store, batch: Sequence[StoreItem]) -> list[bool]:
        scratch = self._write_scratch
        ok = [False] * len(batch)
        payload_names, payload_ptrs, payload_sizes, slots, temporary = [], [], [], [], []
        for i, item in enumerate(batch):
            header = item.sealed_header()
            if len(header) > HEADER_SLOT_BYTES:
                logger.warning("kvconnect: a %d-byte chunk header exceeds the Mooncake tier's %d-byte slot",
                               len(header), HEADER_SLOT_BYTES)
                continue
            scratch.array[i * HEADER_SLOT_BYTES : i * HEADER_SLOT_BYTES + len(header)] = np.frombuffer(header, np.uint8)
            address = view_address(item.payload)
            if len(item.payload) and not self._registered(store, address, len(item.payload)):
                if store.register_buffer(address, len(item.payload)) != 0:  # not a pool slot: for this call
                    continue
                temporary.append(address)
            payload_names.append(self.object_keys(item.key)[1])
            payload_ptrs.append(address)
            payload_sizes.append(len(item.payload))
            slots.append((i, len(header)))
        if not slots:
            return ok
        # one call, payloads then headers; a reader that meets a header of one write over the
        # payload of another finds the checksum wrong: a checked miss
        header_names = [self.object_keys(batch[i].key)[0] for i, _ in slots]
        try:
            codes = store.batch_upsert_from(payload_names + header_names,
                                            payload_ptrs + [scratch.ptr(i) for i, _ in slots],
                                            payload_sizes + [n for _, n in slots])
        finally:
            for address in temporary:
                store.unregister_buffer(address)
        self._outcome(codes)
        for j, (i, _) in enumerate(slots):
            ok[i] = codes[j] == 0 and codes[len(slots) + j] == 0
            self._remember(batch[i].key, batch[i].header.group_mask if ok[i] else None)
        return ok

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        store = self._enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return [False] * len(keys)
        try:
            codes = self._remove(store, keys)
        finally:
            self._exit()
        self._count(deletes=sum(codes))
        return codes

    def _remove(self, store, keys: Sequence[ChunkKey]) -> list[bool]:
        """Forced removes (a lease never blocks a delete), header first; True where a header was there."""
        if not keys:
            return []
        for key in keys:
            self._remember(key, None)
        names = [self.object_keys(k) for k in keys]
        headers = store.batch_remove([h for h, _ in names], True)
        store.batch_remove([p for _, p in names], True)
        return [code == 0 for code in headers]

    # -- lifecycle and figures -------------------------------------------------------
    def describe(self) -> dict:
        """What this process holds and how the tier fares (``kvconnect inspect``, tier_stats)."""
        with self._stats_lock:
            counters = dict(self.counters)
        return {"master": self.spec.master_address, "protocol": self.spec.protocol,
                "local_hostname": self.spec.local_hostname, "segment_bytes": self.spec.global_segment_bytes,
                "connected": self.connected, "healthy": self.healthy(), **counters}

    def _bump(self, name: str, delta: int = 1) -> None:
        with self._stats_lock:
            self.counters[name] += delta

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop connecting; close the store once no call is in flight (a closed store must not be used)."""
        deadline = time.monotonic() + timeout_s
        with self._state:
            self._closed = True
            self._state.notify_all()
            while self._in_flight and time.monotonic() < deadline:
                self._state.wait(deadline - time.monotonic())
            store, self._store = self._store, None
            stuck = self._in_flight
        if store is None:
            return
        if stuck:  # a call is still inside Mooncake: leave the store open rather than crash it
            logger.warning("kvconnect: a Mooncake call is still in flight at close; leaving the client open")
            return
        store.close()
