"""Prefill/decode disaggregation on the scheduler side: vLLM's P/D protocol over a shared tier.

The connector routes its scheduler calls through ``PDScheduler`` (which wraps
``KVConnectScheduler``); the worker side has nothing to do with P/D (it stores and loads what
the plans say). Per request, in vLLM's order:

    num_new_matched_tokens(req, num_computed, params) -> (tokens | None, async)
    request_finished(req, params) -> kv_transfer_params | None    (before the scheduler's own)

Producer side (``kv_producer``, or ``kv_both`` acting as one): a request whose params carry
``do_remote_decode`` is marked so that every prompt token is stored, the partial last chunk
included, and its ``request_finished`` returns ``transfer_params.StoredPrefill`` params naming
them — only when the whole prompt's saves were planned (an aborted prefill names nothing, and
the decode side then recomputes). A producer never looks anything up.

Decode side (``kv_consumer`` or ``kv_both``) with such params: the producer's saves land in the
shared tier asynchronously (the prefill response may reach the decode server first), so the
request waits — vLLM's "ask later", ``None`` from ``get_num_new_matched_tokens`` — probing the
tier first after ``pd_poll_interval_s``, the interval doubling after every probe that finds the
chunks missing up to ``MAX_POLL_INTERVAL_S`` (a remote store's master answers every probe: at a
fixed 5 ms a few waiting requests sent a Mooncake master hundreds of RPCs a second, competing with
the producer's writes), and past that ``PROBE_GROWTH`` of the time waited (anyone can compute a
prompt's digest, so params naming a prompt never stored must not buy a lookup per step: one
request's probes grow with the log of the wait; and the interval is at least the wait times the prompt
over ``PROBE_TOKENS_PER_REQUEST``, so the tokens one request's probes look up are bounded whatever
its length), until every named token is restorable; then it is
an ordinary load (small hits and partial chunks included). Past ``pd_wait_timeout_s`` it takes
what the tier holds (vLLM recomputes the rest). Params that are malformed or name another
prompt, model or chunk size are not waited on (a plain lookup).

Producer and decode side may run different TP sizes (issue 40 item 3). The decode side's
ranks then restore the producer's chunks by cutting their own heads out of the objects the
producer's ranks wrote (kvconnect/restore/other_tp_reads.py): its probes and its load are the
ordinary ones, whose lookup on each worker first assembles, from the writers' objects, the
chunks every head range that rank needs is present for (a chunk missing one range is not
assembled: the probe waits on). Before waiting, the decode side asks its workers once
whether they can read that TP size at all (``hits.tp_refusal``, one lookup-channel round
trip, remembered per size once every worker said yes): a layout whose groups cannot be read
across sizes (groups keyed by rank, such as Mamba states; planes in column slices; a head count
or state blocks the producer's size does not split; a size ``read_tp_sizes`` leaves out) is
refused by name,
counted in ``remote_prefill_rejected``, and does a plain lookup, before anything is loaded.
Admitted mismatches are counted in ``remote_prefill_other_tp``. Timeouts and rejected params
are counted (``counters``) and logged at most once per ``WARN_INTERVAL_S``. Without params the
decode side does a plain lookup.

Resets (vLLM's reset_connector, scheduler.py): each side's reset moves only its own key
generation. The producer's params name the generation its prefill was stored under, and the
decode side probes and loads under that one, not its own: a consumer reset changes nothing for
params it receives afterwards; after a producer reset new params name the new generation, and
params of a prefill admitted before it still name the old one (its chunks were stored there).
Params are the client's to send (a router retries, a request is delayed or replayed), so an
old generation must not load after the weights changed. A producer's reset leaves the old
generation's *retirement marker* in the shared tier (``KVCacheEngine.reset(retire=)``; the
scheduler asks for it on servers that store prompts), and before waiting for params the decode
side asks its workers whether the named generation is retired (``hits.retired``, one marker
lookup): the tier, not the loads this server happened to see, says so, the same on a server
that saw nothing of that generation and on one started after the reset. Params naming a
retired generation are refused (counted in ``remote_prefill_rejected``; a plain lookup under
this server's own generation instead), as are those of a generation the pair moved on from in
this server's memory (this server reset since it first loaded it, and its producer has since
named one first loaded after the reset), which covers a marker the tier evicted. A producer
that only restarted moves to a fresh generation at start (scheduler.py), so its earlier
generations stay loadable: its weights are the checkpoint's again. Limit: a ``kv_both``
producer starts with the empty generation; once a reset of it retired that, its params after
a restart are refused (recomputed) until the marker ages out of the tier.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvconnect.throttled_warning import RepeatingWarning

from .metadata import RequestView
from .roles import Role, RolePolicy
from .scheduler import KVConnectScheduler
from .transfer_params import StoredPrefill, TransferParamsError, mismatch, prompt_digest, remote_prefill, wants_remote_decode

logger = logging.getLogger(__name__)

WARN_INTERVAL_S = 30.0
# the longest a waiting decode goes between two probes of the shared tier in its first ~0.4 s (unless
# pd_poll_interval_s is longer): bounds both the load on a remote store and the time a request waits
# past its chunks landing
MAX_POLL_INTERVAL_S = 0.05
# past that, the interval is this fraction of the time waited so far: the probes one request's params
# can cost grow with the log of the wait, not linearly (~30 for a 5 s wait, not ~100), and a request
# waits at most this fraction longer than its chunks took to land
PROBE_GROWTH = 0.125
# the prompt tokens one waiting request's probes may look up over its whole wait, beyond its first probe
# and its final lookup: a long prompt is probed less often (issue 39: params naming a 262k-token prompt
# nobody stored spent 1.4 s of CPU in ~30 full probes); prompts up to ~30k tokens keep the schedule above
PROBE_TOKENS_PER_REQUEST = 1 << 20
MAX_GENERATIONS = 1024  # key generations remembered (one per reset of a producer)

COUNTERS = (
    "remote_decode_prefills",  # producer: prefills for a remote decode whose stored tokens were named
    "remote_prefills",  # decode side: requests whose params named a producer's chunks
    "remote_prefill_ready",  # ... found complete in the shared tier (loaded)
    "remote_prefill_timeouts",  # ... not complete within pd_wait_timeout_s (the rest recomputed)
    "remote_prefill_rejected",  # ... params unusable or naming another prompt / chunk size, or a TP size not readable here
    "remote_prefill_other_tp",  # ... admitted with a producer of another TP size (its heads cut out of the producer's objects)
    "remote_prefill_wait_us",  # time such requests waited for the producer's chunks
)


@dataclass(frozen=True)
class ServerIdentity:
    """What the producer names and the decode side checks besides the prompt."""

    chunk_tokens: int
    tp_size: int
    model: str = ""
    engine_id: str = ""


def engine_block_tokens(vllm_config: Any, kv_cache_config: Any = None) -> int:
    """vLLM's block size (the least common multiple over KV-cache groups with the hybrid
    allocator): where a P/D prefill's stored prompt ends (``KVConnectScheduler.tail_end``)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    sizes = [int(g.kv_cache_spec.block_size) for g in groups if getattr(getattr(g, "kv_cache_spec", None), "block_size", 0)]
    if not sizes:
        sizes = [int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 0) or 1)]
    return math.lcm(*sizes)


@dataclass
class _Waiting:
    stored: StoredPrefill
    since: float
    probed: float
    interval_s: float  # until the next probe; doubles after each probe that misses


class PDScheduler:
    def __init__(self, scheduler: KVConnectScheduler, role: RolePolicy, identity: ServerIdentity, *,
                 wait_timeout_s: float, poll_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.role = role
        self.identity = identity
        self.wait_timeout_s = wait_timeout_s
        self.poll_interval_s = poll_interval_s
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}
        self._warn = RepeatingWarning(logger.warning, WARN_INTERVAL_S, clock=clock,
                                      held_note=" ({held} more since the last such message)").failed
        # generation -> (producer engine id, this server's generation at its first load)
        self._generations: "OrderedDict[bytes, tuple[str, bytes]]" = OrderedDict()
        self._readable_tp: set[int] = set()  # producer TP sizes every worker said it reads

    # -- new requests ------------------------------------------------------------------
    def num_new_matched_tokens(self, req: RequestView, num_computed: int, params: Any) -> tuple[Optional[int], bool]:
        if wants_remote_decode(params) and req.cacheable:
            self.scheduler.store_whole_prompt(req.req_id)  # no-op on a server that stores no prompts
        if not self.role.loads:
            return 0, False  # kv_producer
        waiting = self._waiting.get(req.req_id)
        if waiting is None:
            stored = self._remote_prefill(req, params)
            if stored is None:
                return self.scheduler.num_new_matched_tokens(req, num_computed)
            now = self._clock()
            waiting = self._waiting[req.req_id] = _Waiting(stored, now, now - self.poll_interval_s, self.poll_interval_s)
            self.counters["remote_prefills"] += 1
            if stored.tp_size != self.identity.tp_size:
                self.counters["remote_prefill_other_tp"] += 1
        now = self._clock()
        expired = now - waiting.since >= self.wait_timeout_s
        if not expired and now - waiting.probed < waiting.interval_s:
            return None, False  # ask later, without touching the tier
        waiting.probed = now
        needed = waiting.stored.tokens  # <= the prompt (transfer_params.mismatch)
        generation = waiting.stored.generation  # the producer's, whatever this server's own (kvconnect/chunks/keys.py)
        if self.scheduler.hits.lookup(req.prompt_tokens[:needed], req.namespace, count=False,
                                      generation=generation) < needed and not expired:
            waiting.interval_s = max(min(2 * waiting.interval_s, max(self.poll_interval_s, MAX_POLL_INTERVAL_S)),
                                     PROBE_GROWTH * (now - waiting.since),
                                     self.wait_timeout_s * needed / PROBE_TOKENS_PER_REQUEST)
            return None, False
        del self._waiting[req.req_id]
        self.counters["remote_prefill_wait_us"] += int((now - waiting.since) * 1e6)
        if expired:
            self.counters["remote_prefill_timeouts"] += 1
            self._warn("kvconnect: P/D: the producer's chunks of %s were not all in the shared tier after %.1f s; "
                       "loading what is there, vLLM recomputes the rest (KVCONNECT_PD_WAIT_TIMEOUT_S)",
                       req.req_id, self.wait_timeout_s)
        else:
            self.counters["remote_prefill_ready"] += 1
            self._loaded(waiting.stored)
        return self.scheduler.num_new_matched_tokens(req, num_computed, remote_prefill_tokens=needed, generation=generation)

    # -- key generations the pair moved on from --------------------------------------------
    def _loaded(self, stored: StoredPrefill) -> None:
        """Note the first load under ``stored.generation``: its producer, and this server's own
        generation then (what a reset here moves)."""
        if stored.generation not in self._generations:
            self._generations[stored.generation] = (stored.engine_id, self.scheduler.generation)
            while len(self._generations) > MAX_GENERATIONS:
                self._generations.popitem(last=False)

    def _moved_on(self, stored: StoredPrefill) -> bool:
        """Whether the pair moved on from ``stored.generation``: first loaded before this
        server's last reset, and its producer has since named a generation first loaded after.
        Only generations this server loaded count, so params naming a generation nobody stored
        under (anyone can write them) can never retire a real one."""
        seen = self._generations.get(stored.generation)
        now = self.scheduler.generation
        if seen is None or seen[1] == now:
            return False
        return any(engine == seen[0] and epoch == now for engine, epoch in self._generations.values())

    def _remote_prefill(self, req: RequestView, params: Any) -> Optional[StoredPrefill]:
        """The producer's stored prefill this request may wait for, or None (plain lookup)."""
        try:
            stored = remote_prefill(params)
        except TransferParamsError as exc:
            self.counters["remote_prefill_rejected"] += 1
            self._warn("kvconnect: P/D: ignoring the kv_transfer_params of %s (a plain lookup instead): %s", req.req_id, exc)
            return None
        if stored is None or not req.cacheable:
            return None
        if self._moved_on(stored):
            self.counters["remote_prefill_rejected"] += 1
            self._warn("kvconnect: P/D: the params of %s name a key generation this pair has moved on from (a reset "
                       "on both sides): a plain lookup instead", req.req_id)
            return None
        why = mismatch(stored, prompt=req.prompt_tokens, namespace=req.namespace,
                       chunk_tokens=self.identity.chunk_tokens, model=self.identity.model) or self._tp_refusal(stored.tp_size)
        if why is not None:
            self.counters["remote_prefill_rejected"] += 1
            self._warn("kvconnect: P/D: cannot use the producer's chunks for %s (a plain lookup instead): %s", req.req_id, why)
            return None
        if self.scheduler.hits.retired(stored.generation):
            self.counters["remote_prefill_rejected"] += 1
            self._warn("kvconnect: P/D: the params of %s name a key generation its producer left behind at a reset "
                       "(KV of the previous weights, or a replayed request): a plain lookup instead", req.req_id)
            return None
        return stored

    def _tp_refusal(self, tp_size: int) -> Optional[str]:
        """Why this server's ranks cannot restore what a producer of ``tp_size`` stored, or None.
        A size every worker reads is remembered (a layout does not change while it serves); a
        refusal is asked again next time (a worker that did not answer may answer then)."""
        if tp_size == self.identity.tp_size or tp_size in self._readable_tp:
            return None
        why = self.scheduler.hits.tp_refusal(tp_size)
        if why is None:
            self._readable_tp.add(tp_size)
            return None
        return f"the producer runs TP {tp_size}, this server TP {self.identity.tp_size}, and {why}"

    # -- finished ----------------------------------------------------------------------
    def request_finished(self, req: RequestView, params: Any) -> Optional[dict[str, Any]]:
        """The params a prefill for a remote decode returns (call before the scheduler's own
        ``request_finished``, which forgets the request), or None."""
        self._waiting.pop(req.req_id, None)  # aborted while waiting
        if not wants_remote_decode(params) or not self.role.stores_prompt or not req.cacheable:
            return None
        planned = self.scheduler.planned_tokens(req.req_id)
        if planned < self.scheduler.tail_end(len(req.prompt_tokens)) or planned == 0:
            return None  # the prompt was not all computed here (aborted): name nothing, decode recomputes
        self.counters["remote_decode_prefills"] += 1
        return StoredPrefill(tokens=planned, chunk_tokens=self.identity.chunk_tokens, tp_size=self.identity.tp_size,
                             prompt_digest=prompt_digest(req.prompt_tokens, req.namespace), model=self.identity.model,
                             engine_id=self.identity.engine_id,
                             generation=self.scheduler.saved_generation(req.req_id)).to_params()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def is_producer(self) -> bool:
        return self.role.role is Role.PRODUCER
