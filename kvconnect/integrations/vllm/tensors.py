"""How one layer's registered cache becomes KVLayout planes, and the checks on it.

Reads tensors and vLLM's layer modules by attribute, never importing vLLM. ``translate``
applies this to every layer it keeps.

| registered value                                         | planes |
|----------------------------------------------------------|--------|
| tuple/list (vLLM-Ascend: MLA nope + rope, indexer K + scale) | one ``[NB, rows, ...]`` plane per distinct element |
| 4-D ``[B, H, N, C]`` view of a page-packing backend (vLLM CPU: K transposed in a page) | one opaque page per block |
| a layer whose module reports a tiled layout (``tiled_layers``: ROCm V3.2 indexer) | one opaque page per block |
| 4-D ``[B, H, N, C]`` whose ``(H, C)`` is contiguous per token (vLLM >= 0.32, MLA ``[B, 1, N, 576]``) | one plane ``[B, N, H*C]`` |
| 4-D ``[B, H, N, C]`` otherwise (HND)                     | one plane per head |
| 4-D ``[B, N, H, C]``, 3-D ``[B, N, C]``, 5-D flash / FlashInfer | ``kvconnect.layout.detect`` |

Views of one layer that only re-read bytes its other views cover (vLLM-Ascend A5's third
indexer view) are stored once; a partial overlap is refused (``_distinct_views``). Registered
tensors must hold every block vLLM may hand out, times the release's kernel split
(``check_blocks``); a packed row plane is split into the regions the release's table names
(``row_regions_of``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from kvconnect.errors import LayoutError, UnsupportedLayoutError
from kvconnect.layout.spec import GroupSpec, RowRegions
from kvconnect.layout.views import distinct_view_indices

from . import recurrent
from .engine_tables import EngineRelease
from .specs import num_heads_of

PAGE_PACKED_BACKENDS = frozenset({"CPU_ATTN"})
"""Attention backends whose per-token K/V is not a contiguous row inside a page."""


def tensor_device_type(value: Any) -> Optional[str]:
    """The device type of a registered value (a tensor or a tuple of them); None if it holds none."""
    tensor = value[0] if isinstance(value, (tuple, list)) and value else value
    return tensor.device.type if isinstance(tensor, torch.Tensor) else None


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether dims 2.. of a ``[blocks, rows, ...]`` view form one contiguous row."""
    expected = 1
    for dim in range(t.dim() - 1, 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def _distinct_views(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A layer's tensors without the views that only re-read bytes earlier tensors cover
    (``kvconnect.layout.views``: vLLM-Ascend A5 registers the C4 indexer as K, scale and a third view
    over both). A partial overlap is refused: the connector stays off for the model."""
    try:
        kept = distinct_view_indices("", tensors)
    except LayoutError as exc:
        raise UnsupportedLayoutError(str(exc).replace("layer '': ", "")) from exc
    return tuple(tensors[i] for i in kept)


def planes_of(value: Any, spec: Any, group: GroupSpec, backend: Optional[str], logical_views: bool):
    """(value for KVLayout, layout hint or None, is_page) of one layer."""
    if recurrent.is_state_spec(spec):  # one state page per block (conv state, then recurrent state)
        recurrent.check_state_tensor(spec, value)
        return value, "page", True
    if isinstance(value, (tuple, list)):
        return _distinct_views(value), None, False
    if not isinstance(value, torch.Tensor):
        raise LayoutError(f"expected a tensor or a tuple of tensors, got {type(value).__name__}")
    if value.dim() != 4:
        return value, None, False
    rows, heads = group.rows_per_block, num_heads_of(spec)
    bhnc = value.shape[1] == heads and value.shape[2] == rows
    bnhc = value.shape[1] == rows and value.shape[2] == heads
    if bhnc and (logical_views or not bnhc):
        if backend in PAGE_PACKED_BACKENDS:
            return value, "page", True
        per_token = value.permute(0, 2, 1, 3)
        if _rows_contiguous(per_token):
            return per_token, "blocks_first", False
        return value, "hnd", False
    if bnhc:
        return value, "blocks_first", False
    raise UnsupportedLayoutError(
        f"a 4-D cache of shape {tuple(value.shape)} matches neither [B, H={heads}, N={rows}, C] nor [B, N, H, C]"
    )


def tensor_signature(value: Any) -> tuple:
    """Pointer, shape, stride and dtype of each tensor in a registered value: equal means the same memory seen alike."""
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    return tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors if isinstance(t, torch.Tensor))


def row_regions_of(spec: Any, views: Sequence[torch.Tensor], release: EngineRelease) -> Optional[RowRegions]:
    """The regions of a layer whose one row plane the release writes split (None: whole rows)."""
    if len(views) != 1 or views[0].dim() < 3:
        return None
    view = views[0]
    row_bytes = int(np.prod(view.shape[2:])) * view.element_size()
    dtype = str(view.dtype).removeprefix("torch.")
    if release.unaudited(spec, dtype, row_bytes):
        raise UnsupportedLayoutError(
            f"{type(spec).__name__} ({getattr(spec, 'cache_dtype_str', None)}, {row_bytes}-byte rows): a packed DeepSeek "
            f"V4 cache whose in-block layout {release.name}'s table does not describe; kvconnect stays off rather than "
            f"guess where each row's fields are")
    return release.row_regions(spec, dtype, row_bytes)


def check_blocks(value: Any, expected: int, split: int) -> None:
    """Registered tensors must hold every block vLLM may hand out (x the kernel split)."""
    if expected <= 0:
        return
    for t in value if isinstance(value, tuple) else (value,):
        blocks = t.shape[1] if t.dim() == 5 and t.shape[0] == 2 else t.shape[0]
        if t.dim() == 5 and t.shape[0] != 2:
            continue  # FlashInfer [NB, 2, ...]: dim 0 is the block
        if blocks < expected:
            hint = f" ({split} kernel blocks per vLLM block)" if split > 1 else ""
            raise UnsupportedLayoutError(
                f"a {tuple(t.shape)} cache holds {blocks} blocks, fewer than the {expected} vLLM may use{hint}")


def attention_backend_names(vllm_config: Any, layer_names: Sequence[str]) -> dict[str, str]:
    """Attention backend name of each layer, where vLLM exposes it (else absent)."""
    names: dict[str, str] = {}
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    for layer in layer_names:
        module = context.get(layer)
        try:  # a hint only: a layer that cannot name its backend is treated as row-addressable
            backend = getattr(module, "attn_backend", None)
            if backend is None and hasattr(module, "get_attn_backend"):
                backend = module.get_attn_backend()
            if backend is not None and hasattr(backend, "get_name"):
                names[layer] = str(backend.get_name())
        except Exception:
            continue
    return names


def tiled_layers(vllm_config: Any, layer_names: Sequence[str]) -> list[str]:
    """Layers whose cache module says its rows are tiled across the block (vLLM's ROCm DeepSeek
    V3.2 indexer: ``uses_shuffled_layout``, values in [blk/16, head/16, 16, 16] tiles)."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    out = []
    for layer in layer_names:
        try:  # a property of the layer module; any failure to read it means "not tiled"
            if getattr(context.get(layer), "uses_shuffled_layout", False) is True:
                out.append(layer)
        except Exception:
            continue
    return out
