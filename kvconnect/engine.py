"""KVCacheEngine: the Python API every engine adapter calls.

    engine = KVCacheEngine(layout, Config.from_env())
    engine.store(tokens, block_ids, mask=None)     -> tokens now stored (chunks present)
    engine.lookup(tokens)                          -> P, tokens restorable from token 0
    engine.retrieve(tokens, block_ids, mask=None)  -> tokens loaded into the paged memory

Each also takes ``namespace=`` (str or bytes): what besides token ids decides the KV, e.g. a
LoRA adapter or a tenant's salt. Chunks stored under one namespace are misses under another
(see keys.py); no namespace is the empty one.

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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import metrics, transfer
from .events import ChunkEventLog
from .chunk_format import ChunkHeader
from .config import Config
from .errors import CorruptChunkError, TokenError
from .keys import ChunkKeyer, Namespace, Tokens, tokens_as_int64
from .layout import KVLayout
from .plan import (
    BlockTables,
    Chunk,
    check_chunk_size,
    max_chunk_payload_bytes,
    plan_store,
    restorable_boundary,
    retrieve_segments,
    store_segments,
)
from .rows import chunk_bounds
from .server import close_pool, make_pool
from .storage import ChunkPool, StorageManager
from .transfer.cuda import route_tuning

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    stored_chunks: int = 0
    stored_bytes: int = 0
    skipped_chunks: int = 0  # already stored, or no room in the pool
    retrieved_chunks: int = 0
    retrieved_bytes: int = 0
    retrieved_tokens: int = 0
    lookups: int = 0
    lookup_requested_tokens: int = 0
    lookup_hit_tokens: int = 0
    corrupt_chunks: int = 0


class KVCacheEngine:
    def __init__(self, layout: KVLayout, config: Optional[Config] = None, *, backend: Optional[str] = None) -> None:
        self.config = config or Config.from_env()
        self.layout = layout = _named(layout, self.config.model_name)
        check_chunk_size(layout, self.config.chunk_size)
        if backend is None:  # an explicit backend wins over KVCONNECT_TRANSFER_ROUTE
            backend = transfer.route_backend(layout, self.config.transfer_route)
        transfer.prepare(layout, backend)  # fail now, not on the first store; the Triton route compiles here
        self.backend = backend
        self._cuda_tuning = route_tuning(self.config.cuda_transfer)
        self.keyer = ChunkKeyer(layout.fingerprint, self.config.chunk_size)
        self.max_chunk_bytes = max_chunk_payload_bytes(layout, self.config.chunk_size)
        # a private ChunkPool, or the node cache server's shared pool when server_url is set
        pool = make_pool(self.config, max(self.max_chunk_bytes, 1), pin_memory=_want_pinned(layout.device), fingerprint=layout.fingerprint)
        self.storage = StorageManager.from_config(pool, layout.fingerprint, self.config)
        self.stats = EngineStats()
        self._stats_lock = threading.Lock()
        self.ops = metrics.OpLog()  # store/retrieve latency and per-operation sizes
        self.metrics_instance = metrics.register_engine(self)  # Prometheus: kvconnect.metrics
        metrics.start_exporter(self.config)  # opt-in (KVCONNECT_METRICS_PORT), once per process
        # CPU kernel threads per direction; an adapter may set them from where the engine computes
        # (kvconnect.transfer.placement): a store runs beside the engine, a load blocks its step
        self.store_threads = self.config.num_threads
        self.load_threads = self.config.num_threads
        self.events: Optional[ChunkEventLog] = None  # enable_events(): chunk events for KV-aware routers

    @property
    def pool(self) -> ChunkPool:
        return self.storage.pool

    def stats_snapshot(self) -> dict[str, int]:
        """A consistent copy of ``stats`` (kvconnect.metrics reads it)."""
        with self._stats_lock:
            return dict(vars(self.stats))

    @property
    def generation(self) -> bytes:
        """This engine's key generation: empty until the first ``reset``."""
        return self.keyer.generation

    def enable_events(self, log: Optional[ChunkEventLog] = None) -> ChunkEventLog:
        """Record chunks stored in and removed from every tier (kvconnect.events); idempotent."""
        if self.events is None:
            self.events = log or ChunkEventLog()
            events = self.events
            if hasattr(self.pool, "on_evict"):  # the private pool, or the node server's evictions of this layout
                self.pool.on_evict.append(lambda entry: events.removed("cpu", [bytes(entry.key)]))
            for writer in self.storage.writers:
                name = writer.tier.name
                writer.on_written.append(lambda keys, name=name: events.stored_keys(name, [bytes(k) for k in keys]))
                writer.on_deleted.append(lambda keys, name=name: events.removed(name, [bytes(k) for k in keys]))
        return self.events

    # -- reset -----------------------------------------------------------------------
    def reset(self) -> None:
        """Never serve a chunk stored before this call (an engine's weights changed, or its
        operator asked for a clean cache); chunks stored after it are served as usual.

        The key chain moves to a new random generation (keys.py), which no stored chunk of
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
        """
        self.keyer = ChunkKeyer(self.layout.fingerprint, self.config.chunk_size, generation=os.urandom(16))
        if self.events is not None:
            self.events.cleared()
        if isinstance(self.pool, ChunkPool):  # private to this engine; a shared pool keeps other engines' hits
            self.pool.clear()
        logger.info("kvconnect: reset: chunks stored before now are no longer served by this engine")

    # -- keys ------------------------------------------------------------------------
    def chunks(self, tokens: Tokens, *, include_partial: bool, namespace: Namespace = None) -> list[Chunk]:
        """The chunks of a token sequence with their keys."""
        return self._chunks(tokens_as_int64(tokens), include_partial, namespace)

    def _chunks(self, tok: np.ndarray, include_partial: bool, namespace: Namespace) -> list[Chunk]:
        bounds = chunk_bounds(len(tok), self.config.chunk_size, include_partial)
        keys = self.keyer.keys(tok, bounds, namespace)
        return [Chunk(i, s, e, k) for i, ((s, e), k) in enumerate(zip(bounds, keys))]

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
    def store(self, tokens: Tokens, block_ids, mask=None, *, namespace: Namespace = None) -> int:
        """Store the KV rows of ``tokens`` held in the blocks ``block_ids`` (one list per group).

        Returns the number of tokens (beyond the mask) whose chunks are stored after the call.
        """
        start_s = time.perf_counter()
        tok = tokens_as_int64(tokens)
        skip = self._masked_prefix(mask, len(tok))
        tables = BlockTables.of(self.layout, block_ids)
        every = self._chunks(tok, self.config.save_unfull_chunk, namespace)
        chunks = [c for c in every if c.start >= skip]
        return self._store_chunks(chunks, tables, start_s, (tok, every))

    def store_chunks(self, chunks: list[Chunk], block_ids) -> int:
        """Store chunks whose keys the caller computed (e.g. ``kvconnect.page_keys``).

        ``chunks`` tile a token range that ``block_ids`` (one list per group) covers from
        token 0; returns the tokens of ``chunks`` stored after the call.
        """
        return self._store_chunks(list(chunks), BlockTables.of(self.layout, block_ids), time.perf_counter())

    def _store_chunks(self, chunks: list[Chunk], tables: BlockTables, start_s: float, prompt=None) -> int:
        """``prompt``: (tokens, every chunk of them) when known, for the chunk events."""
        plans = [p for p in plan_store(self.layout, chunks, tables) if p.group_mask]
        existing = self.storage.masks([p.chunk.key for p in plans])
        # rewrite a stored chunk only when the new one holds strictly more groups: a re-store
        # with fewer groups (window blocks already freed) must not shrink a good entry
        todo = [p for p, m in zip(plans, existing) if m is None or (m != p.group_mask and (m & p.group_mask) == m)]
        done_tokens = sum(p.chunk.end - p.chunk.start for p, m in zip(plans, existing) if m is not None and (m | p.group_mask) == m)
        # pin the chunks of this prompt already in the pool while making room: eviction must
        # not drop the prompt's own prefix to store its suffix (a pin, not a use)
        held = self.pool.acquire([p.chunk.key for p, m in zip(plans, existing) if m is not None], touch=False) if todo else []
        try:
            slots = self.storage.reserve(len(todo))
        finally:
            self.pool.release(held)
        writes = todo[: len(slots)]
        if writes:
            builder = store_segments(self.layout, writes, [self.pool.slot_offset(s) for s in slots])
            try:
                self.gather_to_pool(builder.build())
            except BaseException:
                self.storage.abort(slots)
                raise
            for plan, slot in zip(writes, slots):
                header = ChunkHeader(
                    fingerprint=self.layout.fingerprint, key=plan.chunk.key, token_start=plan.chunk.start,
                    token_end=plan.chunk.end, group_mask=plan.group_mask, plane_rows=plan.plane_rows,
                    payload_bytes=plan.payload_bytes,
                )
                self.storage.commit(plan.chunk.key, header, slot)
            if self.events is not None:
                self.events.stored("cpu", [_identity(p.chunk, prompt) for p in writes])
        with self._stats_lock:
            self.stats.stored_chunks += len(writes)
            self.stats.stored_bytes += sum(p.payload_bytes for p in writes)
            self.stats.skipped_chunks += len(plans) - len(writes)
        self.ops.stored(len(writes), sum(p.payload_bytes for p in writes), time.perf_counter() - start_s)
        return done_tokens + sum(p.chunk.end - p.chunk.start for p in writes)

    # -- lookup ----------------------------------------------------------------------
    def lookup(self, tokens: Tokens, *, namespace: Namespace = None) -> int:
        """Tokens restorable from token 0: the largest chunk end at which every group can resume.

        The pool's chunks of the hit become its most recently used, so that the stores running
        between an engine's lookup and its retrieve evict other chunks first (a hit is still
        not a promise: ``retrieve`` returns what it loaded).
        """
        return self.lookup_chunks(self._chunks(tokens_as_int64(tokens), include_partial=True, namespace=namespace))

    def lookup_chunks(self, chunks: list[Chunk]) -> int:
        """``lookup`` over chunks whose keys the caller computed: the restorable chunk end."""
        hit = restorable_boundary(self.layout, chunks, self.storage.masks([c.key for c in chunks]))
        if hit:
            self.pool.release(self.pool.acquire([c.key for c in chunks if c.end <= hit]))  # acquire touches
        with self._stats_lock:
            self.stats.lookups += 1
            self.stats.lookup_requested_tokens += chunks[-1].end if chunks else 0
            self.stats.lookup_hit_tokens += hit
        return hit

    # -- retrieve --------------------------------------------------------------------
    def retrieve(self, tokens: Tokens, block_ids, mask=None, *, namespace: Namespace = None) -> int:
        """Load the rows needed to resume at the restorable boundary P into ``block_ids``.

        Returns P minus the masked prefix (0 on a miss). Raises BlockTableError, before
        anything is written, when a needed row has no valid block.
        """
        start_s = time.perf_counter()
        tok = tokens_as_int64(tokens)
        skip = self._masked_prefix(mask, len(tok), chunk_aligned=False)
        tables = BlockTables.of(self.layout, block_ids)
        return self._retrieve_chunks(self._chunks(tok, include_partial=True, namespace=namespace), tables, skip, start_s)

    def retrieve_chunks(self, chunks: list[Chunk], block_ids, *, present_tokens: int = 0) -> int:
        """``retrieve`` over chunks whose keys the caller computed; tokens loaded beyond ``present_tokens``."""
        return self._retrieve_chunks(list(chunks), BlockTables.of(self.layout, block_ids), present_tokens, time.perf_counter())

    def _retrieve_chunks(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float) -> int:
        # chunks below the mask are already in the engine: never fetch them from a tier
        wanted = [c for c in chunks if c.end > skip]
        entries = [None] * (len(chunks) - len(wanted)) + list(self.storage.acquire([c.key for c in wanted]))
        try:
            masks = [e.header.group_mask if e is not None else None for e in entries]
            boundary = restorable_boundary(self.layout, chunks, masks, present_below=skip)
            if boundary <= skip:
                return 0
            load = [c for c in chunks if c.end > skip and c.end <= boundary]
            used = [entries[c.index] for c in load]
            try:
                builder = retrieve_segments(
                    self.layout, load, [e.header if e is not None else None for e in used],
                    [self.pool.slot_offset(e.slot) if e is not None else 0 for e in used], boundary, tables,
                    present_tokens=skip,
                )
            except CorruptChunkError as exc:
                logger.warning("kvconnect: dropping an inconsistent chunk; reporting a miss: %s", exc)
                index = getattr(exc, "chunk_index", None)  # set by plan: drop only that chunk
                for e in [entries[index]] if index is not None else used:
                    if e is not None:
                        self.storage.drop(e.key)
                with self._stats_lock:
                    self.stats.corrupt_chunks += 1
                return 0
            tables_built = builder.build()
            self.scatter_from_pool(tables_built)
            nbytes = tables_built.payload_bytes(self.layout)
            with self._stats_lock:
                self.stats.retrieved_chunks += sum(e is not None for e in used)
                self.stats.retrieved_bytes += nbytes
                self.stats.retrieved_tokens += boundary - skip
            self.ops.retrieved(sum(e is not None for e in used), nbytes, time.perf_counter() - start_s)
            return boundary - skip
        finally:
            self.storage.release(entries)

    # -- pool transfers (also PageStore's) --------------------------------------------
    def gather_to_pool(self, tables) -> None:
        """Planes -> pool slots, on the store's threads and route."""
        transfer.gather(self.layout, tables, self.pool.buffer, backend=self.backend, num_threads=self.store_threads,
                        cuda_tuning=self._cuda_tuning)

    def scatter_from_pool(self, tables) -> None:
        """Pool slots -> planes, on the load's threads and route."""
        transfer.scatter(self.layout, tables, self.pool.buffer, backend=self.backend, num_threads=self.load_threads,
                         cuda_tuning=self._cuda_tuning)

    def close(self) -> None:
        """Flush queued lower-tier writes, stop their threads, close the tiers, empty the pool."""
        metrics.unregister(self.metrics_instance)
        self.storage.close()
        close_pool(self.pool)


def _named(layout: KVLayout, model_name: str) -> KVLayout:
    """``layout`` with the configured model name (KVCONNECT_MODEL_NAME) folded into its
    fingerprint, so chunks of a base model and its fine-tune never meet: as the layout's model
    name when it has none (the adapters' fingerprint), else as one more identity string."""
    if not model_name or model_name == layout.model_name:
        return layout
    if not layout.model_name:
        return layout.with_identity(model_name=model_name)
    return layout.with_identity(identity={"config_model_name": model_name})


def _identity(chunk: Chunk, prompt) -> tuple[bytes, Optional[bytes], np.ndarray]:
    """(key, parent key, token ids) of a stored chunk for its event; no tokens when unknown."""
    if prompt is None:
        return bytes(chunk.key), None, np.zeros(0, np.int64)
    tokens, every = prompt
    parent = bytes(every[chunk.index - 1].key) if chunk.index > 0 else None
    return bytes(chunk.key), parent, tokens[chunk.start : chunk.end]


def _want_pinned(device: torch.device) -> bool:
    if device.type == "cpu":
        return False
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        logger.warning("kvconnect: pinned host memory unavailable; the CPU pool is pageable")
        return False
