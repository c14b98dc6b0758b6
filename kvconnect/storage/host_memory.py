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
already) nothing happens and stores fault pages in as before.

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

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, kernel 5.14+
PAGE_BYTES = 4096
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
