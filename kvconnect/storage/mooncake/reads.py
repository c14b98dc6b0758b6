"""The Mooncake tier's read path, a mixin of ``MooncakeTier``: verified reads into pool slots.

``MooncakeReads`` is not a tier of its own: it is the read half of ``tier.MooncakeTier``
(which inherits it), split out to keep one concept per module, and it uses the tier's state
and helpers (``_link``, ``_read_lock``, ``_read_scratch``, ``_registered``, ``_judge``,
``_go_on``, ``_remember``, ``_remove``, ``_bump``, ``object_keys``, ``timeout_s``, and
``LowerTier``'s ``_count`` / ``_verify``).

Verification. ``read_into`` reads header and payload in one call and checks them as
``chunk_format.decode`` does (magic, version, fingerprint, key, sizes, checksum over both):
a value written by something else, a damaged one, or a header of one write over the
payload of another is a miss, counted as ``corrupt``, and removed. Only bytes that were
read and failed these checks are ever removed; a return code never removes anything
(``codes`` decides what each code means), with one exception: the two objects
are evicted independently, so a read that finds one part of a chunk absent removes the
other part (counted in ``parts_missing``), and lookups stop offering the chunk.

``read_into`` cannot be abandoned (Mooncake writes into the pool slot until it returns), so
a read of many chunks stops between batches once ``timeout_s`` has passed or the breaker
opened; what it did not read is a miss. ``get`` (export and copies; not the hot path) reads
encoded, verified chunks into fresh buffers.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import numpy as np

from ... import chunk_format
from ...chunk_format import ChunkHeader
from ...errors import CorruptChunkError
from ...spec import ChunkKey
from .buffers import BATCH_KEYS, HEADER_SLOT_BYTES, view_address
from .codes import Meaning
from ..tier import read_header

logger = logging.getLogger("kvconnect.storage.mooncake.tier")  # the name these reads have always logged under


class MooncakeReads:
    """The read path of ``MooncakeTier`` (a mixin: ``read_into``, ``read_many_into``, ``get``)."""

    def read_into(self, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        return self.read_many_into([key], [out])[0]

    def read_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[Optional[ChunkHeader]]:
        """``read_into`` for many keys: one ``batch_get_into`` per BATCH_KEYS chunks, each payload
        straight into its ``out`` (pool slots); a verified header per key, None for a miss.
        Stops between batches after ``timeout_s`` or once the breaker opened (the rest miss)."""
        self._count(gets=len(keys))
        result: list[Optional[ChunkHeader]] = [None] * len(keys)
        store = self._link.enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return result
        deadline = time.monotonic() + self.timeout_s
        try:
            direct = []
            for i, (key, out) in enumerate(zip(keys, outs)):
                address = view_address(out)
                if self._registered(store, address, len(out)):
                    direct.append((i, address))
                elif self._go_on(deadline):
                    result[i] = self._read_copy(store, key, out)
            with self._read_lock:
                for start in range(0, len(direct), BATCH_KEYS):
                    if start and not self._go_on(deadline):
                        break
                    batch = direct[start : start + BATCH_KEYS]
                    headers = self._read_verified(store, [keys[i] for i, _ in batch], [outs[i] for i, _ in batch],
                                                  [a for _, a in batch])
                    for (i, _), header in zip(batch, headers):
                        result[i] = header
        finally:
            self._link.exit()
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
        meanings = self._judge(codes)
        out_headers: list[Optional[ChunkHeader]] = []
        bad, partial = [], []
        for j, key in enumerate(keys):
            header_len, payload_len = codes[j], codes[n + j]
            verdict = _chunk_verdict(meanings[j], meanings[n + j])
            if verdict != "read":
                if verdict == "partial":
                    partial.append(key)
                elif verdict == "failed":
                    self._count(errors=1)
                self._remember(key, None)
                out_headers.append(None)
                continue
            try:
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
        self._drop_partial(store, partial)
        if bad:
            self._remove(store, bad)
        return out_headers

    def _drop_partial(self, store, keys: Sequence[ChunkKey]) -> None:
        """Remove chunks found with one part evicted: the other part alone is never a hit, and
        lookups must not offer it again."""
        if keys:
            self._bump("parts_missing", len(keys))
            self._count(errors=len(keys))
            self._remove(store, keys)

    def _read_copy(self, store, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        """read_into for a buffer outside every attached pool: through a registered copy."""
        (data,) = self._get_many(store, [key], time.monotonic() + self.timeout_s)
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
        store = self._link.enter()
        if store is None:
            self._count(skipped_unhealthy=1)
            return [None] * len(keys)
        try:
            out = self._get_many(store, keys, time.monotonic() + self.timeout_s)
        finally:
            self._link.exit()
        self._count(get_hits=sum(d is not None for d in out), bytes_read=sum(len(d) for d in out if d is not None))
        return out

    def _get_many(self, store, keys: Sequence[ChunkKey], deadline: float) -> list[Optional[bytes]]:
        """Encoded, verified chunks read into fresh buffers (export and copies; not the hot path)."""
        out: list[Optional[bytes]] = [None] * len(keys)
        with self._read_lock:
            for i, key in enumerate(keys):
                if i and not self._go_on(deadline):
                    break
                out[i] = self._get_one(store, key)
        return out

    def _get_one(self, store, key: ChunkKey) -> Optional[bytes]:
        header_name, payload_name = self.object_keys(key)
        (code,) = store.batch_get_into([header_name], [self._read_scratch.ptr(0)], [HEADER_SLOT_BYTES])
        (what,) = self._judge([code])
        if what is not Meaning.OK:
            self._count(errors=int(what is not Meaning.ABSENT))
            return None
        try:
            header = chunk_format.decode_header(bytes(self._read_scratch.view(0, code)))
        except CorruptChunkError:
            header = None
        if header is None or header.payload_bytes > (1 << 34):
            self._count(errors=1, corrupt=1)
            self._remove(store, [key])
            return None
        buffer = np.empty(header.header_bytes + header.payload_bytes, dtype=np.uint8)
        buffer[: header.header_bytes] = self._read_scratch.array[: header.header_bytes]
        payload = buffer[header.header_bytes :]
        if payload.nbytes and store.register_buffer(payload.ctypes.data, payload.nbytes) != 0:
            self._count(errors=1)
            return None
        try:
            (got,) = store.batch_get_into([payload_name], [payload.ctypes.data], [payload.nbytes])
        finally:
            if payload.nbytes:
                store.unregister_buffer(payload.ctypes.data)
        (what,) = self._judge([got])
        verdict = _chunk_verdict(Meaning.OK, what)
        if verdict == "partial":
            self._drop_partial(store, [key])
            return None
        if verdict == "failed":
            self._count(errors=1)
            return None
        if got != header.payload_bytes or not self._verify(buffer, key):
            self._count(errors=1, corrupt=1)
            self._remove(store, [key])
            return None
        return buffer.tobytes()


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
