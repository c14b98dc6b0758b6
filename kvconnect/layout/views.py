"""Aliased views: several tensors of one layer that read the same bytes are stored once.

Engines sometimes register one allocation under several dtype views (vLLM-Ascend A5's C4
indexer: K fp8 ``[NB, 128, 1, 128]``, its scale fp32 ``[NB, 128, 1, 1]`` and a third fp8
``[NB, 128, 1, 132]`` view over both; LMCache-Ascend's DeepSeek V4 fixtures: a shared int8
blob under two dtype views). Storing every view would store those bytes twice and restore
them twice. ``drop_aliased_views`` keeps, per layer and in order, each view that reads bytes
no earlier view of the layer covers, and drops a view whose every block's bytes are covered
by earlier views of the same storage with the same block stride. A view that overlaps others
without being covered is refused (``LayoutError``): its rows cannot be moved independently.

    kv_caches, layer_groups, extras = drop_aliased_views(kv_caches, layer_groups, per_tensor)

``per_tensor`` maps a layer to a list with one entry per tensor of its value (e.g. its row
regions); the entries of dropped views are dropped with them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from ..errors import LayoutError


def _extent(t: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(storage, first byte, end byte of block 0, block stride bytes, end byte of the last block)."""
    size = t.element_size()
    start = t.storage_offset() * size
    span = (sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:]) if n > 0) + 1) * size
    stride = t.stride(0) * size if t.dim() else 0
    blocks = t.shape[0] if t.dim() else 1
    return t.untyped_storage().data_ptr(), start, start + span, stride, start + (blocks - 1) * stride + span


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two ``[blocks, ...]`` views of one storage share a byte (per block when strided alike)."""
    if a[0] != b[0] or not (a[1] < b[4] and b[1] < a[4]):
        return False
    if a[3] != b[3] or a[3] <= 0:
        return True
    stride, shift = a[3], (b[1] - a[1]) % a[3]
    return shift < a[2] - a[1] or shift + (b[2] - b[1]) > stride


def _covers(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    position = start
    for a, b in sorted(spans):
        if a > position:
            break
        position = max(position, b)
    return position >= end


def distinct_view_indices(layer_name: str, tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the tensors of one layer to store: those not covered by earlier ones."""
    kept: list[int] = []
    extents: list[tuple] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            kept.append(i)  # from_tensors names the bad value
            continue
        e = _extent(t)
        overlapping = [x for x in extents if _overlap(x, e)]
        if not overlapping:
            kept.append(i)
            extents.append(e)
            continue
        same_stride = all(x[3] == e[3] for x in overlapping)
        if not (same_stride and _covers([(x[1], x[2]) for x in overlapping], e[1], e[2])):
            raise LayoutError(f"layer {layer_name!r}: tensor {i} ({tuple(t.shape)} {t.dtype}) overlaps another tensor of "
                              "the layer without being covered by it; its rows cannot be stored independently")
    return kept


def drop_aliased_views(kv_caches: Mapping[str, Any], layer_groups: Mapping[str, Any],
                       per_tensor: Optional[Mapping[str, Sequence[Any]]] = None) -> tuple[dict, dict, dict]:
    """``kv_caches``, ``layer_groups`` and ``per_tensor`` without the views of tuple values that
    only re-read bytes earlier views of the layer cover (a per-plane group assignment and each
    layer's per-tensor entries lose the same entries). A dropped view must be in the same group
    as a view that covers it."""
    values_out: dict = {}
    groups_out: dict = dict(layer_groups)
    extras_out: dict = {name: list(entries) for name, entries in (per_tensor or {}).items()}
    for name, value in kv_caches.items():
        if not isinstance(value, (tuple, list)) or len(value) < 2:
            values_out[name] = value
            continue
        kept = distinct_view_indices(name, value)
        if len(kept) == len(value):
            values_out[name] = value
            continue
        assignment: Optional[Any] = layer_groups.get(name)
        if isinstance(assignment, (tuple, list)) and len(assignment) == len(value):
            dropped_groups = {assignment[i] for i in range(len(value)) if i not in kept}
            if not dropped_groups <= {assignment[i] for i in kept}:
                raise LayoutError(f"layer {name!r}: a view assigned to group(s) {sorted(dropped_groups)} only re-reads bytes "
                                  "of views in other groups; give aliased views of one allocation the same group")
            groups_out[name] = type(assignment)(assignment[i] for i in kept)
        if name in extras_out and len(extras_out[name]) == len(value):
            extras_out[name] = [extras_out[name][i] for i in kept]
        values_out[name] = type(value)(value[i] for i in kept)
    return values_out, groups_out, extras_out
