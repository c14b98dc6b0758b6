"""SGLang HiCache host pools as kvconnect planes (one group per pool, one block per page).

SGLang describes where a host page lives with ``host_pool.get_page_buffer_meta(indices)``:
per page, a list of (pointer, bytes) pieces, each contiguous (``layer_first`` MHA: a K and a
V piece per layer; ``page_first`` / ``page_first_direct`` / ``page_head``: one K and one V
piece covering every layer; MLA: one latent piece per layer or per page; Mamba, DSA indexer
and DeepSeek V4 pools: their own pieces). This module asks for the pieces of pages 0, 1 and
the last page, checks that piece j of page p lies at ``base_j + p * stride_j`` inside one of
the pool's own tensors, and turns each piece into a kvconnect *page plane*
``[num_pages, piece_bytes]`` (a ``torch.as_strided`` view of that tensor's storage, so
bounds are checked by torch). Every layout SGLang offers is handled by the same code,
without a table of layouts, and a pool whose pieces are not a regular page grid is refused
with a LayoutError at registration.

A pool whose KV is logical (DeepSeek V4's anchor: ``kv_buffer`` is None, no pieces) has no
planes: it is a pool with nothing to store, and its pages are present by definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvconnect.errors import LayoutError


@dataclass(frozen=True)
class PoolPlanes:
    """One host pool: its page size in tokens, page count and page planes (empty: logical)."""

    name: str
    page_tokens: int
    num_pages: int
    planes: tuple[torch.Tensor, ...]
    layout_name: str
    dtype: str

    @property
    def page_bytes(self) -> int:
        return sum(p.shape[1] for p in self.planes)


def _pool_tensors(pool) -> list[torch.Tensor]:
    out = []
    for value in vars(pool).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, torch.Tensor) and item.device.type == "cpu" and item.numel():
                out.append(item)
    return out


def _owner(tensors: list[torch.Tensor], lo: int, hi: int) -> Optional[torch.Tensor]:
    for t in tensors:
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start <= lo and hi <= start + storage.nbytes():
            return t
    return None


def _meta(pool, page: int, page_tokens: int) -> tuple[list[int], list[int]]:
    idx = torch.arange(page * page_tokens, (page + 1) * page_tokens, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def pool_planes(pool, name: str) -> PoolPlanes:
    """The page planes of one SGLang host pool; LayoutError when its pages are not a grid."""
    page_tokens = int(getattr(pool, "page_size", 0) or 0)
    size = int(getattr(pool, "size", 0) or 0)
    layout_name = str(getattr(pool, "layout", ""))
    dtype = str(getattr(pool, "dtype", "")).removeprefix("torch.")
    if page_tokens <= 0 or size < page_tokens:
        raise LayoutError(f"SGLang host pool {name!r}: page_size {page_tokens} / size {size} are not usable")
    num_pages = int(getattr(pool, "page_num", 0) or size // page_tokens)
    logical = getattr(pool, "kv_buffer", 0) is None
    meta = getattr(pool, "get_page_buffer_meta", None)
    first = None
    if meta is not None:
        try:
            idx = torch.arange(0, page_tokens, dtype=torch.int64)
            got = meta(idx)
            first = ([int(p) for p in got[0]], [int(s) for s in got[1]]) if got is not None else None
        except Exception as exc:  # noqa: BLE001 - SGLang raises various errors for pools it cannot describe
            if not logical:
                raise LayoutError(f"SGLang host pool {name!r}: get_page_buffer_meta failed: {exc}") from exc
    if first is None or not first[0]:
        if not logical:  # data but no page description: refuse rather than guess
            raise LayoutError(f"SGLang host pool {name!r} ({type(pool).__name__}) describes no pages")
        return PoolPlanes(name, page_tokens, num_pages, (), layout_name, dtype)  # logical: nothing to store
    probes = {0: first}
    for page in {1, num_pages - 1} - {0}:
        if 0 < page < num_pages:
            probes[page] = _meta(pool, page, page_tokens)
    tensors = _pool_tensors(pool)
    ptrs0, sizes0 = first
    planes = []
    for j, (base, piece) in enumerate(zip(ptrs0, sizes0)):
        stride = probes[1][0][j] - base if 1 in probes else piece
        for page, (ptrs, sizes) in probes.items():
            if len(ptrs) != len(ptrs0) or sizes[j] != piece or ptrs[j] != base + page * stride:
                raise LayoutError(f"SGLang host pool {name!r}: piece {j} of page {page} is not on a regular page grid")
        if piece <= 0 or stride < piece:
            raise LayoutError(f"SGLang host pool {name!r}: piece {j} overlaps the next page (stride {stride} < {piece} bytes)")
        end = base + (num_pages - 1) * stride + piece
        owner = _owner(tensors, base, end)
        if owner is None:
            raise LayoutError(f"SGLang host pool {name!r}: piece {j} does not lie inside one of the pool's tensors")
        storage = owner.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        planes.append(torch.as_strided(flat, (num_pages, piece), (stride, 1), base - storage.data_ptr()))
    return PoolPlanes(name, page_tokens, num_pages, tuple(planes), layout_name, dtype)
