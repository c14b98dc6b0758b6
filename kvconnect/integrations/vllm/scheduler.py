"""Scheduler side of the vLLM connector: what to load and what to save, never bytes.

Runs in vLLM's scheduler process; holds no worker state and no vLLM types (the connector
passes ``RequestView`` values and block ids). Called, per request, in vLLM's order:

    num_new_matched_tokens(req, num_computed)   -> (tokens to load beyond num_computed, async)
    after_alloc(req, block_ids, num_computed, num_external)   a load is planned if num_external > 0
    build_plan(scheduled, num_computed_of, block_ids_of, tokens_of, preempted) -> StepPlan
    request_finished(req_id)                    -> True when the workers may still save it

Hits come from the workers through the lookup channel (restore-gated, minimum over ranks).
A hit never covers the whole prompt (vLLM must compute one token to sample) and counts only
tokens beyond vLLM's own prefix cache; a hit of fewer than ``min_load_tokens`` such tokens is
not reported (the load would cost the request a whole engine step to save less prefill
than that step: docs/vllm.md, "Small loads"). With ``skip_last_n_tokens`` (LMCache's vLLM key)
the lookup leaves the last N tokens of the prompt out, so a hit never covers them. Loads are asynchronous in vLLM's sense: the request
waits one step while the workers scatter the chunks and report it through get_finished.

Saves: each step, the chunks a request completes in that step (chunk ends in
(stored, computed]) are saved from its current block ids; sliding-window blocks are freed
between steps, so a chunk is never saved later than the step that computes it. With
``save_decode_cache`` (LMCache's ``LMCACHE_SAVE_DECODE_CACHE``) the same holds past the
prompt: a chunk that generated tokens complete is saved in the decode step that computes
its last token, under the key chain of prompt + outputs, so a next turn that sends the
conversation back hits it. Token ids are read (``tokens_of``) only when a chunk completes.

Key generations (kvconnect/chunks/keys.py): the scheduler chooses them. It starts with none (the empty
generation, as every engine does; a ``kv_producer`` with a fresh random one); ``reset_cache`` (vLLM's reset_connector) moves it to a new
random one and tells every worker to move to the same one. A request's saves name the
generation of the scheduler when it was admitted (a request admitted before a reset is stored
under the old generation, never served after it); its load names the generation it was looked
up under: the scheduler's own, or, for a P/D decode, the producer's (pd.py), which the
transfer params carry so that a pair keeps finding each other's chunks across resets.

Roles (roles.py): a ``kv_producer`` never looks up; a ``kv_consumer`` stores no prompt chunk
(with ``save_decode_cache`` only those generated tokens complete). P/D (pd.py) marks a
prefill for a remote decode with ``store_whole_prompt`` and asks with ``remote_prefill``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Optional, Protocol, Sequence

import numpy as np

from kvconnect.chunks.extra_keys import MediaItem
from kvconnect.chunks.keys import new_generation

from .metadata import SAVE_SLACK_STEPS, BlockIds, LoadJob, RequestView, SaveJob, StepPlan
from .logs import Periodic
from .roles import BOTH, Role, RolePolicy

logger = logging.getLogger(__name__)


class HitSource(Protocol):
    def lookup(self, tokens: np.ndarray, namespace: bytes = b"", *, count: bool = True,
               generation: Optional[bytes] = None, media: Sequence[MediaItem] = ()) -> int: ...
    def clear(self, generation: Optional[bytes] = None, retire: Optional[bytes] = None) -> bool: ...
    def retired(self, generation: bytes) -> bool: ...
    def tp_refusal(self, tp_size: int) -> Optional[str]: ...
    def close(self) -> None: ...


@dataclass
class _Tracked:
    prompt: np.ndarray
    stored_tokens: int  # prefix already stored or held by vLLM: chunk-aligned, or the prompt with its partial tail
    namespace: bytes = b""
    store_tail: bool = False  # P/D: also store the prompt's partial last chunk (a prefill for a remote decode), to tail_end
    generation: bytes = b""  # the scheduler's key generation when the request was admitted: its saves' generation
    media: tuple[MediaItem, ...] = ()  # the prompt's multimodal items: part of its chunks' keys
    step_ended: bool = False  # its latest save ended at a prefill step end (the next one continues it)


class KVConnectScheduler:
    def __init__(self, hits: HitSource, *, chunk_tokens: int, save_unfull_chunk: bool = False,
                 save_decode_cache: bool = False, min_load_tokens: int = 0, log_interval_s: float = 0.0,
                 role: RolePolicy = BOTH, tail_align_tokens: int = 1, exact_resume: bool = False,
                 skip_last_n_tokens: int = 0) -> None:
        self.hits = hits
        # LMCache's vLLM key: every lookup leaves the last this many tokens of what it asks about out
        self.skip_last_n_tokens = skip_last_n_tokens
        # recurrent-state layouts (recurrent.py) and engine-rebuilt groups (rebuilt.py): a restore point P is
        # the state after exactly P tokens, or P is on a rebuilt group's period, so
        # vLLM must resume at P itself; the lookup covers prompt[:-1], leaving the last token to compute
        self.exact_resume = exact_resume
        # P/D tails end on a multiple of this (vLLM's block size): a restore of a paged layout resumes
        # only on a block edge, and the decode side then computes at most one block of the prompt
        self.tail_align_tokens = max(1, tail_align_tokens)
        self.role = role  # kv_role (roles.py): whether this server looks up, stores prompts, stores decode chunks
        self.min_load_tokens = min_load_tokens
        # lookups: requests asked about; hits: loads offered; small_hits: hits below min_load_tokens
        self.lookup_stats = dict.fromkeys(("lookups", "prompt_tokens", "hits", "hit_tokens", "small_hits", "small_hit_tokens",
                                           "lookup_us"), 0)
        self.summary = Periodic(log_interval_s, self._log_summary)
        self.chunk_tokens = chunk_tokens
        self.save_unfull_chunk = save_unfull_chunk
        self.save_decode_cache = save_decode_cache
        # the key generation of this engine's lookups and saves (module doc); a kv_producer, which never
        # looks up, starts with a fresh one, so that no restart of it names a generation its reset retired
        self.generation = new_generation() if role.role is Role.PRODUCER else b""
        self._queries: dict[str, tuple[int, int, bytes]] = {}  # req_id -> (present tokens, restorable boundary, generation)
        self._loads: list[LoadJob] = []
        self._tracked: dict[str, _Tracked] = {}
        self._step = 0  # plans built so far (the latest plan's number)
        self._last_save: dict[str, int] = {}  # request -> the plan of its latest save
        self._finished: list[str] = []  # kept by vLLM until the workers report them (next plan)
        self._whole_prompt: set[str] = set()  # P/D prefills for a remote decode (store_whole_prompt)

    # -- new requests ------------------------------------------------------------------
    def num_new_matched_tokens(self, req: RequestView, num_computed: int, *, remote_prefill_tokens: int = 0,
                               generation: Optional[bytes] = None) -> tuple[int, bool]:
        """``remote_prefill_tokens``: a P/D decode whose first that many prompt tokens a producer
        stored (pd.py): they are looked up as stored (their partial last chunk included), and a
        hit under ``min_load_tokens`` is loaded too (the point is not to prefill here).
        ``generation``: the key generation they were stored under (the producer's; None: this
        scheduler's own), which the lookup and the load use."""
        remote_prefill = remote_prefill_tokens > 0
        generation = self.generation if generation is None else generation
        self._queries[req.req_id] = (num_computed, 0, generation)
        prompt = req.prompt_tokens
        if not self.role.loads:  # kv_producer: never looks up
            return 0, False
        if not req.cacheable or (len(prompt) < self.chunk_tokens and not self.save_unfull_chunk and not remote_prefill):
            # below one chunk nothing can be stored; exactly one chunk can (and loads all but its last token)
            return 0, False
        if num_computed >= len(prompt) - 1:
            return 0, False
        start = time.perf_counter()
        # a P/D producer's last chunk ends where it stored the prompt (tail_end), not at its end
        asked = prompt[:remote_prefill_tokens] if remote_prefill else prompt
        if self.exact_resume:
            asked = asked[: req.num_tokens - 1]
        if self.skip_last_n_tokens:
            asked = asked[: max(0, len(asked) - self.skip_last_n_tokens)]
        boundary = self.hits.lookup(asked, req.namespace, generation=generation, media=req.media)
        self.lookup_stats["lookup_us"] += int((time.perf_counter() - start) * 1e6)
        # vLLM must compute at least one token itself to produce logits.
        end = min(boundary, req.num_tokens - 1, len(prompt))
        stats = self.lookup_stats
        stats["lookups"] += 1
        stats["prompt_tokens"] += len(prompt)
        self.summary.dirty = True
        if end <= num_computed:
            return 0, False
        if end - num_computed < self.min_load_tokens and not remote_prefill:
            stats["small_hits"] += 1
            stats["small_hit_tokens"] += end - num_computed
            logger.debug("kvconnect: %s: not loading %d tokens beyond vLLM's %d (< min_load_tokens %d)",
                         req.req_id, end - num_computed, num_computed, self.min_load_tokens)
            return 0, False
        stats["hits"] += 1
        stats["hit_tokens"] += end - num_computed
        self._queries[req.req_id] = (num_computed, boundary, generation)
        return end - num_computed, True

    def after_alloc(self, req: RequestView, block_ids: BlockIds, num_computed: int, num_external: int) -> None:
        """Called after vLLM allocated blocks for a request entering the running set.

        ``num_computed`` is the request's computed count as vLLM holds it now (the loaded
        count for one whose load finished); for a request just asked about, the count given
        to ``num_new_matched_tokens`` (vLLM's own prefix hit) is used instead.
        """
        if not req.cacheable:
            self._queries.pop(req.req_id, None)
            return
        present, boundary, generation = self._queries.pop(req.req_id, (num_computed, 0, self.generation))
        whole_prompt = req.req_id in self._whole_prompt
        self._whole_prompt.discard(req.req_id)
        done = present
        if num_external > 0:
            end = present + num_external
            if end > boundary:  # never offered: the worker's load will fall short and report it
                logger.error("kvconnect: vLLM asked to load %d tokens of %s, %d were offered", end, req.req_id, boundary)
            elif end < boundary - 1:  # vLLM trimmed the hit: load only whole chunks below it
                boundary = end // self.chunk_tokens * self.chunk_tokens
            self._loads.append(LoadJob(req.req_id, req.prompt_tokens[:boundary], block_ids, present, end, req.namespace,
                                       generation, req.media))
            done = end
        stored = done // self.chunk_tokens * self.chunk_tokens
        if whole_prompt:  # every chunk must reach the shared tier, those vLLM held locally too (roles.py)
            stored = 0
        elif not self.role.stores_prompt:  # kv_consumer: the producer stored the prompt
            stored = max(stored, len(req.prompt_tokens) // self.chunk_tokens * self.chunk_tokens)
        if self.role.stores:
            self._tracked[req.req_id] = _Tracked(req.prompt_tokens, stored, req.namespace, store_tail=whole_prompt,
                                                 generation=self.generation, media=req.media)

    def store_whole_prompt(self, req_id: str) -> None:
        """P/D: the request is a prefill for a remote decode; store all of its prompt, the partial
        last chunk included, whatever vLLM's own prefix cache held. Call before ``after_alloc``."""
        if self.role.stores_prompt:
            self._whole_prompt.add(req_id)

    def tail_end(self, prompt_tokens: int) -> int:
        """Where a P/D prefill's stored prompt ends: the last block edge, or the last chunk end above it."""
        return max(prompt_tokens // self.tail_align_tokens * self.tail_align_tokens,
                   prompt_tokens // self.chunk_tokens * self.chunk_tokens)

    def saved_generation(self, req_id: str) -> bytes:
        """The key generation a tracked request's chunks are stored under (the current one if untracked)."""
        tracked = self._tracked.get(req_id)
        return tracked.generation if tracked is not None else self.generation

    def planned_tokens(self, req_id: str) -> int:
        """Prompt tokens whose saves are planned for a running request (0 if none / untracked)."""
        tracked = self._tracked.get(req_id)
        return min(tracked.stored_tokens, len(tracked.prompt)) if tracked is not None else 0

    # -- every step ------------------------------------------------------------------
    def build_plan(
        self,
        scheduled: Mapping[str, int],
        num_computed_of: Callable[[str], int],
        block_ids_of: Callable[[str], Optional[BlockIds]],
        tokens_of: Optional[Callable[[str], np.ndarray]] = None,
        preempted: Collection[str] = (),
    ) -> StepPlan:
        """Loads planned since the last step, and the saves of chunks completed this step.

        ``tokens_of(req_id)``: the request's prompt + output token ids (needed only with
        ``save_decode_cache``). ``preempted``: requests whose blocks vLLM freed for this step
        (the workers then land earlier saves before the forward writes those blocks).
        """
        saves = []
        for req_id, num_new in scheduled.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            try:
                job = self._save_job(req_id, tracked, num_computed_of(req_id) + num_new, block_ids_of, tokens_of)
            except Exception:  # a save is optional; a planned load must still be shipped
                logger.warning("kvconnect: cannot plan the save of %s", req_id, exc_info=True)
                continue
            if job is not None:
                saves.append(job)
        self.summary.tick()
        self._step += 1
        plan = StepPlan(loads=tuple(self._loads), saves=tuple(saves), finished=tuple(self._finished),
                        preempted=tuple(sorted(preempted)), idle=not any(scheduled.values()), step=self._step)
        self._loads, self._finished = [], []
        for req_id in preempted:  # their blocks are gone: the workers land their saves in this step
            self._last_save.pop(req_id, None)
        self._last_save.update((job.req_id, self._step) for job in saves)
        return plan

    def _save_job(self, req_id: str, tracked: _Tracked, computed: int, block_ids_of, tokens_of) -> Optional[SaveJob]:
        tokens = tracked.prompt
        if computed > len(tokens) and self.save_decode_cache and tokens_of is not None:
            if computed // self.chunk_tokens * self.chunk_tokens <= tracked.stored_tokens:
                return None  # no chunk completes this step: do not read the token ids
            tokens = tokens_of(req_id)
        end = self._storable_end(tokens, computed, len(tracked.prompt), tracked.store_tail)
        if end <= tracked.stored_tokens:
            return None
        block_ids = block_ids_of(req_id)
        if block_ids is None:
            return None
        # a stored partial prompt tail is a chunk of its own: the full chunk over it is new
        stored = tracked.stored_tokens // self.chunk_tokens * self.chunk_tokens
        tail = end == len(tracked.prompt) or (tracked.store_tail and end == self.tail_end(len(tracked.prompt)))
        # short of the prompt's own last save, vLLM prefills on next step: nobody resumes here
        prompt_end = self._storable_end(tracked.prompt, len(tracked.prompt), len(tracked.prompt), tracked.store_tail)
        step_end = end < prompt_end
        job = SaveJob(req_id, tokens[:end], block_ids, stored, tracked.namespace, tracked.generation,
                      step_end=step_end, continues=tracked.step_ended,
                      then=tracked.prompt[end : end + self.chunk_tokens] if step_end else None, media=tracked.media)
        tracked.step_ended = step_end
        tracked.stored_tokens = end if tail else end // self.chunk_tokens * self.chunk_tokens
        return job

    def _storable_end(self, tokens: np.ndarray, computed: int, prompt_tokens: int, tail: bool = False) -> int:
        """Tokens whose chunks are complete once ``computed`` tokens are (only ids known count)."""
        computed = min(computed, len(tokens))
        if computed == prompt_tokens and tail:
            return self.tail_end(computed)
        if computed == prompt_tokens and self.save_unfull_chunk:
            return computed
        return computed // self.chunk_tokens * self.chunk_tokens

    def _log_summary(self) -> None:
        s = self.lookup_stats
        logger.info("kvconnect: since start: %d of %d prompts hit, %d of %d prompt tokens loaded from the cache "
                    "(%.1f%%); %d hits under min_load_tokens=%d left to vLLM (%d tokens); lookups took %.1f ms in all",
                    s["hits"], s["lookups"], s["hit_tokens"], s["prompt_tokens"],
                    100.0 * s["hit_tokens"] / max(1, s["prompt_tokens"]), s["small_hits"], self.min_load_tokens,
                    s["small_hit_tokens"], s["lookup_us"] / 1e3)

    # -- finished ----------------------------------------------------------------------
    def request_finished(self, req_id: str) -> bool:
        """True when a save of the request may still be running in the workers.

        Blocks vLLM frees now go to plan ``self._step + 1`` at the earliest, before whose
        forward the workers have landed every save of plans up to ``self._step + 1 -
        SAVE_SLACK_STEPS``; a request whose latest save is more recent is kept by vLLM until
        the workers report it (the next plan lists it in ``finished``; that step reports it).
        Usually a request's last chunk is saved many decode steps before it finishes.
        """
        self._tracked.pop(req_id, None)
        self._queries.pop(req_id, None)
        self._whole_prompt.discard(req_id)
        last = self._last_save.pop(req_id, None)
        if last is not None and last > self._step + 1 - SAVE_SLACK_STEPS:
            self._finished.append(req_id)
            return True
        return False

    def reset_cache(self) -> bool:
        """vLLM's reset_connector: move to a new key generation, here and in every worker.

        The new generation holds from now on whether or not every worker answered (lookups,
        loads and saves name it; a worker that missed the clear only keeps its private pool's
        old chunks, which no key of the new generation reaches); False tells vLLM one did not.
        A server that stores prompts (a P/D producer) has the workers leave the old generation's
        retirement marker in the tiers (``KVCacheEngine.reset``): decode servers refuse params
        naming it from then on (pd.py)."""
        old, self.generation = self.generation, new_generation()
        return self.hits.clear(self.generation, retire=old if self.role.stores_prompt else None)
