"""Host memory of the CPU pool: page tables populated ahead of the first store.

A pool is allocated untouched (``torch.empty``): the kernel maps a page at its first write,
and that first write is a store. On a 2-core VM a 2048-token store of a small Llama into
untouched pool pages took 3.7 ms against 0.8 ms into populated ones (benchmarks/pool_prefault.py,
docs/performance.md), and every chunk of a filling pool pays it once. ``prefault_in_background``
asks Linux (``madvise(MADV_POPULATE_WRITE)``, 5.14+) to map the buffer's pages writable in
slices, on a low-priority daemon thread, lowest slots first (the order the pool hands slots
out). Populating never changes a byte, so it may run while stores write the same pages.
Transparent huge pages are deliberately not requested: their first-touch cost (zeroing and
compacting 2 MiB) made stores slower still on that machine.

Anywhere this is unavailable (another OS, an older kernel, pinned memory that is resident
already) nothing happens, and the first store into each page faults it in.

A population still running when its pool closes, or when the interpreter exits, is stopped and
joined (at most one slice): a thread left inside the call while the interpreter finalises is
torn down by the runtime and takes the process with it (seen as "terminate called without an
active exception" after a short script).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
from typing import Optional

import torch

from ..errors import ConfigError

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, kernel 5.14+
PAGE_BYTES = 4096
GIB = 1 << 30
SLICE_BYTES = 32 << 20  # populated per call: a stop request waits at most one slice
STOP_WAIT_S = 10.0  # bound on joining a stopped population (one slice takes milliseconds)

_running: set["Prefault"] = set()
_running_lock = threading.Lock()
NICE_INCREMENT = 10  # the populating thread yields to the engine's and the store's threads


class Prefault:
    """The background population of one buffer (``join`` for tests; ``stop`` at close)."""

    def __init__(self, buffer: torch.Tensor, madvise) -> None:
        self._buffer = buffer  # kept alive until the thread is done with its address
        self._madvise = madvise
        self._stop = threading.Event()
        self.populated_bytes = 0
        self.error: Optional[int] = None  # errno of a failed call (population then stops)
        self._thread = threading.Thread(target=self._run, name="kvconnect-prefault", daemon=True)
        with _running_lock:
            _running.add(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._populate()
        finally:
            self._buffer = None
            with _running_lock:
                _running.discard(self)

    def _populate(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE_INCREMENT)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        start = self._buffer.data_ptr()
        end = start + self._buffer.numel()
        first = -(-start // PAGE_BYTES) * PAGE_BYTES
        last = end // PAGE_BYTES * PAGE_BYTES
        addr = first
        while addr < last and not self._stop.is_set():
            size = min(SLICE_BYTES, last - addr)
            if self._madvise(addr, size, MADV_POPULATE_WRITE) != 0:
                self.error = ctypes.get_errno()
                logger.debug("kvconnect: pool prefault stopped at %d of %d bytes (errno %d)", addr - first,
                             last - first, self.error)
                break
            addr += size
            self.populated_bytes = addr - first

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """Ask the thread to end after its current slice and wait for it; True once it ended."""
        self._stop.set()
        return self.join(wait_s)

    def join(self, timeout_s: Optional[float] = None) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


@atexit.register
def _stop_all() -> None:
    with _running_lock:
        running = list(_running)
    for job in running:
        job.stop()


CGROUP_V2_DIR = "/sys/fs/cgroup"  # cgroup v2: memory.max / memory.current of this process's group
CGROUP_V1_DIR = "/sys/fs/cgroup/memory"  # cgroup v1: memory.limit_in_bytes / memory.usage_in_bytes
MEMINFO_PATH = "/proc/meminfo"
NO_CGROUP_LIMIT_BYTES = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


def physical_memory_bytes() -> Optional[int]:
    """This host's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes(meminfo_path: str = MEMINFO_PATH) -> Optional[int]:
    """Linux's estimate of memory a new allocation can get without swapping (``MemAvailable``)."""
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2: no limit) reads as None


def cgroup_room_bytes(v2_dir: str = CGROUP_V2_DIR, v1_dir: str = CGROUP_V1_DIR) -> Optional[int]:
    """Bytes this process's memory cgroup still allows (limit minus usage); None without a limit.

    A container's limit is not in ``/proc/meminfo``: a pool above it is killed by the OOM killer
    while the host still shows memory free.
    """
    for limit_path, usage_path in ((os.path.join(v2_dir, "memory.max"), os.path.join(v2_dir, "memory.current")),
                                   (os.path.join(v1_dir, "memory.limit_in_bytes"),
                                    os.path.join(v1_dir, "memory.usage_in_bytes"))):
        limit = _read_int(limit_path)
        if limit is not None and limit < NO_CGROUP_LIMIT_BYTES:
            return max(0, limit - (_read_int(usage_path) or 0))
    return None


def host_room() -> tuple[Optional[int], str]:
    """(the most host memory an allocation can take now, what bounds it), the smallest of physical
    memory, available memory and the cgroup's room; (None, "") where the OS says none of them."""
    bounds = [(physical_memory_bytes(), "physical memory"), (available_memory_bytes(), "memory available now"),
              (cgroup_room_bytes(), "room left under this process's cgroup memory limit")]
    known = [(n, why) for n, why in bounds if n is not None]
    return min(known, key=lambda b: b[0]) if known else (None, "")


def check_fits_host(requested_bytes: int, what: str, *, advice: str = "set it below that") -> None:
    """ConfigError when ``requested_bytes`` of host memory cannot be had on this host now.

    The pool is pre-faulted (every page touched), so available memory and a cgroup limit bound it as
    much as physical RAM does. ``what`` names the setting, e.g.
    ``"max_local_cpu_size (LMCACHE_MAX_LOCAL_CPU_SIZE) = 70 GB"``; ``advice`` says what to change.
    """
    room, why = host_room()
    if room is not None and requested_bytes > room:
        raise ConfigError(f"{what} asks for {requested_bytes / GIB:.1f} GiB of host memory, but this host has "
                          f"{room / GIB:.1f} GiB ({why}); {advice} (leave room for the engine and the OS)")


def allocate(num_bytes: int, *, pin_memory: bool, what: str) -> torch.Tensor:
    """A uint8 host buffer of ``num_bytes``; ConfigError (what was asked, what the host has,
    what to set) when this host cannot give it, instead of the allocator's RuntimeError."""
    check_fits_host(num_bytes, what)
    try:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as exc:
        host = physical_memory_bytes()
        have = f"this host has {host / GIB:.1f} GiB in all" if host else "this host could not give it"
        raise ConfigError(f"{what} asks for {num_bytes / GIB:.1f} GiB of {'pinned ' if pin_memory else ''}host memory; "
                          f"{have} and the allocation failed ({str(exc).splitlines()[0][:200]}); set it lower") from exc


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def prefault_in_background(buffer: torch.Tensor) -> Optional[Prefault]:
    """Start populating ``buffer``'s pages (a contiguous CPU tensor); None where not possible."""
    if buffer.device.type != "cpu" or buffer.numel() * buffer.element_size() < PAGE_BYTES or buffer.is_pinned():
        return None
    madvise = _libc_madvise()
    if madvise is None:
        return None
    return Prefault(buffer.view(torch.uint8).reshape(-1), madvise)
