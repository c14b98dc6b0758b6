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
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .errors import LayoutError

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
    )
