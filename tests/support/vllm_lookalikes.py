"""vLLM's and vLLM-Ascend's KV spec and config classes as look-alikes: same names, the fields translate reads.

Shared by test_vllm_translate, test_vllm_recurrent and test_replicated_kv (core stage: no vLLM
installed). The real classes are checked against these names in the engine stages
(test_vllm_spec_classes, ascend/test_spec_classes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# --- vLLM look-alikes (names matter; fields as in vllm/v1/kv_cache_interface.py) ----------
@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: Optional[int] = None
    tokens_per_state: object = 1
    num_head_slots: Optional[int] = None


class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int = 64
    tokens_per_state: object = 1


@dataclass(frozen=True)
class MambaSpec:  # vLLM 0.32's fields that translate reads (tests/test_vllm_recurrent.py covers the STATE groups)
    block_size: int
    shapes: tuple = ((3, 512), (4, 64, 64))
    dtypes: tuple = (torch.bfloat16, torch.float32)
    mamba_cache_mode: str = "none"


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class RSWASpec(FullAttentionSpec):
    rswa_window: int = 128


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs:
    block_size: int
    kv_cache_specs: dict = field(default_factory=dict, hash=False)


# vLLM-Ascend (vllm_ascend/core/kv_cache_interface.py)
@dataclass(frozen=True)
class AscendMLAAttentionSpec(FullAttentionSpec):
    compress_ratio: int = 1
    storage_block_size: Optional[int] = None  # main after PR 13242 (rows); absent on 0.23 (None here)


@dataclass(frozen=True)
class AscendSFAIndexerCacheSpec(FullAttentionSpec):
    pass


@dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: object


@dataclass
class KVCacheConfig:  # vLLM >= 0.32: registered caches are logical [B, H, N, C] views
    num_blocks: int
    kv_cache_groups: list
    kv_cache_layout: Optional[str] = "LBNHC"


@dataclass
class LegacyKVCacheConfig:  # older vLLM and vLLM-Ascend: engine-native shapes
    num_blocks: int
    kv_cache_groups: list


NB = 8


def filled(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=torch.int64).to(dtype)
