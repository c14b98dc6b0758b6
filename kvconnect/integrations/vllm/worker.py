"""Worker side of the vLLM connector: moves bytes, decides nothing.

Runs in each vLLM worker (one per TP x PP rank); holds the rank's KVCacheEngine and serves
the lookup channel. No vLLM types: the connector passes a ``Translation`` and ``StepPlan``s.
Per step, in vLLM's order:

    begin_step(plan)                  land earlier saves only if this step may reuse their blocks
    load(plan)                        restore planned loads; reported through transfer_results
    save(plan)                        gather this step's chunks on a background thread
    transfer_results(finished_ids)    -> (saved, loaded, failed-load request ids)
    take_load_error_blocks()          -> block ids vLLM must recompute (single-group caches)

Saves are asynchronous and overlap later steps: a save of step s (``StepPlan.step``) has
landed before the forward of step s + SAVE_SLACK_STEPS, and ``begin_step`` (from
``handle_preemptions``, vLLM's first call of a step, before the forward) waits for it there if
it has not. A save reads blocks of a running request; vLLM hands such a block to another
request while an earlier save may read it only in these cases, in which ``begin_step`` lands
every pending save:

- the plan lists preempted requests (vLLM freed their blocks for this step);
- the layout has windowed or state groups (vLLM frees blocks that leave a window between any
  two steps), so such layouts land saves at every step;
- the step is idle (nothing scheduled: waiting costs nothing and frees held requests).

A finished request's blocks are freed at once unless its last save is more recent than
SAVE_SLACK_STEPS allows (scheduler.request_finished); then vLLM keeps them, the next plan lists
the request in ``finished`` and that step's ``transfer_results`` waits for its saves and
reports it. At most ``MAX_PENDING_SAVES`` saves are in flight; a step past that waits for the
oldest. Nothing here raises into vLLM: a failed load is reported so vLLM recomputes, a failed
save is a future miss; both are counted.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from kvconnect.chunks.extra_keys import MediaItem
from kvconnect.config import Config
from kvconnect.engine import KVCacheEngine
from kvconnect.transfer.placement import pin_current_thread, plan_copy_threads

from .lookup_channel import LookupServer
from .logs import Periodic, registration_line
from .metadata import SAVE_SLACK_STEPS, LoadJob, SaveJob, StepPlan
from .sleep import KVMemoryGate
from .translate import NULL_BLOCK_ID, Translation

logger = logging.getLogger(__name__)

MAX_PENDING_SAVES = 32  # saves in flight before a step waits for the oldest (bounds the store's lag)

_COUNTERS = ("loads", "load_failures", "loaded_tokens", "saves", "save_failures", "lookups", "saves_skipped_asleep",
             "load_us", "save_us", "save_wait_us", "save_joins", "preempted_steps")  # load: in the step; save: on the store thread;
# wait: steps blocked on saves; joins: steps that landed every pending save (preemption, windows, idle)


class KVConnectWorker:
    def __init__(self, config: Config, channel_address: Optional[str], *, chunk_words: str = "") -> None:
        self.config = config
        self.chunk_words = chunk_words or "set"  # how the chunk size came to be, for the start-up line
        self.engine: Optional[KVCacheEngine] = None
        self.translation: Optional[Translation] = None
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvconnect-save")
        self._pending: list[tuple[str, int, Future]] = []  # (request id, plan step, save), oldest first
        self._blocks_leave_running = False
        self._begun: Optional[StepPlan] = None  # the plan begin_step last ran for
        self._finished: set[str] = set()  # kept by vLLM until reported saved
        self._loaded: set[str] = set()
        self._failed_loads: set[str] = set()
        self._error_blocks: set[int] = set()
        self.memory = KVMemoryGate()  # closed while vLLM's sleep mode has released the KV memory (sleep.py)
        self.server = LookupServer(channel_address, self, token=config.lookup_token) if channel_address else None
        self.summary = Periodic(config.log_interval_s, self._log_summary)

    # -- setup -------------------------------------------------------------------------
    def register(self, translation: Translation, *, shared_writer: bool = True) -> None:
        """Build the engine over vLLM's caches.

        ``shared_writer``: whether this rank writes the shared tiers; False for the TP ranks
        other than the writer of a replicated layout (``Translation.tp_replicated``,
        ``ParallelRanks.writes_shared``): they read the writer's objects and keep their own
        stores in their private pool (``KVCacheEngine(shared_writer=False)``).

        Raises LayoutError when the engine cannot serve the layout (e.g. a chunk size that is
        not a multiple of a page group's block size); the worker then stays off (0 hits).
        """
        engine = KVCacheEngine(translation.layout, self.config, shared_writer=shared_writer)
        if engine.stores_nothing:  # the engine has said why, once
            engine.close()
            logger.debug("kvconnect: off for this engine: %s", engine.stores_nothing)
            return
        placement = plan_copy_threads(self.config.num_threads, device_type=translation.layout.device.type)
        engine.store_threads, engine.load_threads = placement.store_threads, placement.load_threads
        if placement.store_cores:
            self._executor.submit(pin_current_thread, placement.store_cores).result()
        self.translation, self.engine = translation, engine
        # vLLM frees window / state blocks of running requests between steps (see the module doc)
        self._blocks_leave_running = any(g.is_windowed for g in translation.layout.groups)
        replicated = ("; KV replicated over TP: keyed without the rank, " +
                      ("this rank writes the shared tiers" if shared_writer else "read from the writer rank's shared copy")
                      if translation.tp_replicated else "")
        logger.info("%s; copy threads: %d store, %d load (%s)%s", registration_line(translation.layout, self.config, engine.pool,
                    engine.storage, self.chunk_words), placement.store_threads, placement.load_threads, placement.reason, replicated)
        logger.debug("kvconnect: groups: %s", translation.layout.describe())

    # -- lookup channel handler (called from the server thread) --------------------------
    def lookup(self, tokens: np.ndarray, namespace: bytes = b"", generation: Optional[bytes] = None,
               media: Sequence[MediaItem] = (), verify: bool = True) -> int:
        self._count("lookups")
        if self.engine is None:
            return 0
        # a hit sampled for verification (KVCONNECT_VERIFY_RATE) is a miss here, so vLLM computes the
        # prefix and this worker's save compares it with the stored chunks; a P/D probe never is
        return self.engine.lookup(tokens, namespace=namespace, generation=generation, media=media, verify=verify)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
        if self.engine is not None:
            out.update({f"engine_{k}": v for k, v in vars(self.engine.stats).items()})
            checks, requests, retired = self.engine.verifier.snapshot()
            out.update({f"verify_{kind}_{result}": n for (kind, result), n in checks.items()})
            out["verify_requests"], out["verify_retired"] = requests, int(retired)
        out["enabled"] = int(self.engine is not None)
        out["num_groups"] = self.translation.layout.num_groups if self.engine is not None else 0
        return out

    def clear(self, generation: Optional[bytes] = None, retire: Optional[bytes] = None) -> None:
        """vLLM's reset_connector: never serve a chunk stored before now, from any tier
        (``KVCacheEngine.reset``), moving to ``generation``, which the scheduler chose (every
        rank moves to the same one; None: a random one). Runs on the save thread after every
        save submitted so far. Saves and loads name their generation themselves (the
        scheduler's when it planned them, metadata.py), so a save of KV computed before the
        reset lands under the old generation and is never served after it. Called from the
        lookup channel's thread."""
        if self.engine is not None:
            self._executor.submit(self.engine.reset, generation, retire=retire).result()

    def retired(self, generation: bytes) -> bool:
        """Whether a P/D producer's reset left ``generation`` behind (its marker is in a tier)."""
        return self.engine is not None and self.engine.generation_retired(generation)

    def tp_refusal(self, tp_size: int) -> str:
        """Why this rank cannot restore what ranks of TP size ``tp_size`` stored ("" when it can;
        a P/D decode side asks before waiting for a producer of another TP size, pd.py)."""
        if self.engine is None:
            return "kvconnect is off on this worker"
        return self.engine.tp_read_refusal(tp_size) or ""

    # -- per step ----------------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        """Before this step's forward: land pending saves whose source blocks the step may reuse
        (all of them in the cases of the module doc), then those SAVE_SLACK_STEPS old; forget
        landed ones; keep at most MAX_PENDING_SAVES in flight. vLLM calls it twice a step with
        one plan (handle_preemptions, bind_connector_metadata): the second call does nothing."""
        if plan is self._begun:
            return
        self._begun = plan
        if plan.preempted:
            self._count("preempted_steps")
        if plan.preempted or plan.idle or self._blocks_leave_running:
            if self._pending:
                self._count("save_joins")
            self._wait(len(self._pending))
        else:
            due = sum(1 for _, step, _ in self._pending if step <= plan.step - SAVE_SLACK_STEPS)
            self._wait(due)  # oldest first: the due ones are a prefix
            self._pending = [p for p in self._pending if not p[2].done()]
            self._wait(len(self._pending) - MAX_PENDING_SAVES)
        self.summary.tick()  # at most once per log_interval_s

    def suspend(self) -> None:
        """vLLM is about to release its KV memory (sleep mode): land every pending save, then
        keep transfers off that memory until ``resume`` (sleep.py). Idempotent."""
        if self.memory.suspend():
            self.drain()
            logger.info("kvconnect: KV memory released by vLLM's sleep mode; transfers paused")

    def resume(self) -> None:
        """vLLM mapped its KV memory back (wake-up): transfers resume. Idempotent."""
        self.memory.resume()

    def drain(self) -> None:
        """Land every pending save (shutdown, tests)."""
        self._wait(len(self._pending))

    def _wait_for(self, req_ids: set[str]) -> None:
        """Block until every pending save of ``req_ids`` has landed; count the time."""
        futures = [future for req_id, _, future in self._pending if req_id in req_ids and not future.done()]
        self._block_on(futures)

    def _wait(self, oldest: int) -> None:
        """Block until the ``oldest`` earliest pending saves have landed; count the time."""
        if oldest > 0:
            waiting, self._pending = self._pending[:oldest], self._pending[oldest:]
            self._block_on([future for _, _, future in waiting if not future.done()])

    def _block_on(self, futures: list[Future]) -> None:
        if futures:
            start = time.perf_counter()
            for future in futures:
                future.result()  # _save_one never raises
            self._count("save_wait_us", int((time.perf_counter() - start) * 1e6))

    def load(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        for job in plan.loads:
            landed = job.present_tokens  # the prefix valid in vLLM's blocks after this load
            try:
                landed = self._load_one(job)
            except Exception:
                logger.warning("kvconnect: load of %s failed; vLLM will recompute", job.req_id, exc_info=True)
            self._loaded.add(job.req_id)
            self._count("loads")
            if landed < job.end_tokens:
                self._count("load_failures")
                self._report_failed_load(job, landed)
        if plan.loads:
            self._count("load_us", int((time.perf_counter() - start) * 1e6))

    def _load_one(self, job: LoadJob) -> int:
        """Restore ``job``; the prefix of its tokens valid in vLLM's blocks afterwards."""
        if self.engine is None or self.translation is None or not self.memory.is_open:
            return job.present_tokens
        tables = self.translation.block_tables(job.block_ids)
        mask = None
        if job.present_tokens:
            # vLLM's own prefix hit may end inside a chunk; its blocks may be shared with other
            # running requests, so the rows of those tokens must never be written
            mask = np.ones(len(job.tokens), dtype=bool)
            mask[: job.present_tokens] = False
        loaded = self.engine.retrieve(job.tokens, tables, mask=mask, namespace=job.namespace, generation=job.generation,
                                      media=job.media)
        self._count("loaded_tokens", loaded)
        return job.present_tokens + loaded

    def _report_failed_load(self, job: LoadJob, landed: int) -> None:
        """Tell vLLM what to recompute after a load that fell short of ``job.end_tokens``.

        One vLLM group: exactly the blocks from the one holding token ``landed`` (the end of
        the restored prefix: chunks land in order and the restore gate stops at the first
        that did not) to the last block of the load; vLLM keeps every block before it and
        recomputes from there. Several vLLM groups: block ids are per group and vLLM 0.32
        cannot map a flat set back to requests (it raises), so the request is reported:
        vLLM frees its blocks and schedules it anew, and the next lookup offers what is
        still restorable (the chunks that did land).
        """
        if self.translation is None or self.translation.num_vllm_groups != 1:
            self._failed_loads.add(job.req_id)
            return
        (ids,) = self.translation.vllm_ids(job.block_ids)
        per_block = self.translation.tokens_per_block(0)
        first = max(landed, job.present_tokens) // per_block
        last = -(-job.end_tokens // per_block)
        self._error_blocks.update(b for b in ids[first:last] if b != NULL_BLOCK_ID)

    def save(self, plan: StepPlan) -> None:
        self.summary.dirty |= bool(plan.saves or plan.loads)
        self._finished.update(plan.finished)
        for job in plan.saves:
            if not self.memory.is_open:
                self._count("saves_skipped_asleep")
            elif self.engine is not None:
                self._pending.append((job.req_id, plan.step, self._executor.submit(self._save_one, job)))

    def _save_one(self, job: SaveJob) -> None:
        start = time.perf_counter()
        try:
            tables = self.translation.block_tables(job.block_ids)
            mask = None
            if job.stored_tokens:
                mask = np.ones(len(job.tokens), dtype=bool)
                mask[: job.stored_tokens] = False
            self.engine.store(job.tokens, tables, mask=mask, namespace=job.namespace, generation=job.generation,
                              step_end=job.step_end, continues=job.continues, then=job.then, media=job.media)
            self._count("saves")
        except Exception:
            logger.warning("kvconnect: save of %s failed; it will be a miss", job.req_id, exc_info=True)
            self._count("save_failures")
        finally:
            self._report_mismatches(job.req_id)
            self._count("save_us", int((time.perf_counter() - start) * 1e6))

    def _report_mismatches(self, req_id: str) -> None:
        """One loud error per verification mismatch of this save (kvconnect/restore/verify.py)."""
        if self.engine is None:
            return
        for mismatch in self.engine.verifier.take_mismatches():
            logger.error("kvconnect: VERIFICATION MISMATCH in request %s: the rows vLLM computed differ from the stored "
                         "ones: %s; retiring layout fingerprint %s: this process serves no hit from it, loads and stores "
                         "nothing for it from now on", req_id, mismatch.describe(self.engine.layout),
                         self.engine.layout.fingerprint.hex()[:16])

    def _log_summary(self) -> None:
        if self.engine is None:
            return
        c, e, pool = self.stats(), self.engine.stats, self.engine.pool.stats()
        logger.info("kvconnect: since start: %d loads (%d tokens, %d failed), %d saves (%d chunks stored, %d skipped, "
                    "%d failed); CPU pool %d/%d chunks, %d evictions", c["loads"], c["loaded_tokens"], c["load_failures"],
                    c["saves"], e.stored_chunks, e.skipped_chunks, c["save_failures"], pool.used_slots, pool.num_slots,
                    pool.evictions)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished saving, finished loading, failed loading) since the last call.

        The plan's ``finished`` requests are reported now, after waiting for what of their saves
        still runs (see the module doc).
        """
        if self._finished:
            self._wait_for(self._finished)
        saved, self._finished = self._finished, set()
        loaded, self._loaded = self._loaded, set()
        failed, self._failed_loads = self._failed_loads, set()
        return saved, loaded, failed

    def take_load_error_blocks(self) -> set[int]:
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._executor.shutdown(wait=True)
            if self.server is not None:
                self.server.close()
            if self.engine is not None:
                self.engine.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n
