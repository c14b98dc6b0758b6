"""Plain values the scheduler side hands to the worker side each step (no vLLM types).

The connector wraps a ``StepPlan`` in vLLM's ``KVConnectorMetadata``; vLLM ships it to
every worker (in-process, or through its executor queue with TP). Block ids are vLLM's
raw per-group ids (the null block is 0): the worker translates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvconnect.chunks.extra_keys import MediaItem

BlockIds = tuple[tuple[int, ...], ...]

# A save planned in step s has landed before the forward of step s + SAVE_SLACK_STEPS (the
# workers wait for it there if need be): saves overlap that many steps, and the scheduler keeps
# a finished request's blocks only when its last save is that recent (scheduler.request_finished).
SAVE_SLACK_STEPS = 4


def freeze_block_ids(block_ids) -> BlockIds:
    """vLLM's ``tuple[list[int], ...]`` (or a single list) as an immutable tuple of tuples."""
    if block_ids and isinstance(block_ids[0], (int, np.integer)):
        block_ids = (block_ids,)
    return tuple(tuple(int(b) for b in ids) for ids in block_ids)


@dataclass(frozen=True)
class RequestView:
    """What the scheduler side needs of a vLLM request."""

    req_id: str
    prompt_tokens: np.ndarray  # int64, the prompt only (outputs come from tokens_of, save_decode_cache)
    num_tokens: int  # prompt + outputs so far
    cacheable: bool = True  # False when token ids, namespace and media do not decide the KV (request_reads)
    namespace: bytes = b""  # what besides token ids decides the KV: LoRA adapter, cache_salt
    media: tuple[MediaItem, ...] = ()  # multimodal items: the chunks covering one are keyed by it too


@dataclass(frozen=True)
class LoadJob:
    """Restore ``tokens`` (a chunk-aligned prefix) into ``block_ids``.

    present_tokens: tokens vLLM already holds (its own prefix cache); never overwritten.
    end_tokens: tokens vLLM counts as computed once the load is done (<= len(tokens)).
    generation: the key generation to load under (the scheduler's own, or a P/D producer's);
    None: the worker engine's current one.
    """

    req_id: str
    tokens: np.ndarray
    block_ids: BlockIds
    present_tokens: int
    end_tokens: int
    namespace: bytes = b""
    generation: Optional[bytes] = None
    media: tuple[MediaItem, ...] = ()  # the prompt's multimodal items (kvconnect/chunks/extra_keys.py)


@dataclass(frozen=True)
class SaveJob:
    """Store the chunks of ``tokens`` beyond ``stored_tokens`` (chunk-aligned) from ``block_ids``,
    under ``generation`` (the scheduler's when the request was admitted; None: the worker
    engine's current one)."""

    req_id: str
    tokens: np.ndarray
    block_ids: BlockIds
    stored_tokens: int
    namespace: bytes = b""
    generation: Optional[bytes] = None
    step_end: bool = False  # ``tokens`` end at a prefill step end (KVCacheEngine.store's step_end)
    continues: bool = False  # ``stored_tokens`` is this request's previous step-end save
    then: Optional[np.ndarray] = None  # at a step end: the prompt's next chunk of tokens (KVCacheEngine.store's then)
    media: tuple[MediaItem, ...] = ()  # the prompt's multimodal items (kvconnect/chunks/extra_keys.py)


@dataclass(frozen=True)
class StepPlan:
    """One step's work. ``finished``: requests whose blocks vLLM keeps until the workers
    report them saved (a save of theirs may still be running). ``step``: the plan's number
    (1, 2, ... in scheduling order; 0 for a plan built elsewhere), which dates its saves.

    ``preempted``: requests whose blocks vLLM freed when it scheduled this step; other requests
    may be given them and write them in this step's forward, so no earlier save may still read
    them (the workers land every pending save first). ``idle``: no token is scheduled in this
    step (vLLM only polls the connector), so waiting for pending saves costs the engine nothing.
    """

    loads: tuple[LoadJob, ...] = field(default_factory=tuple)
    saves: tuple[SaveJob, ...] = field(default_factory=tuple)
    finished: tuple[str, ...] = field(default_factory=tuple)
    preempted: tuple[str, ...] = field(default_factory=tuple)
    idle: bool = False
    step: int = 0
