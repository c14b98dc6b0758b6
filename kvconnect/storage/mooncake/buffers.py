"""Registered buffers of the Mooncake tier: the header scratch slots and buffer addresses.

Mooncake reads into and writes from registered memory only. The tier registers the pool's
buffer once (``MooncakeTier.attach_pool``) and a few small scratch buffers of its own, each
cut into BATCH_KEYS header slots of HEADER_SLOT_BYTES (``RegisteredSlots``): one per lookup
thread, one for reads, one for writes. ``view_address`` is the address Mooncake is given
for a slot or any other contiguous buffer.
"""

from __future__ import annotations

import numpy as np

HEADER_SLOT_BYTES = 16 << 10  # room for one header: 88 + 8 x planes (up to ~2000 planes)
BATCH_KEYS = 64  # keys per Mooncake call (bounds the header scratch)


def view_address(view) -> int:
    """Address of a contiguous byte buffer (memoryview, numpy array, bytearray)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class RegisteredSlots:
    """A registered numpy buffer cut into header slots."""

    def __init__(self, num_slots: int) -> None:
        self.array = np.zeros(num_slots * HEADER_SLOT_BYTES, dtype=np.uint8)
        self.base = self.array.ctypes.data

    def ptr(self, i: int) -> int:
        return self.base + i * HEADER_SLOT_BYTES

    def view(self, i: int, nbytes: int) -> memoryview:
        start = i * HEADER_SLOT_BYTES
        return memoryview(self.array[start : start + nbytes])
