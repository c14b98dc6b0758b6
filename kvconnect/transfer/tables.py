"""Descriptor tables shared by every kernel (see csrc/transfer_desc.h for the contract).

``plane_table(layout)`` turns a layout's planes into the [P, 6] int64 table of raw
addresses and strides. ``SegmentBuilder`` accumulates segments and slots for a batch of
chunks; the planner fills it and a kernel executes it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from ..layout.kv_layout import KVLayout

PLANE_COLS = 6
SEGMENT_COLS = 4

_plane_tables: "weakref.WeakKeyDictionary[KVLayout, np.ndarray]" = weakref.WeakKeyDictionary()


def plane_table(layout: KVLayout) -> np.ndarray:
    """[P, 6] int64: base_addr, block_stride_bytes, row_stride_bytes, row_bytes, rows_per_block, num_slots."""
    table = _plane_tables.get(layout)
    if table is None:
        table = np.array(
            [
                [t.data_ptr(), p.block_stride_bytes, p.row_stride_bytes, p.row_bytes, p.rows_per_block, p.num_slots]
                for p, t in zip(layout.planes, layout.tensors)
            ],
            dtype=np.int64,
        ).reshape(-1, PLANE_COLS)
        table.setflags(write=False)
        _plane_tables[layout] = table
    return table


@dataclass
class TransferTables:
    segments: np.ndarray  # [S, 4] int64: plane, num_rows, slot_offset, buffer_offset
    slots: np.ndarray  # [N] int64

    @property
    def num_rows(self) -> int:
        return int(self.segments[:, 1].sum()) if len(self.segments) else 0

    def payload_bytes(self, layout: KVLayout) -> int:
        if not len(self.segments):
            return 0
        row_bytes = plane_table(layout)[self.segments[:, 0], 3]
        return int((row_bytes * self.segments[:, 1]).sum())


class SegmentBuilder:
    """Collects segments and slots; ``build()`` returns contiguous int64 tables."""

    def __init__(self) -> None:
        self._segments: list[np.ndarray] = []
        self._slots: list[np.ndarray] = []
        self._num_slots = 0

    def add_slots(self, slots: np.ndarray) -> int:
        """Append a slot run; returns its offset in the slot table."""
        offset = self._num_slots
        self._slots.append(slots.astype(np.int64, copy=False))
        self._num_slots += len(slots)
        return offset

    def add_segments(self, planes: np.ndarray, num_rows: np.ndarray, slot_offsets: np.ndarray, buffer_offsets: np.ndarray) -> None:
        keep = num_rows > 0
        if keep.any():
            self._segments.append(np.stack([planes[keep], num_rows[keep], slot_offsets[keep], buffer_offsets[keep]], axis=1))

    def build(self) -> TransferTables:
        segments = np.concatenate(self._segments).astype(np.int64) if self._segments else np.zeros((0, SEGMENT_COLS), np.int64)
        slots = np.concatenate(self._slots) if self._slots else np.zeros(0, np.int64)
        return TransferTables(np.ascontiguousarray(segments), np.ascontiguousarray(slots))
