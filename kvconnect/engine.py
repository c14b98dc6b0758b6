"""KVCacheEngine: the Python API every engine adapter calls.

    engine = KVCacheEngine(layout, Config.from_env())
    engine.store(tokens, block_ids, mask=None)     -> tokens now stored (chunks present)
    engine.lookup(tokens)                          -> P, tokens restorable from token 0
    engine.retrieve(tokens, block_ids, mask=None)  -> tokens loaded into the paged memory

Each also takes ``namespace=`` (str or bytes): what besides token ids decides the KV, e.g. a
LoRA adapter or a tenant's salt. Chunks stored under one namespace are misses under another
(see kvconnect/chunks/keys.py); no namespace is the empty one.

Data flow of ``store``: tokens -> chunk bounds -> key chain; block ids -> per-group slots
of the rows each chunk keeps (windowed groups keep only their trailing rows); one
gather moves every plane of every chunk into pool slots; headers are committed.

Data flow of ``retrieve``: key chain -> pinned pool entries -> restore gate (largest P at
which every group can resume) -> exactly the rows each group needs at P -> one scatter
into the engine's blocks. All validation happens before the first byte moves.

``mask`` follows LMCache: a bool tensor over the tokens whose leading ``False`` run marks
tokens the engine already has; those chunks are neither stored nor loaded, and ``retrieve``
returns the tokens loaded beyond them. For ``store`` the run is a chunk multiple; for
``retrieve`` it may end inside a chunk (an engine's block-aligned prefix hit): rows of the
masked tokens are never written.

The restore-point idea lives in kvconnect/restore/: the engine holds one ``RestoreScheme``
(``WholeChunks`` or ``WindowParts``, chosen here once) that stores, looks up and retrieves,
writing through ``ObjectWriter`` and loading through ``ChunkLoader``. Its counters are an
``EngineStats`` (engine_stats.py) added under one lock.
"""

from __future__ import annotations

import dataclasses

import logging
import time
from typing import Optional, Sequence

import numpy as np
import torch

from .chunks.extra_keys import MediaItem, media_extras, media_items
from .chunks.chunk_format import ChunkHeader
from .chunks.keys import Chunk, ChunkKeyer, Namespace, Tokens, generation_bytes, new_generation, tokens_as_int64
from .metrics.prometheus import register_engine, start_exporter, unregister
from .metrics.recorders import OpLog
from .transfer import dispatch
from .config import Config
from .engine_stats import Counters
from .errors import ConfigError, TokenError
from .events import ChunkEventLog
from .layout.kv_layout import KVLayout
from .layout.rows import chunk_bounds
from .restore.parts import PartLayout, slice_wide_planes
from .layout.chunk_size import check_chunk_size, choose_chunk_size, layout_rules
from .restore.plan import BlockTables
from .restore.points import splits_window_groups
from .restore.other_tp_reads import OtherTPReader, read_refusal
from .restore.reads import ChunkLoader
from .restore.scheme import OwnObjects, RestoreScheme, ShortHitFill
from .restore.verify import RowCheck, Verifier
from .restore.whole_chunks import WholeChunks
from .restore.window_parts import WindowParts
from .restore.writes import ObjectWriter
from .storage.manager import StorageManager
from .server import make_pool
from .storage.pool_protocol import Pool, PoolFactory
from .throttled_warning import RepeatingWarning
from .transfer.cuda import route_tuning

logger = logging.getLogger(__name__)
RETIREMENT_MASK = 1  # the group mask of a retirement marker (it has no planes; only its presence counts)
RETIREMENT_PAYLOAD_BYTES = 8


def _stores_nothing_reason(config: Config, pool: Pool, slot_bytes: int) -> Optional[str]:
    """Why ``store`` can only return 0, or None: every chunk goes through the CPU pool (the
    cache itself, or the buffer of the disk and remote tiers), so a pool of no slot keeps nothing."""
    if config.server_url or pool.num_slots > 0:
        return None
    if not config.local_cpu and not config.has_lower_tier:
        return "local_cpu (LMCACHE_LOCAL_CPU) is false and there is no disk or remote tier: nothing is kept anywhere"
    return (f"the CPU pool (max_local_cpu_size, LMCACHE_MAX_LOCAL_CPU_SIZE = {config.max_local_cpu_size:g} GB) holds 0 "
            f"chunks: it is smaller than one chunk of this layout ({slot_bytes / (1 << 30):.4g} GB)")


class KVCacheEngine:
    def __init__(self, layout: KVLayout, config: Optional[Config] = None, *, backend: Optional[str] = None,
                 window_parts: bool = True, shared_writer: bool = True, pool_factory: PoolFactory = make_pool) -> None:
        """``window_parts=False`` stores every group's rows in one object per chunk (engines
        that hand over pages under their own keys: ``store_chunks``), as does a restore interval
        of 0; by default a layout with window groups stores them only at restore points
        (kvconnect/restore/).

        ``shared_writer=False`` makes a *replica*: one of several engines (TP ranks) whose
        layouts hold the same KV under the same fingerprint, of which another writes the
        shared places. A replica reads every tier but writes only its private CPU pool: it
        queues nothing for the disk or remote tiers and, over the node server's shared pool or
        with ``local_cpu`` off (the pool only a buffer for the tiers), stores nothing (``store``
        returns 0). Every rank then reads the writer's one copy.

        ``pool_factory`` makes the CPU pool once the slot size is known; the default,
        ``kvconnect.server.make_pool``, gives the node cache server's shared pool when
        ``config.server_url`` (``KVCONNECT_SERVER_URL``) is set and a private pool otherwise:
        a URL in the configuration is enough.
        """
        config = config or Config.from_env()
        self.layout = layout = _named(layout, config.model_name)
        if not config.chunk_size:  # unset: the layout decides, the same in every process of the model
            choice = choose_chunk_size(layout_rules(layout))
            logger.info("kvconnect: chunk_size %d (%s)", choice.tokens, choice.reason)
            config = dataclasses.replace(config, chunk_size=choice.tokens)
        self.config = config
        _check_shared_identity(layout, self.config)
        check_chunk_size(layout, self.config.chunk_size)
        split = splits_window_groups(self.config.restore_interval_tokens, window_parts=window_parts)
        # a window plane wider than a slot travels as column slices: capacity whatever the tensors' granularity
        self.layout = layout = slice_wide_planes(layout, self.config.chunk_size, split=split)
        if backend is None:  # an explicit backend wins over KVCONNECT_TRANSFER_ROUTE
            backend = dispatch.route_backend(layout, self.config.transfer_route)
        dispatch.prepare(layout, backend)  # fail now, not on the first store; the Triton route compiles here
        self.backend = backend
        self._cuda_tuning = route_tuning(self.config.cuda_transfer)
        self.keyer = ChunkKeyer(layout.fingerprint, self.config.chunk_size)
        self.parts = PartLayout.of(layout, self.config.chunk_size, split=split)
        self.max_chunk_bytes = self.parts.slot_bytes  # the largest object: a whole chunk, or a part
        pool = pool_factory(self.config, max(self.max_chunk_bytes, 1), pin_memory=_want_pinned(layout.device), fingerprint=layout.fingerprint)
        self.storage = StorageManager.from_config(pool, layout.fingerprint, self.config, writes_shared=shared_writer)
        # why this engine can keep nothing (None when it can): said once here; adapters stay off on it
        self.stores_nothing = _stores_nothing_reason(self.config, pool, self.max_chunk_bytes)
        if self.stores_nothing:
            logger.warning("kvconnect: this engine stores nothing (store returns 0, every lookup misses): %s",
                           self.stores_nothing)
        self.shared_writer = shared_writer
        self.counters = Counters()
        self.stats = self.counters.stats
        # verified restores (restore/verify.py): sampled hits are recomputed and compared at their store
        self.verifier = Verifier(layout, rate=self.config.verify_rate, first=self.config.verify_first_checks)
        self.ops = OpLog()  # store/retrieve latency and per-operation sizes
        self.metrics_instance = register_engine(self)  # Prometheus: kvconnect.metrics
        start_exporter(self.config)  # opt-in (KVCONNECT_METRICS_PORT), once per process
        # CPU kernel threads per direction; an adapter may set them from where the engine computes
        # (kvconnect.transfer.placement): a store runs beside the engine, a load blocks its step
        self.store_threads = self.config.num_threads
        self.load_threads = self.config.num_threads
        self.events: Optional[ChunkEventLog] = None  # enable_events(): chunk events for KV-aware routers
        self._all_absent = RepeatingWarning(logger.warning)  # stores handed only -1 block ids (store())
        writer = ObjectWriter(layout, self.storage, self.gather_to_pool)
        if self.verifier.enabled:
            writer.check = RowCheck(layout, self.storage, self.verifier, self.gather_into,
                                    pin_memory=_want_pinned(layout.device))
        loader = ChunkLoader(layout, self.storage, self.scatter_from_pool, self.counters, self.ops)
        self.restore: RestoreScheme = (
            WindowParts(layout, self.parts, self.storage, writer, loader, self.counters, self.ops,
                        interval_tokens=self.config.restore_interval_tokens, step_end_parts=self.config.step_end_window_parts)
            if self.parts.split else WholeChunks(layout, self.parts, self.storage, writer, loader, self.counters, self.ops))
        # head-sharded or range-split KV that ranks of another TP size wrote, read on a miss
        # (restore/other_tp_reads.py): whole chunks, or prefix and window parts at restore points
        self.other_tp = OtherTPReader.of(layout, self.config, self.storage, self.parts, pool_factory)

    @property
    def pool(self) -> Pool:
        return self.storage.pool

    def stats_snapshot(self) -> dict[str, int]:
        """A consistent copy of ``stats`` (kvconnect.metrics reads it)."""
        return self.counters.snapshot()

    @property
    def generation(self) -> bytes:
        """This engine's key generation: empty until the first ``reset``."""
        return self.keyer.generation

    def enable_events(self, log: Optional[ChunkEventLog] = None) -> ChunkEventLog:
        """Record chunks stored in and removed from every tier (kvconnect.events); idempotent."""
        if self.events is None:
            self.events = log or ChunkEventLog()
            self.restore.events = events = self.events
            # the private pool's evictions, or the node server's of this layout; window pieces are no chunks
            window_only = self.parts.window_mask if self.parts.prefix_mask else 0
            self.pool.on_evict.append(lambda entry: None if window_only and not entry.header.group_mask & ~window_only
                                      else events.removed("cpu", [bytes(entry.key)]))
            for writer in self.storage.writers:
                name = writer.tier.name
                writer.on_written.append(lambda keys, name=name: events.stored_keys(name, [bytes(k) for k in keys]))
                writer.on_deleted.append(lambda keys, name=name: events.removed(name, [bytes(k) for k in keys]))
        return self.events

    # -- reset -----------------------------------------------------------------------
    def reset(self, generation: Optional[bytes] = None, *, retire: Optional[bytes] = None) -> None:
        """Never serve a chunk stored before this call (an engine's weights changed, or its
        operator asked for a clean cache); chunks stored after it are served as usual.

        The key chain moves to a new random generation (kvconnect/chunks/keys.py), which no stored chunk of
        any tier carries: the pool, the disk, Redis, Mooncake, the node server and any other
        LowerTier, shared or not, hold only misses for this engine from now on, with no call
        to them. Nothing is deleted from tiers other engines may read (the node server's
        pool, disk directories, remote stores): an engine on the old weights keeps its hits,
        and the old chunks age out by eviction. A private CPU pool is emptied to free its
        memory at once. A restart begins with no generation again: the chunks of the
        checkpoint's weights (stored before any reset, by this or an earlier process) hit,
        those of a reset generation never again.

        Not synchronised with a store or retrieve running on another thread: a store that
        computed its keys before the call lands under the old generation (never read again),
        a lookup racing the call may offer a hit the retrieve then misses (reported short).
        Adapters order it after their pending saves (the vLLM worker does).

        ``generation``: the new generation (``GENERATION_BYTES`` bytes), when the caller chose
        it (the vLLM scheduler does, so that every TP rank moves to the same one and a P/D
        decode server can be told it; TP ranks whose KV is replicated, ``shared_writer``, keep
        reading the writer's chunks); a fresh random one by default.

        ``retire``: a generation to mark as left behind in every tier (a P/D producer's
        scheduler names the one its saves used): a small marker chunk under
        ``ChunkKeyer.retirement_key``, which a decode server reads (``generation_retired``)
        to refuse replayed params naming that generation, however long ago, and after its own
        restart. The marker is written like any chunk (write-behind to the lower tiers).
        """
        generation = new_generation() if generation is None else generation_bytes(generation)
        if not generation:
            raise TokenError("a reset needs a new, non-empty key generation")
        self.keyer = ChunkKeyer(self.layout.fingerprint, self.config.chunk_size, generation=generation)
        if self.events is not None:
            self.events.cleared()
        if not self.pool.shared:  # a shared pool keeps other engines' hits
            self.pool.clear()
        if retire is not None:
            self._mark_retired(generation_bytes(retire))
        logger.info("kvconnect: reset: chunks stored before now are no longer served by this engine")

    def _mark_retired(self, generation: bytes) -> None:
        """Store the retirement marker of ``generation`` (8 zero bytes) in the pool and, written
        behind, every lower tier; a full pool or a failing tier leaves it out (logged)."""
        key = ChunkKeyer(self.layout.fingerprint, self.config.chunk_size, generation=generation).retirement_key()
        slots = self.storage.reserve(1)
        if not slots:
            logger.warning("kvconnect: reset: no pool slot for the marker of the retired key generation; "
                           "P/D params naming it are refused only by decode servers that saw the pair move on")
            return
        # a few payload bytes, not none: no tier meets an empty value (Mooncake refuses 0-byte objects)
        self.pool.slot_view(slots[0])[:RETIREMENT_PAYLOAD_BYTES] = 0
        header = ChunkHeader(fingerprint=self.layout.fingerprint, key=key, token_start=0, token_end=0,
                             group_mask=RETIREMENT_MASK, plane_rows=(), payload_bytes=RETIREMENT_PAYLOAD_BYTES)
        self.storage.commit(key, header, slots[0])

    def generation_retired(self, generation: bytes) -> bool:
        """Whether some engine's reset left ``generation`` behind (its marker is in a tier)."""
        key = ChunkKeyer(self.layout.fingerprint, self.config.chunk_size, generation=generation_bytes(generation)).retirement_key()
        return self.storage.masks([key])[0] is not None

    def tp_read_refusal(self, tp_size: int) -> Optional[str]:
        """Why this rank cannot restore chunks that ranks of TP size ``tp_size`` stored (named
        before anything is looked up), or None (restore/other_tp_reads.py, ``read_refusal``)."""
        return read_refusal(self.layout, self.config, self.other_tp, tp_size)

    # -- keys ------------------------------------------------------------------------
    def chunks(self, tokens: Tokens, *, include_partial: bool, namespace: Namespace = None,
               generation: Optional[bytes] = None, media: Sequence[MediaItem] = ()) -> list[Chunk]:
        """The chunks of a token sequence with their keys."""
        return self._chunks(tokens_as_int64(tokens), include_partial, namespace, generation, media)

    def _keyer_of(self, generation: Optional[bytes]) -> ChunkKeyer:
        """The keyer of ``generation`` (None: this engine's own). Another engine's generation is
        read, never adopted: a P/D decode server loads under its producer's (vLLM adapter)."""
        keyer = self.keyer
        if generation is None or bytes(generation) == keyer.generation:
            return keyer
        return ChunkKeyer(self.layout.fingerprint, self.config.chunk_size, generation=generation_bytes(generation))

    def _chunks(self, tok: np.ndarray, include_partial: bool, namespace: Namespace,
                generation: Optional[bytes] = None, media: Sequence[MediaItem] = ()) -> list[Chunk]:
        """``media``: the prompt's multimodal items (kvconnect/chunks/extra_keys.py): the chunks
        that cover part of one are keyed by it too."""
        bounds = chunk_bounds(len(tok), self.config.chunk_size, include_partial)
        extras = media_extras(media_items(media), bounds) if media else None
        keys = self._keyer_of(generation).keys(tok, bounds, namespace, extras)
        if extras is None:
            return [Chunk(i, s, e, k) for i, ((s, e), k) in enumerate(zip(bounds, keys))]
        return [Chunk(i, s, e, k, x) for i, ((s, e), k, x) in enumerate(zip(bounds, keys, extras))]

    def _masked_prefix(self, mask, num_tokens: int, *, chunk_aligned: bool = True) -> int:
        if mask is None:
            return 0
        m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
        if m.dtype != np.bool_ or m.ndim != 1 or len(m) != num_tokens:
            raise TokenError(f"mask must be a 1-D bool array of {num_tokens} tokens, got {m.dtype} {m.shape}")
        skip = int(np.argmax(m)) if m.any() else num_tokens
        if not m[skip:].all():
            raise TokenError("mask must be a run of False followed by True only")
        if chunk_aligned and skip % self.config.chunk_size and skip != num_tokens:
            raise TokenError(f"the mask's False prefix ({skip} tokens) must be a multiple of the chunk size {self.config.chunk_size}")
        return skip

    # -- store -----------------------------------------------------------------------
    def store(self, tokens: Tokens, block_ids, mask=None, *, namespace: Namespace = None,
              generation: Optional[bytes] = None, step_end: bool = False, continues: bool = False,
              then: Optional[Tokens] = None, media: Sequence[MediaItem] = ()) -> int:
        """Store the KV rows of ``tokens`` held in the blocks ``block_ids`` (one list per group).

        Returns the number of tokens (beyond the mask) whose chunks are stored after the call.
        A one-group layout also takes one flat list of block ids. Block ids that are all -1
        (absent) write nothing, and a WARNING (at once, then at most once a minute) says so.
        With window groups (kvconnect/restore/parts.py), their rows are stored only at the restore points of
        this store: its end, where it leaves an already stored prefix, and every
        ``restore_interval_tokens``. ``generation``: the key generation to store under (None:
        this engine's; kvconnect/chunks/keys.py). ``step_end``: ``tokens`` end at an engine's
        prefill step end, not where a request resumes (no restore point there, or a short-lived
        one with ``step_end_window_parts``); ``continues``: the mask is this request's own
        previous step-end store, so its end is no branch point (kvconnect/restore/points.py);
        ``then``: at a step end, the prompt tokens the engine computes next (a chunk of them
        tells whether the request walks on along a stored prefix or leaves it here).
        ``media``: the prompt's multimodal items (placeholder ranges and hashes): the chunks
        covering part of one are keyed by it (kvconnect/chunks/extra_keys.py).
        """
        start_s = time.perf_counter()
        tok = tokens_as_int64(tokens)
        skip = self._masked_prefix(mask, len(tok))
        tables = BlockTables.of(self.layout, block_ids)
        if not self.shared_writer and (self.pool.shared or not self.config.local_cpu):
            # a replica with no pool of its own to keep: the writer's store lands for it
            self.counters.add(replica_stores_left=1)
            return 0
        next_chunk = None
        if step_end and then is not None and len(tok) % self.config.chunk_size == 0:
            ahead = tokens_as_int64(then)[: self.config.chunk_size]
            every = self._chunks(np.concatenate([tok, ahead]), False, namespace, generation, media)
            if len(every) * self.config.chunk_size > len(tok):
                next_chunk = every.pop()
        else:
            every = self._chunks(tok, self.config.save_unfull_chunk, namespace, generation, media)
        chunks = [c for c in every if c.start >= skip]
        stored = self.restore.store(every, chunks, tables, start_s, (tok, every), step_end=step_end, continues=continues,
                                    next_chunk=next_chunk)
        if chunks and tables.all_absent:
            self._all_absent.failed("kvconnect: store of %d tokens got block ids that are all -1 (absent) in every "
                                    "group: nothing written (%d tokens were stored before); pass the ids of the blocks "
                                    "that hold their KV", len(tok), stored)
        return stored

    def store_chunks(self, chunks: list[Chunk], block_ids) -> int:
        """Store chunks whose keys the caller computed (e.g. ``kvconnect.chunks.page_keys``).

        ``chunks`` tile a token range that ``block_ids`` (one list per group) covers from
        token 0; returns the tokens of ``chunks`` stored after the call. Each chunk is one
        object with every group's rows: the engine must be made with ``window_parts=False``
        when the layout has window groups.
        """
        self.restore.check_caller_keys("store_chunks")
        return self.restore.store_chunks(list(chunks), BlockTables.of(self.layout, block_ids), time.perf_counter())

    # -- lookup ----------------------------------------------------------------------
    def lookup(self, tokens: Tokens, *, namespace: Namespace = None, generation: Optional[bytes] = None,
               media: Sequence[MediaItem] = (), verify: bool = False) -> int:
        """Tokens restorable from token 0: the largest chunk end at which every group can resume
        (with window groups: the largest restore point whose prefix and window parts are present).

        The pool's objects of the hit become its most recently used, so that the stores running
        between an engine's lookup and its retrieve evict other chunks first (a hit is still
        not a promise: ``retrieve`` returns what it loaded). ``generation``: the key generation
        to look under (None: this engine's; kvconnect/chunks/keys.py). ``media``: as in ``store``.
        ``verify``: the caller can serve no hit and have the engine compute the prefix; a hit the
        verifier samples (``KVCONNECT_VERIFY_RATE``, restore/verify.py) is then 0, and the store of
        the recomputed prefix compares its rows with the stored ones. After a mismatch (the layout
        fingerprint retired) every lookup is 0.
        """
        if self.verifier.retired:
            return 0
        tok = tokens_as_int64(tokens)
        chunks = self._chunks(tok, include_partial=True, namespace=namespace, generation=generation, media=media)
        hit = self.restore.lookup(chunks, self._other_tp_fill(tok, namespace, generation))
        if verify and hit and self.verifier.sample(chunks, hit):
            return 0
        return hit

    def lookup_chunks(self, chunks: list[Chunk]) -> int:
        """``lookup`` over chunks whose keys the caller computed: the restorable chunk end."""
        self.restore.check_caller_keys("lookup_chunks")
        return self.restore.lookup_chunks(chunks)

    # -- retrieve --------------------------------------------------------------------
    def retrieve(self, tokens: Tokens, block_ids, mask=None, *, namespace: Namespace = None,
                 generation: Optional[bytes] = None, media: Sequence[MediaItem] = ()) -> int:
        """Load the rows needed to resume at the restorable boundary P into ``block_ids``.

        Returns P minus the masked prefix (0 on a miss). Raises BlockTableError, before
        anything is written, when a needed row has no valid block. After a verification
        mismatch (restore/verify.py) it loads nothing.
        """
        if self.verifier.retired:
            return 0
        start_s = time.perf_counter()
        tok = tokens_as_int64(tokens)
        skip = self._masked_prefix(mask, len(tok), chunk_aligned=False)
        tables = BlockTables.of(self.layout, block_ids)
        chunks = self._chunks(tok, include_partial=True, namespace=namespace, generation=generation, media=media)
        return self.restore.retrieve(chunks, tables, skip, start_s, self._other_tp_fill(tok, namespace, generation))

    def _other_tp_fill(self, tok: np.ndarray, namespace: Namespace, generation: Optional[bytes]) -> Optional[ShortHitFill]:
        """What the restore scheme asks when this rank's own objects fall short: the chunks ranks of
        another TP size wrote, into the pool (None: no such reader)."""
        reader = self.other_tp
        if reader is None:
            return None
        salt = self._keyer_of(generation).generation

        def fill(chunks: list[Chunk], own: OwnObjects) -> int:
            try:
                return reader.fill(tok, chunks, namespace, salt, own)
            except Exception:  # a read across TP sizes is a best effort: a failure is a miss, never the engine's
                logger.exception("kvconnect: reading another TP size's chunks failed; treating it as a miss")
                return 0

        return fill

    def retrieve_chunks(self, chunks: list[Chunk], block_ids, *, present_tokens: int = 0) -> int:
        """``retrieve`` over chunks whose keys the caller computed; tokens loaded beyond ``present_tokens``."""
        self.restore.check_caller_keys("retrieve_chunks")
        return self.restore.retrieve_chunks(list(chunks), BlockTables.of(self.layout, block_ids), present_tokens,
                                            time.perf_counter())

    # -- pool transfers (also PageStore's) --------------------------------------------
    def gather_to_pool(self, tables) -> None:
        """Planes -> pool slots, on the store's threads and route."""
        self.gather_into(tables, self.pool.buffer)

    def gather_into(self, tables, buffer: torch.Tensor) -> None:
        """Planes -> ``buffer`` (a verification's scratch), on the store's threads and route."""
        dispatch.gather(self.layout, tables, buffer, backend=self.backend, num_threads=self.store_threads,
                        cuda_tuning=self._cuda_tuning)

    def scatter_from_pool(self, tables) -> None:
        """Pool slots -> planes, on the load's threads and route."""
        dispatch.scatter(self.layout, tables, self.pool.buffer, backend=self.backend, num_threads=self.load_threads,
                         cuda_tuning=self._cuda_tuning)

    def close(self) -> None:
        """Flush queued lower-tier writes, stop their threads, close the tiers, empty the pool."""
        unregister(self.metrics_instance)
        if self.other_tp is not None:
            self.other_tp.close()
        self.storage.close()
        self.pool.close()  # a private pool is emptied; a shared one keeps the other engines' entries


def _named(layout: KVLayout, model_name: str) -> KVLayout:
    """``layout`` with the configured model name (KVCONNECT_MODEL_NAME) folded into its
    fingerprint, so chunks of a base model and its fine-tune never meet: as the layout's model
    name when it has none (the adapters' fingerprint), else as one more identity string."""
    if not model_name or model_name == layout.model_name:
        return layout
    if not layout.model_name:
        return layout.with_identity(model_name=model_name)
    return layout.with_identity(identity={"config_model_name": model_name})


def _check_shared_identity(layout: KVLayout, config: Config) -> None:
    """A shared tier holds the KV of every engine that names it: two unnamed models of equal
    shapes would read each other's chunks (wrong bytes, never a miss), so an engine without a
    model identity does not start on one. The adapters always name their model."""
    if layout.model_name:
        return
    shared = [f"{name} ({variable})" for name, variable, value in (
        ("remote_url", "LMCACHE_REMOTE_URL", config.remote_url), ("server_url", "KVCONNECT_SERVER_URL", config.server_url))
        if value]
    if shared:
        raise ConfigError(
            f"{' and '.join(shared)} is a tier shared with other engines, and this engine has no model identity: "
            "set model_name (KVCONNECT_MODEL_NAME) to the model's name and revision, e.g. "
            "'meta-llama/Llama-3.1-8B@main', or pass model_name= to KVLayout.from_tensors; without it two "
            "models of the same shapes would serve each other's KV")


def _want_pinned(device: torch.device) -> bool:
    if device.type == "cpu":
        return False
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        logger.warning("kvconnect: pinned host memory unavailable; the CPU pool is pageable")
        return False
