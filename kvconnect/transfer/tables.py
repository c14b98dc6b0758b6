"""Descriptor tables shared by every kernel (see csrc/transfer_desc.h for the contract).

``plane_table(layout)`` turns a layout's planes into the [P, 6] int64 table of raw
addresses and strides. ``SegmentBuilder`` accumulates segments and slots for a batch of
chunks; the planner fills it and a kernel executes it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import TransferError
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


def validate(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, *, exact_slots: bool) -> None:
    """Raise TransferError unless every index of the transfer lies inside its plane and the buffer."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TransferError(f"buffer must be a 1-D uint8 tensor, got {getattr(buffer, 'dtype', type(buffer))}")
    if not buffer.is_contiguous():
        raise TransferError("buffer must be contiguous")
    seg, slots = tables.segments, tables.slots
    if seg.dtype != np.int64 or seg.ndim != 2 or seg.shape[1] != SEGMENT_COLS or slots.dtype != np.int64 or slots.ndim != 1:
        raise TransferError("segments must be int64 [S, 4] and slots int64 [N]")
    if not len(seg):
        return
    planes, num_rows, slot_off, buf_off = seg.T
    if planes.min() < 0 or planes.max() >= len(layout.planes):
        raise TransferError(f"segment plane index out of [0, {len(layout.planes)})")
    if num_rows.min() < 0 or slot_off.min() < 0 or (slot_off + num_rows).max() > len(slots):
        raise TransferError("segment slot range outside the slot table")
    table = plane_table(layout)
    ends = buf_off + num_rows * table[planes, 3]
    if buf_off.min() < 0 or ends.max() > buffer.numel():
        raise TransferError(f"segment bytes outside the {buffer.numel()}-byte buffer")
    if exact_slots:  # the compiled kernels re-check every slot on the host in C++
        seg_of_row = np.repeat(np.arange(len(seg)), num_rows)
        first_row = np.cumsum(num_rows) - num_rows
        idx = np.repeat(slot_off - first_row, num_rows) + np.arange(len(seg_of_row))
        row_slots = slots[idx]
        limit = table[planes[seg_of_row], 5]
        bad = (row_slots < 0) | (row_slots >= limit)
        if bad.any():
            i = int(np.argmax(bad))
            raise TransferError(f"slot {int(row_slots[i])} out of [0, {int(limit[i])}) for plane {layout.planes[planes[seg_of_row[i]]].name}")
