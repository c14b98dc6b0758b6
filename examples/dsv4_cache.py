"""A DeepSeek-V4-Flash-shaped paged KV cache on CPU (real row sizes, padded pages).

Seven caches as vLLM allocates them (see shared reference layouts.md), for a chosen number
of layers: every layer has a sliding-window cache; compress-4 layers add the C4 MLA cache,
the C4 indexer K cache and two fp32 compressor-state windows; compress-128 layers add the
C128 MLA cache and its compressor-state window.
"""

from __future__ import annotations

import torch

from kvconnect import GroupSpec

ROW_BYTES = 584  # fp8_ds_mla: 448 fp8 NoPE + 16 B scales + 120 B bf16 RoPE, as vLLM packs it


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


# group index -> (spec, row bytes, dtype, page alignment)
GROUPS = {
    "swa": (GroupSpec(block_size=64, sliding_window=128), ROW_BYTES, torch.uint8, 576),
    "c4": (GroupSpec(block_size=256, compress_ratio=4), ROW_BYTES, torch.uint8, 576),
    "c128": (GroupSpec(block_size=256, compress_ratio=128), ROW_BYTES, torch.uint8, 576),
    "c4_indexer": (GroupSpec(block_size=256, compress_ratio=4), 132, torch.uint8, 576),
    "c4_state": (GroupSpec(block_size=4, sliding_window=8), 8192, torch.float32, 512),
    "c4_indexer_state": (GroupSpec(block_size=4, sliding_window=8), 2048, torch.float32, 512),
    "c128_state": (GroupSpec(block_size=8, sliding_window=128), 4096, torch.float32, 512),
}
GROUP_NAMES = list(GROUPS)


def layer_caches(layer: int) -> list[str]:
    """Caches of one layer: layers 0-1 and the MTP layer (43) pure SWA, C4 on even, C128 on odd layers."""
    if layer < 2 or layer >= 43:
        return ["swa"]
    if layer % 2 == 0:
        return ["swa", "c4", "c4_indexer", "c4_state", "c4_indexer_state"]
    return ["swa", "c128", "c128_state"]


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


def group_names(num_layers: int) -> list[str]:
    """Names of the groups ``build`` creates for ``num_layers`` layers, in group order."""
    return [n for n in GROUP_NAMES if any(n in layer_caches(layer) for layer in range(num_layers))]
