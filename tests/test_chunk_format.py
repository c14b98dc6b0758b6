"""The canonical stored chunk: every corruption is a CorruptChunkError, and export/import
moves chunks between engines byte for byte while refusing anything inconsistent."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from support import zoo
from kvconnect import CorruptChunkError, KVCacheEngine
from kvconnect.chunks import chunk_format as cf
from kvconnect.layout.kv_layout import FORMAT_VERSION

FP = bytes(range(16))
KEY = bytes(range(16, 32))


def _header(plane_rows=((0, 3), (5, 2)), payload_bytes=3 * 8 + 2 * 4, **kw):
    values = dict(fingerprint=FP, key=KEY, token_start=256, token_end=512, group_mask=0b11,
                  plane_rows=plane_rows, payload_bytes=payload_bytes)
    values.update(kw)
    return cf.ChunkHeader(**values)


def _chunk():
    header = _header()
    payload = bytes(np.random.default_rng(0).integers(0, 256, header.payload_bytes, dtype=np.uint8))
    return header, payload, cf.encode(header, payload)


def test_encode_decode_round_trip():
    header, payload, data = _chunk()
    assert len(data) == cf.FIXED_HEADER_BYTES + 8 * 2 + len(payload)
    assert data[:4] == b"KVCH" and struct.unpack_from("<H", data, 4)[0] == FORMAT_VERSION
    got, view = cf.decode(data, fingerprint=FP, key=KEY)
    assert bytes(view) == payload
    assert dataclasses.replace(got, checksum=0) == header
    assert got.checksum == cf.compute_checksum(header, payload)
    # decoding works on any bytes-like object without copying the payload
    got2, view2 = cf.decode(bytearray(data), fingerprint=FP, key=KEY)
    assert bytes(view2) == payload and got2 == got


def test_every_flipped_byte_is_detected():
    _, _, data = _chunk()
    for offset in range(len(data)):
        for bit in (0x01, 0x80):
            bad = bytearray(data)
            bad[offset] ^= bit
            with pytest.raises(CorruptChunkError):
                cf.decode(bad, fingerprint=FP, key=KEY)


def test_truncated_or_extended_chunks_are_refused():
    _, _, data = _chunk()
    for n in range(len(data)):
        with pytest.raises(CorruptChunkError):
            cf.decode(data[:n], fingerprint=FP, key=KEY)
    with pytest.raises(CorruptChunkError):
        cf.decode(data + b"\0", fingerprint=FP, key=KEY)


def test_wrong_identity_is_refused():
    _, _, data = _chunk()
    with pytest.raises(CorruptChunkError, match="fingerprint"):
        cf.decode(data, fingerprint=bytes(16), key=KEY)
    with pytest.raises(CorruptChunkError, match="key"):
        cf.decode(data, fingerprint=FP, key=bytes(16))


def _reseal(data: bytes, offset: int, value: bytes) -> bytes:
    """Change header bytes and recompute the checksum, as a foreign writer would."""
    bad = bytearray(data)
    bad[offset : offset + len(value)] = value
    bad[80:88] = bytes(8)
    import xxhash

    bad[80:88] = struct.pack("<Q", xxhash.xxh3_64(bytes(bad)).intdigest())
    return bytes(bad)


def test_wrong_version_or_magic_even_with_a_valid_checksum():
    _, _, data = _chunk()
    with pytest.raises(CorruptChunkError, match="version"):
        cf.decode(_reseal(data, 4, struct.pack("<H", FORMAT_VERSION + 1)), fingerprint=FP, key=KEY)
    with pytest.raises(CorruptChunkError, match="magic"):
        cf.decode(_reseal(data, 0, b"LMCH"), fingerprint=FP, key=KEY)
    with pytest.raises(CorruptChunkError):  # token range end < start
        cf.decode(_reseal(data, 48, struct.pack("<Q", 1)), fingerprint=FP, key=KEY)


def test_encode_refuses_a_payload_of_the_wrong_size():
    header = _header()
    with pytest.raises(CorruptChunkError):
        cf.encode(header, bytes(header.payload_bytes - 1))


# ---------------------------------------------------------------------------------------
# export / import between engines


def _stored_engine(rng, name="dsv32", chunk=64, n=192):
    case = zoo.build(name, max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    engine = KVCacheEngine(case.layout(), zoo.small_config(chunk))
    tables = zoo.random_tables(case, n, rng)
    assert engine.store(tokens, tables) == n
    return case, engine, tokens, tables


def test_export_import_round_trip(rng):
    case, engine, tokens, tables = _stored_engine(rng)
    dst = case.clone(fill=0)
    other = KVCacheEngine(dst.layout(), zoo.small_config(64))
    for c in engine.chunks(tokens, include_partial=False):
        data = engine.storage.export_chunk(c.key)
        assert other.storage.import_chunk(data, c.key)
        assert other.storage.export_chunk(c.key) == data  # byte-identical after the move
    assert other.lookup(tokens) == len(tokens)
    assert engine.storage.export_chunk(bytes(16)) is None


def _pool_state(engine):
    s = engine.pool.stats()
    return len(engine.pool), s.used_slots, s.extra["pinned"]


def test_corrupted_import_inserts_nothing(rng):
    case, engine, tokens, _ = _stored_engine(rng)
    other = KVCacheEngine(case.clone(fill=0).layout(), zoo.small_config(64))
    c0, c1 = engine.chunks(tokens, include_partial=False)[:2]
    data = engine.storage.export_chunk(c0.key)
    before = _pool_state(other)
    bad = bytearray(data)
    bad[-1] ^= 0xFF
    cases = [
        (bytes(bad), c0.key),  # flipped payload byte
        (data[:-1], c0.key),  # truncated
        (data, c1.key),  # stored under another key
        (b"", c0.key),
    ]
    for blob, key in cases:
        with pytest.raises(CorruptChunkError):
            other.storage.import_chunk(blob, key)
        assert _pool_state(other) == before
        assert other.storage.masks([c0.key, c1.key]) == [None, None]
    # another layout (other model) refuses it too
    foreign = KVCacheEngine(case.layout(model_name="not-this-model"), zoo.small_config(64))
    with pytest.raises(CorruptChunkError):
        foreign.storage.import_chunk(data, c0.key)
    assert len(foreign.pool) == 0


def test_import_of_an_oversized_payload_is_refused(rng):
    case, engine, tokens, _ = _stored_engine(rng)
    key = engine.chunks(tokens, include_partial=False)[0].key
    slot = engine.pool.slot_bytes
    header = cf.ChunkHeader(fingerprint=engine.layout.fingerprint, key=key, token_start=0, token_end=64, group_mask=1,
                            plane_rows=((0, 0),) * len(engine.layout.planes), payload_bytes=slot + 1)
    other = KVCacheEngine(case.layout(), zoo.small_config(64))
    with pytest.raises(CorruptChunkError):
        other.storage.import_chunk(cf.encode(header, bytes(slot + 1)), key)
    assert _pool_state(other) == (0, 0, 0)


@pytest.mark.parametrize("lie", ["rows beyond payload", "rows missing", "plane count"])
def test_consistent_checksum_inconsistent_rows_is_a_miss(lie, rng):
    """A chunk whose checksum is valid but whose plane rows do not match its payload or its
    group mask is never loaded: retrieve reports a miss, writes nothing and drops it."""
    case, engine, tokens, _ = _stored_engine(rng, name="dsv3-mla", chunk=64, n=128)
    dst = case.clone(fill=0)
    other = KVCacheEngine(dst.layout(), zoo.small_config(64))
    c0, c1 = engine.chunks(tokens, include_partial=False)
    other.storage.import_chunk(engine.storage.export_chunk(c0.key), c0.key)
    header, payload = cf.decode(engine.storage.export_chunk(c1.key), fingerprint=engine.layout.fingerprint, key=c1.key)
    row_bytes = engine.layout.planes[0].row_bytes
    if lie == "rows beyond payload":  # claims 64 rows per plane, carries only plane 0's
        forged = dataclasses.replace(header, payload_bytes=64 * row_bytes)
        blob = cf.encode(forged, bytes(payload)[: 64 * row_bytes])
    elif lie == "rows missing":  # group bit set, no rows stored
        forged = dataclasses.replace(header, plane_rows=((64, 0), (64, 0)), payload_bytes=0)
        blob = cf.encode(forged, b"")
    else:
        forged = dataclasses.replace(header, plane_rows=header.plane_rows[:1], payload_bytes=64 * row_bytes)
        blob = cf.encode(forged, bytes(payload)[: 64 * row_bytes])
    assert other.storage.import_chunk(blob, c1.key)
    before = dst.snapshot()
    assert other.retrieve(tokens, zoo.random_tables(case, 128, rng)) == 0
    assert dst.same_bytes(before)
    assert other.stats.corrupt_chunks == 1
    assert other.storage.masks([c1.key]) == [None]
    assert other.pool.stats().extra["pinned"] == 0
