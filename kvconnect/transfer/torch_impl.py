"""Pure-torch implementation of the transfer contract.

Serves any torch device without a compiled kernel (Ascend ``npu`` through torch_npu where Triton
for the NPU is unavailable, ``xpu``, ``mps``) and is the oracle the compiled kernels are tested
against. Each plane is re-viewed as bytes ``[num_blocks, rows_per_block, row_bytes]`` over its
storage, so padded, strided and cross-layer packed planes need no special case.

A batch costs O(planes) device ops, whatever its number of segments (an 8K-token DeepSeek-V4
store has 168 planes and 5376 segments; benchmarks/torch_path_ops.py counts them). The host
turns the tables into index arrays first (numpy, one pass over the rows), uploads them in one
copy, then per plane used (three ops):

- store:    ``rows = plane[blocks, rows_in_block]`` and ``span.index_copy_(0, units, rows)``
- retrieve: ``rows = span.index_select(0, units)`` and ``plane.index_put_((blocks, rows_in_block), rows)``

where ``span`` is the buffer's bytes the batch touches viewed as ``[n, g]`` units of g bytes (the
greatest common divisor of the plane's row bytes and its segments' offsets: whole rows where the
offsets allow) and ``units`` the unit index of every g-byte run of every row, expanded on the
device from one number a row (one more op a plane). A buffer the planes' device cannot
address (host memory, for device planes) goes through one device copy of that span: copied in
first (so the bytes between segments are kept), and back out once after a store.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..layout.kv_layout import KVLayout
from .tables import TransferTables, plane_table

_byte_views: "weakref.WeakKeyDictionary[KVLayout, list[torch.Tensor]]" = weakref.WeakKeyDictionary()


def byte_views(layout: KVLayout) -> list[torch.Tensor]:
    views = _byte_views.get(layout)
    if views is None:
        views = []
        for p, t in zip(layout.planes, layout.tensors):
            v = torch.empty(0, dtype=torch.uint8, device=t.device)
            v.set_(
                t.untyped_storage(),
                t.storage_offset() * t.element_size(),
                (p.num_blocks, p.rows_per_block, p.row_bytes),
                (p.block_stride_bytes, p.row_stride_bytes, 1),
            )
            views.append(v)
        _byte_views[layout] = views
    return views


@dataclass(frozen=True)
class _PlaneIndex:
    plane: int
    unit: int  # g: bytes per index unit (divides the row bytes and every row's offset in the span)
    blocks: torch.Tensor  # [n] int64, on the planes' device
    rows: torch.Tensor  # [n] int64
    units: torch.Tensor  # [n * row_bytes / g] int64: unit index in the span of each g-byte run


def _index(layout: KVLayout, tables: TransferTables, lo: int, device: torch.device) -> list[_PlaneIndex]:
    """Per plane used: its rows' block and in-block indices, and their unit indices in the span at ``lo``.
    The host computes three numbers a row (one upload for the batch); the unit indices are expanded on
    the device (one op a plane), so the upload is O(rows), not O(bytes)."""
    table = plane_table(layout)
    seg = tables.segments
    planes, num_rows, slot_off, buf_off = seg.T
    total = int(num_rows.sum())
    seg_of_row = np.repeat(np.arange(len(seg)), num_rows)
    first = np.cumsum(num_rows) - num_rows
    k = np.arange(total, dtype=np.int64) - np.repeat(first, num_rows)  # row index within its segment
    slots = tables.slots[np.repeat(slot_off, num_rows) + k]
    plane_of_row = planes[seg_of_row]
    rpb = table[plane_of_row, 4]
    starts = buf_off[seg_of_row] - lo + k * table[plane_of_row, 3]  # byte offset of each row in the span
    order = np.argsort(plane_of_row, kind="stable")
    bounds = np.flatnonzero(np.diff(plane_of_row[order])) + 1
    host, parts = [], []
    for rows in np.split(order, bounds):
        p = int(plane_of_row[rows[0]])
        rb = int(table[p, 3])
        g = int(np.gcd.reduce(np.concatenate([[rb], buf_off[planes == p] - lo])))  # the widest common unit
        host.append((p, g, rb // g, len(rows)))
        parts += [slots[rows] // rpb[rows], slots[rows] % rpb[rows], starts[rows] // g]
    packed = torch.from_numpy(np.concatenate(parts)).to(device)  # one upload for the whole batch
    lanes = torch.arange(max(w for _, _, w, _ in host), dtype=torch.int64, device=device)
    out, at = [], 0
    for p, g, width, n in host:
        first_unit = packed[at + 2 * n : at + 3 * n]
        units = (first_unit[:, None] + lanes[None, :width]).reshape(-1)
        out.append(_PlaneIndex(p, g, packed[at : at + n], packed[at + n : at + 2 * n], units))
        at += 3 * n
    return out


def _span(layout: KVLayout, tables: TransferTables):
    """The buffer bytes [lo, hi) the batch touches."""
    table = plane_table(layout)
    seg = tables.segments
    lo = int(seg[:, 3].min())
    hi = int((seg[:, 3] + seg[:, 1] * table[seg[:, 0], 3]).max())
    return lo, hi


def _device_span(layout: KVLayout, buffer: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The span as the planes' device sees it: the buffer itself, or a device copy of it."""
    region = buffer[lo:hi]
    if region.device == layout.device or layout.device.type == "cpu":
        return region
    return region.to(layout.device, non_blocking=True)


def gather(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor) -> None:
    if not len(tables.segments):
        return
    views = byte_views(layout)
    lo, hi = _span(layout, tables)
    span = _device_span(layout, buffer, lo, hi)
    for ix in _index(layout, tables, lo, layout.device):
        g = ix.unit
        rows = views[ix.plane][ix.blocks, ix.rows]  # [n, row_bytes], one gather
        span[: (hi - lo) // g * g].view(-1, g).index_copy_(0, ix.units, rows.view(-1, g))
    if span.data_ptr() != buffer[lo:hi].data_ptr():
        buffer[lo:hi].copy_(span, non_blocking=True)


def scatter(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor) -> None:
    if not len(tables.segments):
        return
    views = byte_views(layout)
    lo, hi = _span(layout, tables)
    span = _device_span(layout, buffer, lo, hi)
    for ix in _index(layout, tables, lo, layout.device):
        g = ix.unit
        rb = layout.planes[ix.plane].row_bytes
        rows = span[: (hi - lo) // g * g].view(-1, g).index_select(0, ix.units).view(-1, rb)
        views[ix.plane].index_put_((ix.blocks, ix.rows), rows)
