"""The shared-memory segment the cache server owns and every engine process maps.

A segment is a file in ``/dev/shm`` (tmpfs), mode 0600, named by a digest of the server
URL (``kvconnect-<32 hex>``) so that a restarted server replaces its predecessor's file
instead of leaking one per crash. Layout::

    offset 0     magic b"KVCSHM01"
    offset 8     instance id (16 bytes; a new one per server start)
    offset 24    page bytes (u64), number of pages (u64), data offset (u64)
    data_offset  num_pages pages of page_bytes each: chunk payloads

The server creates it with ``posix_fallocate`` so that a tmpfs too small for the pool
fails at startup with an error instead of a SIGBUS in some engine on first touch.
Clients open it by the name the server announces in its hello reply, check size, magic
and instance id (a segment of another server start is refused), and map it shared.

We use a plain file + mmap rather than ``multiprocessing.shared_memory``: on the Python
versions we support, its resource tracker unlinks a segment when any *attaching* process
exits, which would pull the pool from under every other engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import pwd
import re
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError, StorageError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MAGIC = b"KVCSHM01"
_HEADER = struct.Struct("<8s16sQQQ")
DATA_OFFSET = 4096  # header page; data pages start page-aligned
_NAME = re.compile(r"^kvconnect-[0-9a-f]{32}$")
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and we skip
_PREFAULT_STEP_BYTES = 256 << 20


def _owner(path: str) -> str:
    """``uid N (name)`` of the file at ``path``, for an error message."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return "an unknown user"
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def segment_name(url: str) -> str:
    return "kvconnect-" + hashlib.sha256(url.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True, kw_only=True)
class SegmentInfo:
    name: str
    instance: bytes
    page_bytes: int
    num_pages: int

    @property
    def total_bytes(self) -> int:
        return DATA_OFFSET + self.page_bytes * self.num_pages


class Segment:
    """A mapped segment; ``buffer`` is a uint8 tensor over the whole mapping."""

    def __init__(self, info: SegmentInfo, path: str, mapping: mmap.mmap, *, owner: bool) -> None:
        self.info = info
        self.path = path
        self._mmap = mapping
        self.owner = owner
        self.buffer = torch.frombuffer(mapping, dtype=torch.uint8)

    # -- server side -------------------------------------------------------------------
    @classmethod
    def create(cls, url: str, instance: bytes, page_bytes: int, num_pages: int, *, shm_dir: str = SHM_DIR) -> "Segment":
        """Create (replacing a predecessor's file) and fully reserve the segment for ``url``."""
        if page_bytes <= 0 or page_bytes % 4096 or num_pages <= 0:
            raise ConfigError(f"page bytes must be a positive multiple of 4096 and pages > 0, got {page_bytes}, {num_pages}")
        if not os.path.isdir(shm_dir):
            raise ConfigError(f"shared-memory directory {shm_dir!r} does not exist")
        info = SegmentInfo(name=segment_name(url), instance=instance, page_bytes=page_bytes, num_pages=num_pages)
        path = os.path.join(shm_dir, info.name)
        try:
            os.unlink(path)  # a crashed predecessor's segment; its clients keep their mapping
        except FileNotFoundError:
            pass
        except PermissionError as exc:  # /dev/shm is sticky: only the file's owner (or root) may remove it
            raise ConfigError(f"cannot replace shared segment {path}: {_owner(path)} owns it, this server runs as "
                              f"uid {os.geteuid()}; remove it as that user or root, or serve another URL") from exc
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError as exc:  # made between our unlink and open: by someone else
            raise ConfigError(f"shared segment {path} was created again by {_owner(path)} while this server "
                              "replaced it: is another server starting on the same URL?") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, info.total_bytes)
            except OSError as exc:
                os.unlink(path)
                raise ConfigError(
                    f"cannot reserve {info.total_bytes} bytes in {shm_dir} ({exc.strerror}): lower --size-gb or enlarge the tmpfs"
                ) from exc
            mapping = mmap.mmap(fd, info.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEADER.pack_into(mapping, 0, MAGIC, instance, page_bytes, num_pages, DATA_OFFSET)
        return cls(info, path, mapping, owner=True)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- client side -------------------------------------------------------------------
    @classmethod
    def attach(cls, info: SegmentInfo, *, shm_dir: str = SHM_DIR, owner_uid: Optional[int] = None) -> "Segment":
        """Map the segment a hello reply announced; StorageError if it is not that segment, or
        (``owner_uid`` given) if another user than the server's owns the file."""
        if not _NAME.match(info.name):
            raise StorageError(f"server announced an invalid segment name {info.name!r}")
        path = os.path.join(shm_dir, info.name)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise StorageError(f"cannot open shared segment {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if owner_uid is not None and st.st_uid != owner_uid:
                raise StorageError(f"shared segment {path} belongs to uid {st.st_uid}, not to the server's uid {owner_uid}")
            size = st.st_size
            if size != info.total_bytes:  # a short file would SIGBUS on first touch
                raise StorageError(f"shared segment {path} is {size} bytes, server announced {info.total_bytes}")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, instance, page_bytes, num_pages, data_offset = _HEADER.unpack_from(mapping, 0)
        if magic != MAGIC or instance != info.instance or (page_bytes, num_pages, data_offset) != (info.page_bytes, info.num_pages, DATA_OFFSET):
            mapping.close()
            raise StorageError(f"shared segment {path} belongs to another server instance")
        return cls(info, path, mapping, owner=False)

    def prefault(self, stop: threading.Event) -> bool:
        """Map every page of the segment into this process now, not on first touch.

        Each process that maps tmpfs pays a minor fault per 4 KiB page the first time it
        touches it (~3.5 GB/s on a 2-core VM, a third of copy speed); a client runs this
        in a background thread right after connecting. MADV_POPULATE_WRITE faults pages
        in without touching their bytes, through ctypes so the GIL is released. Holding
        ``view`` keeps the mapping alive (``close`` cannot unmap it) until we return.
        """
        if sys.platform != "linux":
            return False
        view = self.buffer
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return False
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base, size = view.data_ptr(), view.numel()
        for start in range(0, size, _PREFAULT_STEP_BYTES):
            if stop.is_set():
                return False
            if madvise(base + start, min(_PREFAULT_STEP_BYTES, size - start), _MADV_POPULATE_WRITE) != 0:
                return False  # old kernel (EINVAL) or memory pressure: first touch will fault instead
        return True

    # -- both --------------------------------------------------------------------------
    def page_offset(self, page: int) -> int:
        return DATA_OFFSET + page * self.info.page_bytes

    def close(self) -> None:
        """Drop our reference; the mapping is unmapped once no tensor view still uses it."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        try:
            self._mmap.close()
        except BufferError:  # views handed out earlier are alive: the GC unmaps later
            pass


def register_host_memory(buffer: torch.Tensor) -> bool:
    """Page-lock a mapping for fast, asynchronous device copies (cudaHostRegister).

    Returns True when registered. Any failure (no CUDA, no permission, RLIMIT_MEMLOCK) is
    logged and leaves the pool pageable: copies still work, only slower.
    """
    if buffer.numel() == 0:
        return False
    try:
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    except Exception:  # pragma: no cover - depends on the CUDA build
        logger.warning("kvconnect: cudaHostRegister unavailable; the shared pool stays pageable", exc_info=True)
        return False
    if int(err) != 0:
        logger.warning("kvconnect: cudaHostRegister failed (%s); the shared pool stays pageable", err)
        return False
    return True


def unregister_host_memory(buffer: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    except Exception:  # pragma: no cover
        logger.warning("kvconnect: cudaHostUnregister failed", exc_info=True)

