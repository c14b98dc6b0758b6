"""``WholeChunks``: every group's rows of a chunk in one object under the chunk's key.

A hit is the largest chunk end at which every group can resume from the stored chunks
(``gate.restorable_boundary``); a retrieve pins the chunks up to it and loads exactly the
rows each group needs there.
"""

from __future__ import annotations

import time
from typing import Optional

from ..chunks.keys import Chunk
from ..layout.kv_layout import KVLayout
from .gate import restorable_boundary
from .plan import BlockTables, StoredPart, plan_store
from .scheme import OwnObjects, RestoreScheme, ShortHitFill
from .writes import Prompt, chunk_identity


class WholeChunks(RestoreScheme):
    def store(self, every: list[Chunk], chunks: list[Chunk], tables: BlockTables, start_s: float,
              prompt: Optional[Prompt], *, step_end: bool = False, continues: bool = False,
              next_chunk: Optional[Chunk] = None) -> int:
        return self._store(chunks, tables, start_s, prompt)

    def check_caller_keys(self, what: str) -> None:
        """Every chunk is one object here: a caller key names it."""

    def store_chunks(self, chunks: list[Chunk], tables: BlockTables, start_s: float) -> int:
        return self._store(chunks, tables, start_s, None)

    def _store(self, chunks: list[Chunk], tables: BlockTables, start_s: float, prompt: Optional[Prompt]) -> int:
        plans = [p for p in plan_store(self.layout, chunks, tables) if p.group_mask]
        existing = self.storage.masks([p.chunk.key for p in plans])
        done_tokens = sum(p.chunk.end - p.chunk.start for p, m in zip(plans, existing) if m is not None and (m | p.group_mask) == m)
        writes = self.writer.write([(p, p.chunk.key) for p in plans], existing)
        if self.events is not None and writes:
            self.events.stored("cpu", [chunk_identity(p.chunk, prompt) for p, _ in writes])
        written_bytes = sum(p.payload_bytes for p, _ in writes)
        self.counters.add(stored_chunks=len(writes), stored_bytes=written_bytes, skipped_chunks=len(plans) - len(writes))
        self.ops.stored(len(writes), written_bytes, time.perf_counter() - start_s)
        return done_tokens + sum(p.chunk.end - p.chunk.start for p, _ in writes)

    def lookup(self, chunks: list[Chunk], fill: Optional[ShortHitFill] = None) -> int:
        keys = [c.key for c in chunks]
        masks = self.storage.masks(keys)
        hit = restorable_boundary(self.layout, chunks, masks)
        if fill is not None and self._short(chunks, hit) and fill(chunks, _own(self.layout, chunks, masks, hit)):
            hit = restorable_boundary(self.layout, chunks, self.storage.masks(keys))
        if hit:
            pool = self.storage.pool
            pool.release(pool.acquire([c.key for c in chunks if c.end <= hit]))  # acquire touches
        self._count_lookup(chunks, hit)
        return hit

    def lookup_chunks(self, chunks: list[Chunk]) -> int:
        return self.lookup(chunks)

    def retrieve_pass(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float,
                      fill: Optional[ShortHitFill]) -> Optional[int]:
        # chunks below the mask are already in the engine: never fetch them from a tier
        wanted = [c for c in chunks if c.end > skip]
        entries = [None] * (len(chunks) - len(wanted)) + list(self.storage.acquire([c.key for c in wanted]))
        try:
            masks = [e.header.group_mask if e is not None else None for e in entries]
            boundary = restorable_boundary(self.layout, chunks, masks, present_below=skip)
            if fill is not None and self._short(chunks, boundary) and fill(
                    chunks, _own(self.layout, chunks, masks, boundary, skip)):
                return None
            if boundary <= skip:
                return 0
            load = [c for c in chunks if c.end > skip and c.end <= boundary]
            pool = self.storage.pool
            parts = [[StoredPart(e.header, pool.slot_offset(e.slot), key=e.key)] if (e := entries[c.index]) is not None else []
                     for c in load]
            return self.loader.load(load, parts, boundary, tables, skip, start_s, pieces=0)
        finally:
            self.storage.release(entries)

    def retrieve_chunks(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float) -> int:
        return self.retrieve(chunks, tables, skip, start_s)


def _own(layout: KVLayout, chunks: list[Chunk], masks: list[Optional[int]], hit: int, skip: int = 0) -> OwnObjects:
    """``OwnObjects`` of whole chunks: each chunk's object mask; every group for chunks below ``skip``."""
    every = (1 << layout.num_groups) - 1
    return OwnObjects(tuple(every if c.end <= skip else m for c, m in zip(chunks, masks)), (0,) * len(chunks), hit, skip)
