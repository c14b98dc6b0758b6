"""Stored chunks for the tier tests: a fixed fingerprint, keys, and items whose bytes depend only on (i, version).

Shared by test_disk, test_redis and test_tiering, and by test_disk's writer child process
(which has this directory on sys.path).
"""

from __future__ import annotations

import numpy as np

from kvconnect.chunks import chunk_format
from kvconnect.chunks.chunk_format import ChunkHeader
from kvconnect.layout.spec import ChunkKey, Fingerprint
from kvconnect.storage.tier import StoreItem

FP = Fingerprint(bytes(range(16)))
OTHER_FP = Fingerprint(bytes(range(1, 17)))


def key_of(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def make_item(i: int, payload_bytes: int = 4096, *, mask: int = 1, version: int = 0, fp: Fingerprint = FP) -> StoreItem:
    payload = np.random.default_rng([i, version]).integers(0, 256, payload_bytes, dtype=np.uint8)
    header = ChunkHeader(fingerprint=fp, key=key_of(i), token_start=32 * i, token_end=32 * i + 32, group_mask=mask,
                         plane_rows=((i, 8), (i, 8)), payload_bytes=payload_bytes)
    return StoreItem(key=key_of(i), header=header, payload=memoryview(payload))


def encoded(item: StoreItem) -> bytes:
    return chunk_format.encode(item.header, item.payload)
