"""The canonical stored chunk: a fixed header, per-plane row ranges, then plane-major rows.

    offset  size  field
    0       4     magic b"KVCH"
    4       2     format version
    6       2     reserved (0)
    8       16    layout fingerprint
    24      16    chunk key
    40      8     token start
    48      8     token end
    56      8     group mask (bit g: group g's rows for this chunk are stored)
    64      4     number of planes P
    68      4     reserved (0)
    72      8     payload bytes
    80      8     checksum: XXH3-64 over header (checksum field zeroed) and payload
    88      8*P   per plane: first row (u32), number of rows (u32)
    ...           payload: plane 0 rows, plane 1 rows, ... each row exactly row_bytes

Every read from outside process memory (disk, remote, another process) goes through
``decode_header`` + ``verify``: a chunk with a wrong magic, version, fingerprint, key, size
or checksum raises ``CorruptChunkError`` and is treated as a miss.
"""

from __future__ import annotations

import functools
import itertools
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import xxhash

from ..errors import CorruptChunkError
from ..layout.kv_layout import FORMAT_VERSION
from ..layout.spec import ChunkKey, Fingerprint

MAGIC = b"KVCH"
_FIXED = struct.Struct("<4sHH16s16sQQQIIQQ")
FIXED_HEADER_BYTES = _FIXED.size  # 88
_CHECKSUM_OFFSET = 80


@dataclass(frozen=True, kw_only=True)
class ChunkHeader:
    fingerprint: Fingerprint
    key: ChunkKey
    token_start: int
    token_end: int
    group_mask: int
    plane_rows: tuple[tuple[int, int], ...]  # (first_row, num_rows) per plane
    payload_bytes: int
    checksum: int = 0

    @functools.cached_property
    def plane_rows_array(self) -> np.ndarray:
        """``plane_rows`` as a read-only int64 [planes, 2] array, made once per header (a retrieve
        reads it for every stored object it loads)."""
        rows = np.fromiter(itertools.chain.from_iterable(self.plane_rows), np.int64, 2 * len(self.plane_rows)).reshape(-1, 2)
        rows.setflags(write=False)
        return rows

    @property
    def header_bytes(self) -> int:
        return FIXED_HEADER_BYTES + 8 * len(self.plane_rows)

    def pack(self, checksum: int | None = None) -> bytes:
        fixed = _FIXED.pack(
            MAGIC, FORMAT_VERSION, 0, bytes(self.fingerprint), bytes(self.key), self.token_start, self.token_end,
            self.group_mask, len(self.plane_rows), 0, self.payload_bytes, self.checksum if checksum is None else checksum,
        )
        rows = np.asarray(self.plane_rows, dtype="<u4").reshape(-1, 2).tobytes()
        return fixed + rows


def compute_checksum(header: ChunkHeader, payload) -> int:
    h = xxhash.xxh3_64()
    h.update(header.pack(checksum=0))
    h.update(payload)
    return h.intdigest()


def encode(header: ChunkHeader, payload) -> bytes:
    """Header (with checksum) + payload, ready for a disk file or a remote value."""
    payload = memoryview(payload).cast("B")
    if len(payload) != header.payload_bytes:
        raise CorruptChunkError(f"payload is {len(payload)} bytes, header says {header.payload_bytes}")
    checksum = compute_checksum(header, payload)
    return header.pack(checksum) + bytes(payload)


def _fixed_fields(view: memoryview) -> tuple:
    """The fixed header's fields, after the checks that need no payload."""
    if len(view) < FIXED_HEADER_BYTES:
        raise CorruptChunkError(f"chunk of {len(view)} bytes is shorter than its header")
    fields = _FIXED.unpack_from(view)
    magic, version, reserved0, _, _, start, end, _, num_planes, reserved1, _, _ = fields
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {magic!r}")
    if reserved0 or reserved1:  # the checksum re-packs them as 0, so it cannot see a flip here
        raise CorruptChunkError("reserved header fields are not 0")
    if version != FORMAT_VERSION:
        raise CorruptChunkError(f"format version {version}, this build reads {FORMAT_VERSION}")
    if num_planes > 1 << 20 or end < start:
        raise CorruptChunkError("implausible header (plane count or token range)")
    return fields


def _header_from(view: memoryview, fields: tuple) -> ChunkHeader:
    _, _, _, fp, key, start, end, mask, num_planes, _, payload_bytes, checksum = fields
    header_bytes = FIXED_HEADER_BYTES + 8 * num_planes
    rows = np.frombuffer(view[FIXED_HEADER_BYTES:header_bytes], dtype="<u4").reshape(-1, 2)
    return ChunkHeader(
        fingerprint=Fingerprint(fp), key=ChunkKey(key), token_start=start, token_end=end, group_mask=mask,
        plane_rows=tuple((int(a), int(n)) for a, n in rows), payload_bytes=payload_bytes, checksum=checksum,
    )


def peek_identity(data) -> tuple[Fingerprint, ChunkKey, int]:
    """(fingerprint, key, group mask) from the first FIXED_HEADER_BYTES of an encoded chunk."""
    fields = _fixed_fields(memoryview(data).cast("B"))
    return Fingerprint(fields[3]), ChunkKey(fields[4]), int(fields[7])


def decode_header(data) -> ChunkHeader:
    """Parse and sanity-check the header of a whole encoded chunk; does not verify the checksum."""
    view = memoryview(data).cast("B")
    fields = _fixed_fields(view)
    total = FIXED_HEADER_BYTES + 8 * fields[8] + fields[10]
    if len(view) != total:
        raise CorruptChunkError(f"chunk is {len(view)} bytes, header says {total}")
    return _header_from(view, fields)


def decode_detached_header(data, *, payload_bytes: Optional[int]) -> ChunkHeader:
    """Parse a header held apart from its ``payload_bytes``-byte payload (exactly the header's bytes);
    ``payload_bytes`` None: the payload is not read yet, the caller checks its length against the header's."""
    view = memoryview(data).cast("B")
    fields = _fixed_fields(view)
    if len(view) != FIXED_HEADER_BYTES + 8 * fields[8] or (payload_bytes is not None and fields[10] != payload_bytes):
        raise CorruptChunkError("header sizes do not match the chunk")
    return _header_from(view, fields)


def decode(data, *, fingerprint: Fingerprint, key: ChunkKey) -> tuple[ChunkHeader, memoryview]:
    """Verified header and a view of the payload; raises CorruptChunkError on any mismatch."""
    header = decode_header(data)
    if header.fingerprint != fingerprint:
        raise CorruptChunkError("chunk belongs to another layout (fingerprint mismatch)")
    if header.key != key:
        raise CorruptChunkError("chunk is stored under another key")
    payload = memoryview(data).cast("B")[header.header_bytes :]
    if compute_checksum(header, payload) != header.checksum:
        raise CorruptChunkError("checksum mismatch")
    return header, payload
