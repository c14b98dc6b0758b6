"""Split an engine's KV tensors into planes that follow kvconnect's convention.

Convention: a plane is ``[num_blocks, rows_per_block, *row]`` with the row contiguous.
Engine layouts whose first dim is not blocks are split into views that follow it:

| hint            | engine tensor                 | planes                        |
|-----------------|-------------------------------|-------------------------------|
| ``blocks_first``| ``[NB, BS, ...]``             | itself                        |
| ``kv_first``    | ``[2, NB, BS, H, D]`` (flash) | K, V                          |
| ``kv_second``   | ``[NB, 2, BS, H, D]`` (FI)    | K, V                          |
| ``hnd_kv_first``| ``[2, NB, H, BS, D]``         | K per head, then V per head   |
| ``hnd_kv_second``| ``[NB, 2, H, BS, D]``        | K per head, then V per head   |
| ``hnd``         | ``[NB, H, BS, D]``            | one plane per head            |
| ``page``        | ``[NB, ...]`` opaque          | one row per block (the page)  |

Without a hint the common shapes are detected from ``rows_per_block``; an ambiguous
shape raises ``LayoutError`` asking for a hint.

``split_regions`` then splits a plane whose block keeps its rows' fields in separate regions
(``spec.RowRegions``) into one byte sub-plane per region.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import LayoutError
from .spec import RowRegions

HINTS = ("blocks_first", "kv_first", "kv_second", "hnd_kv_first", "hnd_kv_second", "hnd", "page")


def detect_hint(t: torch.Tensor, rows_per_block: int) -> str:
    shape = tuple(t.shape)
    if t.dim() == 5:
        if shape[0] == 2 and shape[2] == rows_per_block:
            return "kv_first"
        if shape[1] == 2 and shape[2] == rows_per_block:
            return "kv_second"
        if shape[0] == 2 and shape[3] == rows_per_block:
            return "hnd_kv_first"
        if shape[1] == 2 and shape[3] == rows_per_block:
            return "hnd_kv_second"
    if t.dim() >= 2 and shape[1] == rows_per_block:
        return "blocks_first"
    if t.dim() == 4 and shape[2] == rows_per_block:
        return "hnd"
    raise LayoutError(
        f"cannot tell the layout of a tensor of shape {shape} with {rows_per_block} rows per block; "
        f"pass a layout hint, one of {HINTS}"
    )


def split_planes(t: torch.Tensor, rows_per_block: int, hint: Optional[str]) -> tuple[list[torch.Tensor], bool]:
    """Views of ``t`` following the plane convention, and whether they are page planes."""
    hint = hint or detect_hint(t, rows_per_block)
    if hint not in HINTS:
        raise LayoutError(f"unknown layout hint {hint!r}; expected one of {HINTS}")
    if hint == "page":
        return [t], True
    if hint == "blocks_first":
        return [t], False
    if hint == "kv_first":
        return [t[0], t[1]], False
    if hint == "kv_second":
        return [t[:, 0], t[:, 1]], False
    if hint == "hnd":
        return [t[:, h] for h in range(t.shape[1])], False
    if hint == "hnd_kv_first":
        return [t[k][:, h] for k in range(2) for h in range(t.shape[2])], False
    return [t[:, k, h] for k in range(2) for h in range(t.shape[2])], False  # hnd_kv_second


def split_regions(t: torch.Tensor, regions: RowRegions, where: str) -> list[torch.Tensor]:
    """One uint8 view ``[num_blocks, rows, region_bytes]`` per region of a ``[NB, rows, *row]`` plane.

    The plane's rows must be tight inside a block (row stride = row bytes = the regions'
    total): the engine then addresses region k of row r at ``k_offset + r * region_bytes``
    from the block's start, which is what each view does. The views share ``t``'s storage
    (torch bounds-checks them against it).
    """
    if t.dim() < 2:
        raise LayoutError(f"{where}: a split plane needs [num_blocks, rows, ...] dims, got shape {tuple(t.shape)}")
    elem = t.element_size()
    num_blocks, rows = t.shape[0], t.shape[1]
    row_bytes = math.prod(t.shape[2:]) * elem
    if not _contiguous_tail(t, 2):
        raise LayoutError(f"{where}: the row dims {tuple(t.shape[2:])} are not contiguous (strides {t.stride()})")
    if row_bytes != regions.row_bytes:
        raise LayoutError(
            f"{where}: rows of {row_bytes} bytes cannot hold the regions {regions.region_bytes} "
            f"({regions.what or 'split rows'}: {regions.row_bytes} bytes a row)")
    if rows > 1 and t.stride(1) * elem != row_bytes:
        raise LayoutError(
            f"{where}: rows are {t.stride(1) * elem} bytes apart, not {row_bytes}: a block split into regions "
            f"({regions.what or 'split rows'}) must be one tight run of rows x {row_bytes} bytes")
    block_stride = t.stride(0) * elem
    if num_blocks > 1 and block_stride < rows * row_bytes:
        raise LayoutError(f"{where}: blocks overlap (stride {block_stride} < {rows} rows x {row_bytes} bytes)")
    base = t.storage_offset() * elem
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return [
        torch.as_strided(flat, (num_blocks, rows, size), (block_stride, size, 1), base + offset)
        for size, offset in zip(regions.region_bytes, regions.region_offsets_bytes(rows))
    ]


def _contiguous_tail(t: torch.Tensor, first_dim: int) -> bool:
    expected = 1
    for dim in range(t.dim() - 1, first_dim - 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def plane_geometry(t: torch.Tensor, *, is_page: bool, where: str) -> dict:
    """Byte geometry of one plane view (PlaneSpec fields other than names and groups)."""
    elem = t.element_size()
    if t.dim() < 2 and not is_page:
        raise LayoutError(f"{where}: a plane needs at least [num_blocks, rows] dims, got shape {tuple(t.shape)}")
    if t.dim() < 1:
        raise LayoutError(f"{where}: a scalar is not a paged plane")
    if is_page:
        if not _contiguous_tail(t, 1):
            raise LayoutError(f"{where}: a page plane must be contiguous within a block, strides {t.stride()}")
        row_bytes = math.prod(t.shape[1:]) * elem
        rows_per_block, row_stride = 1, row_bytes
    else:
        if not _contiguous_tail(t, 2):
            raise LayoutError(
                f"{where}: the row dims {tuple(t.shape[2:])} are not contiguous (strides {t.stride()}); "
                f"use the 'page' hint for layouts whose per-token data is not contiguous"
            )
        row_bytes = math.prod(t.shape[2:]) * elem
        rows_per_block, row_stride = t.shape[1], t.stride(1) * elem
    return dict(
        num_blocks=t.shape[0],
        rows_per_block=rows_per_block,
        row_bytes=row_bytes,
        block_stride_bytes=t.stride(0) * elem,
        row_stride_bytes=row_stride,
        dtype=str(t.dtype).removeprefix("torch."),
        row_shape=tuple(int(d) for d in t.shape[1 if is_page else 2 :]),
    )
