"""Slot mappings (LMCache's and vLLM's per-token addressing) as kvconnect's per-group block ids.

    block_ids = block_ids_from_slot_mapping(slot_mapping, block_size=16)
    engine.store(tokens, block_ids=[block_ids])

A slot mapping gives each token its row in the paged cache: ``slot = block * block_size +
offset``. kvconnect addresses whole blocks, one list per KV-cache group, so a slot mapping
converts when tokens fill their blocks in order from offset 0, which is how paged engines
allocate a request's blocks. Anything else (a token out of place, a block not starting at
offset 0) is refused, before anything is written, rather than guessed.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from ..errors import BlockTableError


def block_ids_from_slot_mapping(slot_mapping: Union[torch.Tensor, Sequence[int]], block_size: int) -> list[int]:
    """The block ids, in token order, of a one-group slot mapping (LMCache's ``slot_mapping=``).

    slot_mapping: int tensor or sequence [num_tokens], one slot per token; token i must sit at
        offset i % block_size of its block. Trailing -1 slots (padding) are dropped.
    block_size: tokens per block of that group.
    Raises BlockTableError when a token is not where a block table would put it.
    """
    if block_size <= 0:
        raise BlockTableError(f"block_size must be > 0, got {block_size}")
    slots = torch.as_tensor(slot_mapping, dtype=torch.int64).reshape(-1).cpu()
    valid = int((slots >= 0).cumprod(0).sum())  # the leading run of real slots
    if bool((slots[valid:] >= 0).any()):
        raise BlockTableError(f"slot_mapping has a -1 at token {valid} followed by real slots: only trailing padding is allowed")
    slots = slots[:valid]
    blocks = slots[::block_size] // block_size
    offsets = torch.arange(valid, dtype=torch.int64)
    expected = blocks.repeat_interleave(block_size)[:valid] * block_size + offsets % block_size
    bad = torch.nonzero(slots != expected)
    if bad.numel():
        i = int(bad[0])
        raise BlockTableError(
            f"slot_mapping[{i}] = {int(slots[i])} is not offset {i % block_size} of block {int(blocks[i // block_size])} "
            f"(block_size {block_size}): tokens must fill their blocks in order from offset 0")
    return blocks.tolist()
