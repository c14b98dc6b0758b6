"""The store path of KVCacheEngine (engine.py): store plans -> one gather into pool slots -> headers committed.

Whole chunks (``_store_chunks``: one object per chunk, every group's rows) or, with window
groups split into parts (parts.py), the prefix parts of the stored chunks and the window
parts of this store's restore points (``_store_parts``). Both write through
``_write_objects``, which never shrinks a stored object to fewer groups and pins the
prompt's own objects while the pool makes room.

``StorePath`` is a mixin of KVCacheEngine: its methods use the engine's ``layout``,
``config``, ``parts``, ``storage``, ``pool``, ``events``, ``stats`` (under ``_stats_lock``),
``ops``, ``_piece_planes`` and ``gather_to_pool``.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..chunks.chunk_format import ChunkHeader
from .parts import restore_points, window_chunks, window_key
from .plan import BlockTables, Chunk, plan_store, store_segments


class StorePath:
    def _store_chunks(self, chunks: list[Chunk], tables: BlockTables, start_s: float, prompt=None) -> int:
        """``prompt``: (tokens, every chunk of them) when known, for the chunk events."""
        plans = [p for p in plan_store(self.layout, chunks, tables) if p.group_mask]
        existing = self.storage.masks([p.chunk.key for p in plans])
        done_tokens = sum(p.chunk.end - p.chunk.start for p, m in zip(plans, existing) if m is not None and (m | p.group_mask) == m)
        writes = self._write_objects([(p, p.chunk.key) for p in plans], existing)
        if self.events is not None and writes:
            self.events.stored("cpu", [_identity(p.chunk, prompt) for p, _ in writes])
        with self._stats_lock:
            self.stats.stored_chunks += len(writes)
            self.stats.stored_bytes += sum(p.payload_bytes for p, _ in writes)
            self.stats.skipped_chunks += len(plans) - len(writes)
        self.ops.stored(len(writes), sum(p.payload_bytes for p, _ in writes), time.perf_counter() - start_s)
        return done_tokens + sum(p.chunk.end - p.chunk.start for p, _ in writes)

    def _write_objects(self, objects: list, existing: list) -> list:
        """Gather and commit ``(plan, key)`` objects into the pool, in order, skipping those stored
        with a superset of their groups; returns those written (a prefix of what was to write
        when the pool had too few free slots)."""
        # rewrite a stored object only when the new one holds strictly more groups: a re-store
        # with fewer groups (window blocks already freed) must not shrink a good entry
        todo = [(p, k) for (p, k), m in zip(objects, existing) if m is None or (m != p.group_mask and (m & p.group_mask) == m)]
        # pin the objects of this prompt already in the pool while making room: eviction must
        # not drop the prompt's own prefix to store its suffix (a pin, not a use)
        held = self.pool.acquire([k for (_, k), m in zip(objects, existing) if m is not None], touch=False) if todo else []
        try:
            slots = self.storage.reserve(len(todo))
        finally:
            self.pool.release(held)
        writes = todo[: len(slots)]
        if len(slots) > len(writes):
            self.storage.abort(slots[len(writes):])
        if writes:
            builder = store_segments(self.layout, [p for p, _ in writes], [self.pool.slot_offset(s) for s in slots])
            try:
                self.gather_to_pool(builder.build())
            except BaseException:
                self.storage.abort(slots)
                raise
            for (plan, key), slot in zip(writes, slots):
                header = ChunkHeader(
                    fingerprint=self.layout.fingerprint, key=key, token_start=plan.chunk.start,
                    token_end=plan.chunk.end, group_mask=plan.group_mask, plane_rows=plan.plane_rows,
                    payload_bytes=plan.payload_bytes,
                )
                self.storage.commit(key, header, slot)
        return writes

    def _store_parts(self, every: list[Chunk], chunks: list[Chunk], tables: BlockTables, start_s: float, prompt) -> int:
        """Store the prefix parts of ``chunks`` and the window parts of this store's restore points."""
        parts = self.parts
        first = chunks[0].index if chunks else len(every)
        prefix_plans = plan_store(self.layout, chunks, tables, groups=parts.prefix_mask) if parts.prefix_mask else []
        prefix_existing = self.storage.masks([p.chunk.key for p in prefix_plans])
        present = [False] * len(every)
        for p, m in zip(prefix_plans, prefix_existing):
            present[p.chunk.index] = m is not None and (m & parts.prefix_mask) == parts.prefix_mask
        points = restore_points(every, first, present, self.config.restore_interval_tokens)
        window_of: dict[int, list[int]] = {}  # chunk index -> the restore points needing its window rows
        for k in points:
            for j in window_chunks(self.layout, parts.window_mask, every, k):
                window_of.setdefault(j, []).append(k)
        window_plans = []
        for j in sorted(window_of):
            for piece, sel in enumerate(self._piece_planes):
                (plan,) = plan_store(self.layout, [every[j]], tables, groups=parts.window_mask, planes=sel)
                if plan.group_mask:
                    window_plans.append((plan, window_key(every[j].key, piece)))
        window_existing = self.storage.masks([k for _, k in window_plans])
        # one order, by chunk: a pool short of slots keeps the earliest restore points whole
        prefix_objects = [((p, p.chunk.key), m) for p, m in zip(prefix_plans, prefix_existing) if p.group_mask]
        window_set = {k for _, k in window_plans}
        ordered = sorted(prefix_objects + list(zip(window_plans, window_existing)), key=lambda o: (o[0][0].chunk.index, o[0][1] in window_set))
        writes = self._write_objects([o for o, _ in ordered], [m for _, m in ordered])
        reinstate = getattr(self.pool, "reinstate", None)
        if reinstate is not None and points:  # what this store's restore points reach is worth keeping again
            last = points[-1]
            reinstate([k for (p, k), m in ordered if m is not None and p.chunk.index <= last])
        prefix_writes = [p for p, k in writes if k not in window_set]
        window_writes = [(p, k) for p, k in writes if k in window_set]
        if self.events is not None and prefix_writes:
            self.events.stored("cpu", [_identity(p.chunk, prompt) for p in prefix_writes])
        written_chunks = {p.chunk.index for p, _ in window_writes}
        with self._stats_lock:
            self.stats.stored_chunks += len(prefix_writes)
            self.stats.stored_bytes += sum(p.payload_bytes for p, _ in writes)
            self.stats.skipped_chunks += len(prefix_objects) - len(prefix_writes)
            self.stats.window_pieces_stored += len(window_writes)
            self.stats.window_bytes_stored += sum(p.payload_bytes for p, _ in window_writes)
            self.stats.window_parts_stored += sum(1 for k in points if any(j in written_chunks for j in
                                                                               window_chunks(self.layout, parts.window_mask, every, k)))
        self.ops.stored(len(writes), sum(p.payload_bytes for p, _ in writes), time.perf_counter() - start_s)
        # a chunk counts as stored when any of its objects is (as when a chunk was one object)
        stored = {p.chunk.index for p, _ in writes} | {k for k in range(len(every)) if present[k]}
        stored |= {p.chunk.index for (p, _), m in zip(window_plans, window_existing) if m is not None}
        stored |= {p.chunk.index for p, m in zip(prefix_plans, prefix_existing) if m is not None and (m | p.group_mask) == m}
        return sum(c.end - c.start for c in chunks if c.index in stored)

    def _count_evicted(self, entry) -> None:
        """Pool eviction listener: count window pieces (a prefix part's groups are never all window groups)."""
        mask = entry.header.group_mask
        if mask and not mask & self.parts.prefix_mask:
            with self._stats_lock:
                self.stats.window_pieces_evicted += 1


def _identity(chunk: Chunk, prompt) -> tuple[bytes, Optional[bytes], np.ndarray]:
    """(key, parent key, token ids) of a stored chunk for its event; no tokens when unknown."""
    if prompt is None:
        return bytes(chunk.key), None, np.zeros(0, np.int64)
    tokens, every = prompt
    parent = bytes(every[chunk.index - 1].key) if chunk.index > 0 else None
    return bytes(chunk.key), parent, tokens[chunk.start : chunk.end]
