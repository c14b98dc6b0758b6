"""A DeepSeek-V4-Flash-shaped paged KV cache on CPU (real row sizes, padded pages).

Seven caches as vLLM allocates them (see shared reference layouts.md), for a chosen number
of layers: every layer has a sliding-window cache; compress-4 layers add the C4 MLA cache,
the C4 indexer K cache and two fp32 compressor-state windows; compress-128 layers add the
C128 MLA cache and its compressor-state window.
"""

from __future__ import annotations

import torch

from kvconnect import GroupSpec

from kvconnect.integrations.presets import DSV4_GROUPS as GROUPS  # group name -> (spec, row bytes, dtype, page alignment)
from kvconnect.integrations.presets import DSV4_ROW_BYTES as ROW_BYTES  # fp8_ds_mla: 576 B data + 8 B scales a row
from kvconnect.integrations.presets import DSV4_ROW_REGIONS as ROW_REGIONS  # vLLM writes those blocks [rows x data][rows x scales]
from kvconnect.integrations.presets import dsv4_layer_caches as layer_caches  # layers 0-1 and MTP (43) SWA, C4 even, C128 odd

GROUP_NAMES = list(GROUPS)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _padded_plane(num_blocks: int, spec: GroupSpec, row_bytes: int, dtype: torch.dtype, align: int) -> torch.Tensor:
    """[num_blocks, rows_per_block, row] view into pages padded to ``align`` bytes."""
    rows = spec.rows_per_block
    page_bytes = _align(rows * row_bytes, align)
    elem = torch.empty(0, dtype=dtype).element_size()
    backing = torch.zeros(num_blocks * page_bytes // elem, dtype=dtype)
    return torch.as_strided(backing, (num_blocks, rows, row_bytes // elem), (page_bytes // elem, row_bytes // elem, 1))


def build(num_layers: int, max_tokens: int) -> tuple[dict, list[GroupSpec], dict]:
    """kv_caches, groups and layer_groups for ``num_layers`` layers holding ``max_tokens`` tokens."""
    used = [n for n in GROUP_NAMES if any(n in layer_caches(layer) for layer in range(num_layers))]
    kv_caches, layer_groups = {}, {}
    for layer in range(num_layers):
        for name in layer_caches(layer):
            spec, row_bytes, dtype, align = GROUPS[name]
            num_blocks = -(-max_tokens // spec.block_size) + 1
            key = f"layers.{layer}.{name}"
            kv_caches[key] = _padded_plane(num_blocks, spec, row_bytes, dtype, align)
            layer_groups[key] = used.index(name)
    return kv_caches, [GROUPS[n][0] for n in used], layer_groups


def row_regions(num_layers: int) -> dict:
    """``row_regions`` for KVLayout.from_tensors: the caches vLLM writes split into regions."""
    return {f"layers.{layer}.{name}": ROW_REGIONS[name]
            for layer in range(num_layers) for name in layer_caches(layer) if name in ROW_REGIONS}


def group_names(num_layers: int) -> list[str]:
    """Names of the groups ``build`` creates for ``num_layers`` layers, in group order."""
    return [n for n in GROUP_NAMES if any(n in layer_caches(layer) for layer in range(num_layers))]
