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
registered scratch buffer (which also checks their identity). The existence check covers
both objects of each chunk, so a lookup renews both leases or neither (a renewed header
over an evicted payload is what a lookup would keep offering). A write batch is one
``batch_upsert_from`` of the payloads and then their headers.

Verification. ``read_into`` reads header and payload in one call and checks them as
``chunk_format.decode`` does; bytes that fail are a miss, counted as ``corrupt``, and
removed, and a chunk found with one part evicted has the other removed (``parts_missing``).
The read path is ``reads.MooncakeReader``, which says more; what lookups, writes and reads
share (names, link, code meanings, masks seen, removes, registered pools) is
``objects.MooncakeObjects``; the registered scratch buffers are ``buffers``.

Semantics. Writes are upserts (Mooncake's ``put`` keeps an old value); removes are forced
(an unforced remove fails for 10 s after any read: a lease, which is Mooncake's business,
never an error here).

Failures. The connection, its breaker and the count of calls in flight are
``link.MooncakeLink``'s (held by ``objects``). Lookups (the calls on the engine's step path that meet a
stalled master first) run on up to LOOKUP_THREADS worker threads (``workers``) and
are abandoned after ``timeout_s``. Reads run on READ_THREADS read workers and are abandoned
after the budget of the bytes they ask for (``reads``: the pool slots an abandoned
transfer may still write stay lent to it until it returns); each Mooncake RPC returns -901
after ``timeout_s`` (``MC_RPC_TIMEOUT_MS``), and a read of many chunks stops between batches
at its deadline or once the breaker opened; what it did not read is a miss. Writes run on
the write-behind thread and stop between batches the same way.

Needs Mooncake (``pip install mooncake-transfer-engine-non-cuda`` and ``libibverbs1``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Sequence

import numpy as np

from ...layout.spec import ChunkKey, Fingerprint
from ..tier import LowerTier, StoreItem, peek_mask
from .buffers import BATCH_KEYS, HEADER_SLOT_BYTES, RegisteredSlots, view_address
from .config import MooncakeSpec
from .codes import Meaning
from .objects import FAILURE_KINDS, MooncakeObjects
from .reads import READ_THREADS, MooncakeReader
from .workers import Workers

logger = logging.getLogger(__name__)

LOOKUP_THREADS = 4  # concurrent lookups (engines look up from more than one thread)


class MooncakeTier(LowerTier):
    """Chunks in Mooncake Store: lookups, writes and removes here; reads by its ``reader``."""

    name = "mooncake"
    reads_into = True

    def __init__(self, spec: MooncakeSpec, fingerprint: Fingerprint, *, timeout_s: float = 1.0,
                 retry_after_s: float = 0.5, max_retry_after_s: float = 10.0, removes: bool = True) -> None:
        """A tier on the Mooncake master of ``spec``; returns at once and connects in the background.
        ``removes`` False: a follower's reads never remove an object (``MooncakeReader``).

        Raises StorageError when Mooncake cannot be imported (a configuration error at start).
        """
        super().__init__(fingerprint)
        self.spec = spec
        self.timeout_s = timeout_s
        # every registered scratch buffer, registered again on each connection: lookups', writes',
        # and the reader's (its workers' and its copy path's)
        self._lookup_scratch = [RegisteredSlots(BATCH_KEYS) for _ in range(LOOKUP_THREADS)]
        self._write_scratch = RegisteredSlots(BATCH_KEYS)
        reader_scratch = [RegisteredSlots(BATCH_KEYS) for _ in range(READ_THREADS)]
        copy_scratch = RegisteredSlots(BATCH_KEYS)
        scratch = (*self._lookup_scratch, *reader_scratch, copy_scratch, self._write_scratch)
        self.objects = MooncakeObjects(
            spec, fingerprint, count=self._count, timeout_s=timeout_s, retry_after_s=retry_after_s,
            max_retry_after_s=max_retry_after_s,
            adopt=lambda store: all(store.register_buffer(b.base, b.array.nbytes) == 0 for b in scratch))
        self.reader = MooncakeReader(self.objects, worker_scratch=reader_scratch, copy_scratch=copy_scratch,
                                     timeout_s=timeout_s, removes=removes)
        self._write_lock = threading.Lock()
        self._lookups = Workers("kvconnect-mooncake-lookup", LOOKUP_THREADS)
        self._stats.capacity_bytes = spec.global_segment_bytes

    # -- keys, connection, counters --------------------------------------------------
    def object_keys(self, key: ChunkKey) -> tuple[str, str]:
        """The header and payload object names of ``key``."""
        return self.objects.names(key)

    @property
    def counters(self) -> dict[str, int]:
        """Failures by kind and the bytes registered (a copy)."""
        return self.objects.counter_values()

    @property
    def connected(self) -> bool:
        return self.objects.link.connected

    def healthy(self) -> bool:
        return self.objects.link.healthy()

    def attach_pool(self, pool) -> None:
        """Register ``pool.buffer`` (a private pool or the node server's mapping) on first use."""
        self.objects.attach_pool(pool)

    # -- reads ---------------------------------------------------------------------------
    def read_into(self, key: ChunkKey, out: memoryview):
        return self.reader.read_into(key, out)

    def read_many_into(self, keys, outs, *, on_abandoned=None):
        return self.reader.read_many_into(keys, outs, on_abandoned=on_abandoned)

    def get(self, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]:
        return self.reader.get(keys)

    # -- lookups -----------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        self._count(lookups=len(keys))
        out: list[Optional[int]] = [None] * len(keys)
        store = self.objects.link.enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return out
        deadline = time.monotonic() + self.timeout_s
        # the job owns the in-flight mark from here (it may outlive this wait; close waits for it)
        try:
            status, result = self._lookups.run(lambda slot: self._read_headers(store, keys, slot, deadline),
                                               self.timeout_s)
        except Exception:  # a binding error: the tier's own bug, still only a miss
            logger.exception("kvconnect: Mooncake lookup failed")
            self._count(errors=1)
            return out
        if status == "busy":
            self.objects.link.exit()
        if status != "done":  # a stalled master (or a lookup still stuck from before): a miss, and back off
            self.objects.bump("timeouts")
            self.objects.link.failure()
            self._count(errors=1)
            return out
        out = result
        self._count(lookup_hits=sum(m is not None for m in out))
        return out

    def _read_headers(self, store, keys: Sequence[ChunkKey], slot: int, deadline: float) -> list[Optional[int]]:
        """Group masks per key, on the lookup worker thread (it owns one in-flight mark).

        One ``batch_is_exist`` over both objects per BATCH_KEYS keys; the masks of keys
        present come from the masks this process has seen (its writes and reads), and a
        second, batched read of the headers fetches those it has not. A remembered mask is
        a hint, as every lookup is: ``read_into`` returns the stored header, and the engine
        restores by what it actually acquired. Batches stop at ``deadline``.
        """
        out: list[Optional[int]] = [None] * len(keys)
        try:
            for start in range(0, len(keys), BATCH_KEYS):
                if start and not self.objects.go_on(deadline):
                    break
                out[start : start + BATCH_KEYS] = self._read_header_batch(store, keys[start : start + BATCH_KEYS],
                                                                          self._lookup_scratch[slot])
        finally:
            self.objects.link.exit()
        return out

    def _read_header_batch(self, store, batch: Sequence[ChunkKey], scratch: RegisteredSlots) -> list[Optional[int]]:
        names = [self.objects.names(k)[0] for k in batch]
        # both parts of each chunk: an existence check renews an object's lease (Mooncake keeps it
        # from eviction meanwhile), and renewing headers alone made payloads the ones evicted,
        # leaving headers every lookup offered (orphans); a chunk is present when both parts are
        both = store.batch_is_exist(names + [self.objects.names(k)[1] for k in batch])  # 1, 0, or < 0 an error
        self.objects.judge([min(e, 0) for e in both])  # an answer closes the breaker, a failure code opens it
        n = len(batch)
        exist = [min(h, p) for h, p in zip(both[:n], both[n:])]
        out = self.objects.seen_masks(batch, exist)
        unknown = [i for i, (m, e) in enumerate(zip(out, exist)) if e == 1 and m is None]
        if not unknown:
            return out
        codes = store.batch_get_into([names[i] for i in unknown], [scratch.ptr(j) for j in range(len(unknown))],
                                     [HEADER_SLOT_BYTES] * len(unknown))
        bad = []
        for j, (i, code, what) in enumerate(zip(unknown, codes, self.objects.judge(codes))):
            mask = peek_mask(scratch.view(j, code), self.fingerprint, batch[i]) if what is Meaning.OK else None
            if what is Meaning.OK and mask is None:
                bad.append(batch[i])  # bytes read that are not this chunk's header: something else's
            elif what not in (Meaning.OK, Meaning.ABSENT):
                self._count(errors=1)
            out[i] = mask
            self.objects.remember(batch[i], mask)
        if bad:
            self._count(errors=len(bad), corrupt=len(bad))
            self.objects.remove(store, bad)
        return out

    # -- writes ----------------------------------------------------------------------
    def put(self, items: Sequence[StoreItem]) -> list[bool]:
        results = [False] * len(items)
        store = self.objects.link.enter()
        if store is None:
            self._count(skipped_unhealthy=1, errors=len(items))
            return results
        try:
            with self._write_lock:
                for start in range(0, len(items), BATCH_KEYS):
                    if start and not self.objects.link.breaker.allow():
                        self.objects.bump("cut_short")
                        break
                    batch = items[start : start + BATCH_KEYS]
                    results[start : start + len(batch)] = self._put_batch(store, batch)
        finally:
            self.objects.link.exit()
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
            if len(item.payload) and not self.objects.registered(store, address, len(item.payload)):
                if store.register_buffer(address, len(item.payload)) != 0:  # not a pool slot: for this call
                    continue
                temporary.append(address)
            payload_names.append(self.objects.names(item.key)[1])
            payload_ptrs.append(address)
            payload_sizes.append(len(item.payload))
            slots.append((i, len(header)))
        if not slots:
            return ok
        # one call, payloads then headers; a reader that meets a header of one write over the
        # payload of another finds the checksum wrong: a checked miss
        header_names = [self.objects.names(batch[i].key)[0] for i, _ in slots]
        try:
            codes = store.batch_upsert_from(payload_names + header_names,
                                            payload_ptrs + [scratch.ptr(i) for i, _ in slots],
                                            payload_sizes + [n for _, n in slots])
        finally:
            for address in temporary:
                store.unregister_buffer(address)
        meanings = self.objects.judge(codes)
        half = []
        for j, (i, _) in enumerate(slots):
            ok[i] = codes[j] == 0 and codes[len(slots) + j] == 0
            self.objects.remember(batch[i].key, batch[i].header.group_mask if ok[i] else None)
            parts = (meanings[j], meanings[len(slots) + j])
            if not ok[i] and Meaning.OK in parts and Meaning.IN_USE not in parts:
                half.append(batch[i].key)  # one part landed (e.g. the segments filled up in between)
            # a part IN_USE is another engine's write of the same chunk in flight: it lands whole
        if half:  # a payload alone wastes space; a header alone would be offered by every lookup
            self.objects.bump("half_written", len(half))
            self.objects.remove(store, half)
        return ok

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        store = self.objects.link.enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return [False] * len(keys)
        try:
            codes = self.objects.remove(store, keys)
        finally:
            self.objects.link.exit()
        self._count(deletes=sum(codes))
        return codes

    # -- lifecycle and figures -------------------------------------------------------
    def describe(self) -> dict:
        """What this process holds and how the tier fares (``kvconnect inspect``, tier_stats)."""
        link = self.objects.link
        return {"master": self.spec.master_address, "protocol": self.spec.protocol,
                "local_hostname": self.spec.local_hostname, "segment_bytes": self.spec.global_segment_bytes,
                "connected": self.connected, "healthy": self.healthy(), "connect_polls": link.connect_polls,
                "connects": link.connects, **self.objects.counter_values()}

    def failure_counts(self) -> dict[str, int]:
        """Mooncake's failures by kind (``codes``) plus lookups abandoned and batches
        cut short: what ``kvconnect_tier_failures_total`` exports beside ``tier_errors``."""
        counters = self.objects.counter_values()
        return {name: counters[name] for name in FAILURE_KINDS}

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop connecting, the lookup and read threads; close the store once no call is in flight."""
        self._lookups.stop()
        self.reader.close()
        self.objects.link.close(timeout_s)
        self.objects.detach_pools()
