"""vLLM-Ascend's own addressing of a request's rows, and a block pool that allocates like it.

Written from vLLM-Ascend 0.23's semantics, sharing no code with kvconnect's row math:
- a spec's ``block_size`` counts stored rows; a row holds ``compress_ratio`` tokens
  (``CompressAttentionManager`` divides token counts by the ratio; rows for T tokens = T // r);
- sliding-window groups (``SlidingWindowSpec``, ``SlidingWindowMLASpec``) need tokens
  [P - W + 1, P) to resume at P; blocks entirely before that are the null block 0;
- on a hybrid cache the attention tensors hold each vLLM block as ``block_size / kernel``
  kernel blocks: vLLM block b, row i lives in kernel block b*k + i // kernel, row i % kernel;
- every group draws block ids from one pool (id 0 is the null block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass(frozen=True)
class GroupRule:
    rows_per_block: int
    ratio: int
    window: Optional[int]

    def rows_for(self, num_tokens: int) -> int:
        return num_tokens // self.ratio

    def blocks_for(self, num_tokens: int) -> int:
        return -(-self.rows_for(num_tokens) // self.rows_per_block)

    def needed_rows(self, boundary: int) -> range:
        """Rows the engine reads to resume computing at token ``boundary``."""
        if self.window is None:
            return range(self.rows_for(boundary))
        first_token = max(0, boundary - self.window + 1)
        return range(first_token // self.ratio, self.rows_for(boundary))

    def first_live_block(self, computed_tokens: int) -> int:
        """Blocks before this are freed (null) once ``computed_tokens`` are computed."""
        if self.window is None:
            return 0
        first_token = max(0, computed_tokens - self.window + 1)
        return first_token // self.ratio // self.rows_per_block


def group_rules(case) -> list[GroupRule]:
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec, SlidingWindowSpec

    rules = []
    for group in case.groups:
        spec = group.kv_cache_spec
        layer_spec = spec.kv_cache_specs[group.layer_names[0]] if hasattr(spec, "kv_cache_specs") else spec
        window = layer_spec.sliding_window if isinstance(layer_spec, (SlidingWindowSpec, SlidingWindowMLASpec)) else None
        rules.append(GroupRule(int(layer_spec.block_size), int(getattr(layer_spec, "compress_ratio", 1) or 1), window))
    return rules


def layer_group(case) -> dict[str, int]:
    return {layer: g for g, group in enumerate(case.groups) for layer in group.layer_names}


def is_byte_handle(case, layer: str, index: int) -> bool:
    """A5's third indexer view: the byte handle vLLM-Ascend's fused ``indexer_compress_epilog_v2``
    scatters K and scale through (``layout=2``: the K rows, then the scales, of a page); the
    indexer reads views 0 (K) and 1 (scale). Its 132-byte "rows" are not token rows."""
    return case.device == "A5" and layer.endswith("indexer.k_cache") and index == 2


def tensors_of(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def split_of(case, rule: GroupRule) -> int:
    """Kernel blocks per vLLM block (the runner's kernel block size, from the attention backend)."""
    return rule.rows_per_block // case.kernel_block_size if rule.rows_per_block > case.kernel_block_size else 1


def row_address(rule: GroupRule, table: list[int], row: int, split: int) -> tuple[int, int]:
    block, within = divmod(row, rule.rows_per_block)
    if split == 1:
        return table[block], within
    per_kernel = rule.rows_per_block // split
    return table[block] * split + within // per_kernel, within % per_kernel


class BlockPool:
    """One pool of block ids for every group (HMA), freed blocks reused, id 0 never handed out."""

    def __init__(self, num_blocks: int, rng: np.random.Generator) -> None:
        self.free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
        self.rng = rng

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("test block pool exhausted: raise num_blocks")
        return self.free.pop(int(self.rng.integers(len(self.free))))

    def give(self, block: int) -> None:
        self.free.append(block)


class RequestBlocks:
    """A request's per-group block ids as the scheduler holds them while it computes."""

    def __init__(self, rules: list[GroupRule], pool: BlockPool, on_new=None) -> None:
        self.rules, self.pool, self.on_new = rules, pool, on_new
        self.ids: list[list[int]] = [[] for _ in rules]

    def advance(self, computed_before: int, computed_after: int) -> None:
        """Free blocks that left the window (at computed_before), allocate up to computed_after."""
        for g, rule in enumerate(self.rules):
            ids = self.ids[g]
            for b in range(min(rule.first_live_block(computed_before), len(ids))):
                if ids[b] != 0:
                    self.pool.give(ids[b])
                    ids[b] = 0
            need = rule.blocks_for(computed_after)
            # a window group allocates null blocks for what is already outside its window
            first_live = rule.first_live_block(computed_before)
            while len(ids) < need:
                if len(ids) < first_live:
                    ids.append(0)
                else:
                    block = self.pool.take()
                    ids.append(block)
                    if self.on_new is not None:
                        self.on_new(block)

    def table(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(ids) for ids in self.ids)


# -- reading a request's rows by that addressing (shared by test_real_layouts and test_scheduler_side)

CHUNK = 256  # the connector's chunk in these suites


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() > 1 or t.dtype != torch.uint8 else t


def storages(case) -> list[torch.Tensor]:
    """Every distinct backing allocation of the registered caches, as flat bytes."""
    seen, out = set(), []
    for value in case.kv_caches.values():
        for t in tensors_of(value):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out.append(torch.empty(0, dtype=torch.uint8).set_(storage))
    return out


def randomize(case, gen: torch.Generator) -> None:
    for flat in storages(case):
        flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))


def needed_rows(case, rules, tables, boundary):
    """{(layer, tensor index): [(block, row), ...]} the engine reads to resume at ``boundary``."""
    groups = layer_group(case)
    out = {}
    for layer, value in case.kv_caches.items():
        g = groups[layer]
        rule = rules[g]
        split = split_of(case, rule)
        addresses = [row_address(rule, list(tables[g]), r, split) for r in rule.needed_rows(boundary)]
        for i, _ in enumerate(tensors_of(value)):
            if is_byte_handle(case, layer, i):
                continue
            out[(layer, i)] = addresses
    return out


def gather(case, rows) -> dict:
    out = {}
    for (layer, i), addresses in rows.items():
        t = tensors_of(case.kv_caches[layer])[i]
        out[(layer, i)] = [(as_bytes(t[b, r]).clone()) for b, r in addresses]
    return out
