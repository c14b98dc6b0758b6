"""Pure-torch implementation of the transfer contract.

Serves any torch device without a compiled kernel (Ascend ``npu`` through torch_npu,
``xpu``, ``mps``) and is the oracle the compiled kernels are tested against. Each plane is
re-viewed as bytes ``[num_blocks, rows_per_block, row_bytes]`` over its storage, so padded,
strided and cross-layer packed planes need no special case.
"""

from __future__ import annotations

import weakref

import torch

from ..layout import KVLayout
from .tables import TransferTables

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


def _segment_index(layout: KVLayout, tables: TransferTables, device: torch.device):
    slots = torch.from_numpy(tables.slots)
    for plane, num_rows, slot_offset, buffer_offset in tables.segments.tolist():
        rpb = layout.planes[plane].rows_per_block
        seg = slots[slot_offset : slot_offset + num_rows].to(device)
        yield plane, num_rows, buffer_offset, seg // rpb, seg % rpb


def gather(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor) -> None:
    views = byte_views(layout)
    for plane, n, off, blocks, rows in _segment_index(layout, tables, layout.device):
        rb = layout.planes[plane].row_bytes
        buffer[off : off + n * rb].view(n, rb).copy_(views[plane][blocks, rows], non_blocking=True)


def scatter(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor) -> None:
    views = byte_views(layout)
    for plane, n, off, blocks, rows in _segment_index(layout, tables, layout.device):
        rb = layout.planes[plane].row_bytes
        src = buffer[off : off + n * rb].view(n, rb).to(layout.device, non_blocking=True)
        views[plane].index_put_((blocks, rows), src)
