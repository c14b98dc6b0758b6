"""Chunk files: one encoded chunk per file, written crash-safe, read verified.

What ``disk.DiskTier`` does with a file, apart from deciding which files to keep:
- names: ``<dir>/<key hex[:2]>/<key hex>-<group mask hex>.kvc`` (``chunk_path``; the name
  carries what a lookup answers, so an index is rebuilt from a listing), temporary files
  ``.<key hex>.<pid>.<thread>.<n>.tmp`` beside them (``tmp_path``, ``tmp_writer_pid``);
- writes: to a temporary name (optionally fsynced), then renamed over the final name by the
  caller, so a reader sees a whole old file or a whole new one (``write_file``, ``fsync_dir``);
- reads: the whole file (``read_file``) or the header checked and the payload straight into a
  pool slot, then its checksum (``read_file_into``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Sequence

from ..chunks import chunk_format
from ..chunks.chunk_format import ChunkHeader
from ..errors import CorruptChunkError, StorageError
from ..layout.spec import ChunkKey, Fingerprint
from .tier import read_header

logger = logging.getLogger("kvconnect.storage.disk")  # the disk tier's lines, whichever module logs them

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
KEY_HEX_CHARS = 32


def chunk_path(directory: str, key: ChunkKey, mask: int) -> str:
    hexkey = bytes(key).hex()
    return os.path.join(directory, hexkey[:2], f"{hexkey}-{mask:x}{SUFFIX}")


def tmp_path(directory: str, key: ChunkKey, n: int) -> str:
    """A temporary name no other writer (process, thread, or this one's earlier write) uses."""
    hexkey = bytes(key).hex()
    return os.path.join(directory, hexkey[:2], f".{hexkey}.{os.getpid()}.{threading.get_ident()}.{n}{TMP_SUFFIX}")


def tmp_writer_pid(name: str) -> int:
    """The pid in a temporary file's name, -1 when it has none."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1


def parse_name(name: str) -> Optional[tuple[ChunkKey, int]]:
    """(key, group mask) of a chunk file's name, None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    hexkey, _, hexmask = name[: -len(SUFFIX)].partition("-")
    if len(hexkey) != KEY_HEX_CHARS:
        return None
    try:
        return ChunkKey(bytes.fromhex(hexkey)), int(hexmask, 16)
    except ValueError:
        return None


def write_file(tmp: str, parts: Sequence[memoryview], *, fsync: bool) -> None:
    """Create ``tmp`` (never an existing file) holding ``parts``; raises OSError."""
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, parts)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, parts: Sequence[memoryview]) -> None:
    """Write every byte of ``parts`` to ``fd`` (a module-level function: tests inject ENOSPC here)."""
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            written = os.write(fd, view)
            view = view[written:]


def open_for_read(path: str, size_bytes: int) -> int:
    """An fd of ``path``; raises OSError, or StorageError when its size is not the indexed one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
    except OSError:
        os.close(fd)
        raise
    if actual != size_bytes:
        os.close(fd)
        raise StorageError(f"{path} is {actual} bytes, indexed as {size_bytes}")
    return fd


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise StorageError("file ended early")
        view, offset = view[n:], offset + n


def read_file(path: str, size_bytes: int) -> bytearray:
    """The whole file at ``path``; raises OSError or StorageError."""
    fd = open_for_read(path, size_bytes)
    try:
        buf = bytearray(size_bytes)
        pread_into(fd, memoryview(buf), 0)
        return buf
    finally:
        os.close(fd)


def read_file_into(path: str, size_bytes: int, fingerprint: Fingerprint, key: ChunkKey, out: memoryview) -> ChunkHeader:
    """Read the chunk at ``path``: verified header returned, payload placed in ``out``.

    Raises OSError, StorageError, or CorruptChunkError (``out`` may be partly written).
    """
    fd = open_for_read(path, size_bytes)
    try:
        fixed = os.pread(fd, chunk_format.FIXED_HEADER_BYTES, 0)
        if len(fixed) < chunk_format.FIXED_HEADER_BYTES:
            raise CorruptChunkError("file is shorter than a chunk header")
        header_bytes = chunk_format.FIXED_HEADER_BYTES + 8 * int.from_bytes(fixed[64:68], "little")
        payload_bytes = size_bytes - header_bytes
        if not 0 <= payload_bytes <= len(out):
            raise CorruptChunkError(f"payload of {payload_bytes} bytes does not fit a {len(out)}-byte slot")
        head = bytearray(header_bytes)
        pread_into(fd, memoryview(head), 0)
        header = read_header(head, fingerprint=fingerprint, key=key, payload_bytes=payload_bytes)
        payload = out[:payload_bytes]
        pread_into(fd, payload, header_bytes)
    finally:
        os.close(fd)
    if chunk_format.compute_checksum(header, payload) != header.checksum:
        raise CorruptChunkError("checksum mismatch")
    return header


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("kvconnect: disk tier cannot remove %s: %s", path, exc)
