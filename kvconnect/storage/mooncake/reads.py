"""The Mooncake tier's read path: ``MooncakeReader``, verified reads into pool slots.

``MooncakeTier`` builds one and hands it what a read needs: the tier's ``MooncakeObjects``
(names, link, code meanings, masks seen, removes, registered pools, the TierStats counter),
the registered header scratch of its read workers and of its copy reads (the tier allocates
every scratch buffer, because the link registers them all on each connection), and the
timeout. The reader owns the rest: its READ_THREADS read workers, the measured read rate, and
the lock of the copy path (``get``: one registered scratch, one read at a time).

Verification. ``read_into`` reads header and payload in one call and checks them as
``chunk_format.decode`` does (magic, version, fingerprint, key, sizes, checksum over both):
a value written by something else, a damaged one, or a header of one write over the
payload of another is a miss, counted as ``corrupt``, and removed. Only bytes that were
read and failed these checks are ever removed; a return code never removes anything
(``codes`` decides what each code means), with one exception: the two objects
are evicted independently, so a read that finds one part of a chunk absent removes the
other part (counted in ``parts_missing``), and lookups stop offering the chunk. A follower's
reader (``removes=False``: a TP replica, a rank reading another TP size's objects) counts the
same misses and removes nothing: the objects are the writer's, whose own reads remove what
is damaged or half evicted.

Bounds. A read may take ``read_budget_s`` of the bytes it asks for: ``timeout_s`` plus the
bytes at the slower of an assumed healthy rate and half the measured one (one constant cut
healthy 100-chunk reads short). Its batches run on one of READ_THREADS read workers, each
with its own header scratch, and stop between batches at the deadline or once the breaker
opened. Mooncake keeps writing into the pool slots of a batch until its transfer returns,
which a stalled segment holder delays by a minute whatever ``MC_RPC_TIMEOUT_MS`` says: so
at the deadline the caller stops waiting (``on_abandoned``), the batch in flight is a miss,
and its slots stay lent to the abandoned transfer (out of the pool) until it returns; no
later chunk can be written into them meanwhile. What was not read is a miss, counted in
``short_reads``. ``get`` (export and copies; not the hot path) reads encoded, verified
chunks into fresh buffers.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from ...chunks import chunk_format
from ...chunks.chunk_format import ChunkHeader
from ...errors import CorruptChunkError
from ...layout.spec import ChunkKey
from ..tier import copy_payload, read_header, verified
from .buffers import BATCH_KEYS, HEADER_SLOT_BYTES, RegisteredSlots, view_address
from .codes import Meaning
from .objects import MooncakeObjects
from .workers import Workers

logger = logging.getLogger("kvconnect.storage.mooncake.tier")  # one logger for the whole tier

READ_THREADS = 2  # reads in flight at once: one stalled read must not block the next step's
ASSUMED_READ_BYTES_PER_S = 64 << 20  # a healthy link moves at least this (read_budget_s)
MIN_READ_BYTES_PER_S = 16 << 20  # the slowest rate a measurement may stretch the budget to
MEASURED_BATCH_BYTES = 1 << 20


class MooncakeReader:
    """The read path of one ``MooncakeTier``: ``read_into``, ``read_many_into``, ``get``."""

    def __init__(self, objects: MooncakeObjects, *, worker_scratch: Sequence[RegisteredSlots],
                 copy_scratch: RegisteredSlots, timeout_s: float, removes: bool = True) -> None:
        self.objects = objects
        self.timeout_s = timeout_s
        # False for a follower (a replica, a reader of another TP size's objects): it never removes
        # the writer's objects, not even a chunk that looks partial or corrupt (the writer's decides)
        self.removes = removes
        self.read_rate = ReadRate()
        self._scratch = list(worker_scratch)  # one per read worker
        self._workers = Workers("kvconnect-mooncake-read", len(self._scratch))
        self._copy_scratch = copy_scratch
        self._copy_lock = threading.Lock()  # the copy path's one scratch: one read at a time

    def close(self) -> None:
        self._workers.stop()

    def read_into(self, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        return self.read_many_into([key], [out])[0]

    def read_budget_s(self, nbytes: int) -> float:
        """How long a read of ``nbytes`` may take: ``timeout_s`` plus the bytes at the slower of
        ASSUMED_READ_BYTES_PER_S and half the throughput measured on this tier (never below
        MIN_READ_BYTES_PER_S). One constant cut large reads short on a healthy link (the first
        100-chunk read loaded 64 chunks); a stalled transport costs this budget, no more."""
        rate = ASSUMED_READ_BYTES_PER_S
        measured = self.read_rate.bytes_per_s
        if measured:
            rate = min(rate, max(MIN_READ_BYTES_PER_S, measured / 2))
        return self.timeout_s + nbytes / rate

    def read_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview], *,
                       on_abandoned: Optional[Callable[[list[int]], Callable[[], None]]] = None,
                       ) -> list[Optional[ChunkHeader]]:
        """``read_into`` for many keys: one ``batch_get_into`` per BATCH_KEYS chunks, each payload
        straight into its ``out`` (pool slots); a verified header per key, None for a miss.

        Bounded by ``read_budget_s`` of the bytes asked for, whatever the transport does: the
        batches run on a read worker, stop between batches at the deadline or once the
        breaker opened, and with ``on_abandoned`` the caller stops waiting at the deadline.
        The batch then in flight may still write its outs: they come back None, after
        ``on_abandoned(indices)``, whose result is called (on the worker) once the abandoned
        call returned; the caller must not reuse those outs before. Without ``on_abandoned``
        the caller waits for the batch in flight."""
        self.objects.count(gets=len(keys))
        result: list[Optional[ChunkHeader]] = [None] * len(keys)
        store = self.objects.link.enter()
        if store is None:
            self.objects.count(skipped_unhealthy=1)
            return result
        handed = False  # the read worker owns the in-flight mark once it took the job
        cut = False
        try:
            deadline = time.monotonic() + self.read_budget_s(sum(len(out) for out in outs))
            direct = []
            for i, (key, out) in enumerate(zip(keys, outs)):
                address = view_address(out)
                if self.objects.registered(store, address, len(out)):
                    direct.append((i, address))
                elif self.objects.go_on(deadline):
                    result[i] = self._read_copy(store, key, out)
                else:
                    cut = True
            if direct:
                job = _ReadJob(direct)
                wait_s = max(0.0, deadline - time.monotonic()) if on_abandoned is not None else None
                try:
                    status, _ = self._workers.run(
                        lambda slot: self._read_batches(store, keys, outs, job, slot, deadline), wait_s)
                except Exception:  # raised by the job, which ran and let go of the in-flight mark
                    handed = True
                    raise
                handed = status != "busy"
                if status == "busy":  # every read worker is held by a stalled read: a miss, at once
                    self.objects.bump("reads_refused")
                cut = self._collect(job, result, status, on_abandoned) or cut
        finally:
            if not handed:
                self.objects.link.exit()
        if cut:  # chunks asked for and never read: a capacity loss when the link was healthy
            self.objects.bump("short_reads")
        return result

    def _read_batches(self, store, keys: Sequence[ChunkKey], outs: Sequence[memoryview], job: "_ReadJob",
                      slot: int, deadline: float) -> None:
        """The batches of one read, on a read worker with its own header scratch; each batch's
        headers are published to ``job`` unless the caller has stopped waiting."""
        try:
            direct = job.direct
            for start in range(0, len(direct), BATCH_KEYS):
                batch = direct[start : start + BATCH_KEYS]
                with job.lock:
                    if job.abandoned:
                        return
                    if start and not self.objects.go_on(deadline):
                        job.cut = True
                        return
                    job.in_flight = [i for i, _ in batch]
                began = time.monotonic()
                headers = self._read_verified(store, [keys[i] for i, _ in batch], [outs[i] for i, _ in batch],
                                              [a for _, a in batch], self._scratch[slot])
                self.read_rate.add(sum(len(outs[i]) for i, _ in batch), time.monotonic() - began)
                with job.lock:
                    job.in_flight = []
                    if job.abandoned:
                        return
                    job.headers.update({i: h for (i, _), h in zip(batch, headers)})
        finally:
            self.objects.link.exit()
            with job.lock:
                job.finished = True
                late = job.release
            if late is not None:
                try:
                    late()
                except Exception:  # the caller's buffers are its own; never lose the worker thread
                    logger.exception("kvconnect: releasing the buffers of an abandoned Mooncake read failed")

    def _collect(self, job: "_ReadJob", result: list, status: str,
                 on_abandoned: Optional[Callable[[list[int]], Callable[[], None]]]) -> bool:
        """Move the published headers of ``job`` into ``result``; past the deadline, abandon it.
        True when the read was cut short (by its deadline, the breaker, or refused)."""
        with job.lock:
            if status == "timeout" and not job.finished:
                job.abandoned = True
                self.objects.bump("reads_abandoned")
                if job.in_flight and on_abandoned is not None:
                    job.release = on_abandoned(list(job.in_flight))
            for i, header in job.headers.items():
                result[i] = header
        if job.abandoned:
            self.objects.link.failure()  # the transport stalled: back off instead of paying a budget per step
        return job.abandoned or job.cut or status == "busy"

    def _read_verified(self, store, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                       addresses: Sequence[int], scratch) -> list[Optional[ChunkHeader]]:
        """Headers and payloads of up to BATCH_KEYS chunks in one call, each checked like decode."""
        names = [self.objects.names(k) for k in keys]
        n = len(keys)
        codes = store.batch_get_into([h for h, _ in names] + [p for _, p in names],
                                     [scratch.ptr(j) for j in range(n)] + list(addresses),
                                     [HEADER_SLOT_BYTES] * n + [len(out) for out in outs])
        meanings = self.objects.judge(codes)
        out_headers: list[Optional[ChunkHeader]] = []
        bad, partial = [], []
        for j, key in enumerate(keys):
            header_len, payload_len = codes[j], codes[n + j]
            verdict = _chunk_verdict(meanings[j], meanings[n + j])
            if verdict != "read":
                if verdict == "partial":
                    partial.append(key)
                elif verdict == "failed":
                    self.objects.count(errors=1)
                self.objects.remember(key, None)
                out_headers.append(None)
                continue
            try:
                header = read_header(scratch.view(j, header_len), fingerprint=self.objects.fingerprint, key=key,
                                     payload_bytes=payload_len)
                if chunk_format.compute_checksum(header, outs[j][:payload_len]) != header.checksum:
                    raise CorruptChunkError("checksum mismatch")
            except CorruptChunkError as exc:
                logger.warning("kvconnect: Mooncake value under %s is not this chunk (%s); removing it", names[j][1], exc)
                self.objects.count(errors=1, corrupt=1)
                bad.append(key)
                out_headers.append(None)
                continue
            self.objects.count(get_hits=1, bytes_read=header_len + payload_len)
            self.objects.remember(key, header.group_mask)
            out_headers.append(header)
        self._drop_partial(store, partial)
        if bad:
            self._remove(store, bad)
        return out_headers

    def _remove(self, store, keys: Sequence[ChunkKey]) -> None:
        if self.removes:
            self.objects.remove(store, keys)

    def _drop_partial(self, store, keys: Sequence[ChunkKey]) -> None:
        """Remove chunks found with one part evicted: the other part alone is never a hit, and
        lookups must not offer it again."""
        if keys:
            self.objects.bump("parts_missing", len(keys))
            self.objects.count(errors=len(keys))
            self._remove(store, keys)

    def _read_copy(self, store, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        """read_into for a buffer outside every attached pool: through a registered copy."""
        (data,) = self._get_many(store, [key], time.monotonic() + self.timeout_s)
        if data is None:
            return None
        header = copy_payload(data, out)
        if header is None:
            self.objects.count(errors=1, corrupt=1)
            return None
        self.objects.count(get_hits=1, bytes_read=len(data))
        return header

    def get(self, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]:
        self.objects.count(gets=len(keys))
        store = self.objects.link.enter()
        if store is None:
            self.objects.count(skipped_unhealthy=1)
            return [None] * len(keys)
        try:
            out = self._get_many(store, keys, time.monotonic() + self.timeout_s)
        finally:
            self.objects.link.exit()
        self.objects.count(get_hits=sum(d is not None for d in out), bytes_read=sum(len(d) for d in out if d is not None))
        return out

    def _get_many(self, store, keys: Sequence[ChunkKey], deadline: float) -> list[Optional[bytes]]:
        """Encoded, verified chunks read into fresh buffers (export and copies; not the hot path)."""
        out: list[Optional[bytes]] = [None] * len(keys)
        with self._copy_lock:
            for i, key in enumerate(keys):
                if i and not self.objects.go_on(deadline):
                    break
                out[i] = self._get_one(store, key)
        return out

    def _get_one(self, store, key: ChunkKey) -> Optional[bytes]:
        header_name, payload_name = self.objects.names(key)
        (code,) = store.batch_get_into([header_name], [self._copy_scratch.ptr(0)], [HEADER_SLOT_BYTES])
        (what,) = self.objects.judge([code])
        if what is not Meaning.OK:
            self.objects.count(errors=int(what is not Meaning.ABSENT))
            return None
        try:
            # the header object alone: its payload, read below, must then be the length it names
            header = chunk_format.decode_detached_header(bytes(self._copy_scratch.view(0, code)), payload_bytes=None)
        except CorruptChunkError:
            header = None
        if header is None or header.payload_bytes > (1 << 34):
            self.objects.count(errors=1, corrupt=1)
            self._remove(store, [key])
            return None
        buffer = np.empty(header.header_bytes + header.payload_bytes, dtype=np.uint8)
        buffer[: header.header_bytes] = self._copy_scratch.array[: header.header_bytes]
        payload = buffer[header.header_bytes :]
        if payload.nbytes and store.register_buffer(payload.ctypes.data, payload.nbytes) != 0:
            self.objects.count(errors=1)
            return None
        try:
            (got,) = store.batch_get_into([payload_name], [payload.ctypes.data], [payload.nbytes])
        finally:
            if payload.nbytes:
                store.unregister_buffer(payload.ctypes.data)
        (what,) = self.objects.judge([got])
        verdict = _chunk_verdict(Meaning.OK, what)
        if verdict == "partial":
            self._drop_partial(store, [key])
            return None
        if verdict == "failed":
            self.objects.count(errors=1)
            return None
        if got != header.payload_bytes or not verified(buffer, self.objects.fingerprint, key):
            self.objects.count(errors=1, corrupt=1)
            self._remove(store, [key])
            return None
        return buffer.tobytes()


class _ReadJob:
    """One ``read_many_into`` on a read worker: the headers of the batches it finished, the
    outs of the batch in flight, and whether the caller stopped waiting for it."""

    def __init__(self, direct: list[tuple[int, int]]) -> None:
        self.direct = direct  # (index, address) of each out read zero-copy
        self.lock = threading.Lock()
        self.headers: dict[int, Optional[ChunkHeader]] = {}
        self.in_flight: list[int] = []
        self.abandoned = False
        self.cut = False  # stopped between batches (deadline or breaker)
        self.finished = False
        self.release: Optional[Callable[[], None]] = None


class ReadRate:
    """Bytes per second of this tier's reads, a moving average over batches of at least
    MEASURED_BATCH_BYTES (smaller ones measure latency, not throughput)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_per_s = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes < MEASURED_BATCH_BYTES or seconds <= 0:
            return
        with self._lock:
            rate = nbytes / seconds
            self.bytes_per_s = rate if not self.bytes_per_s else 0.8 * self.bytes_per_s + 0.2 * rate


def _chunk_verdict(header: Meaning, payload: Meaning) -> str:
    """What the two codes of one chunk's read mean together: "read" (verify the bytes),
    "partial" (one part evicted: remove the rest), "absent", "failed" (a transport, lease or
    other failure: a miss, nothing removed)."""
    if header is Meaning.OK and payload is Meaning.OK:
        return "read"
    if Meaning.ABSENT in (header, payload):
        other = payload if header is Meaning.ABSENT else header
        if other is Meaning.OK:
            return "partial"
        if other is Meaning.ABSENT:
            return "absent"
    return "failed"
