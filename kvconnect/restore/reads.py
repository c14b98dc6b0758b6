"""The read path's last step: the rows needed at P, from pinned pool objects into the
engine's blocks with one scatter.

``ChunkLoader.load`` is what both ways of storing (``whole_chunks``, ``window_parts``) end
in once they have pinned the objects of a restore point. An object that does not hold what
its header claims is dropped from every tier and the retrieve reports a miss: a cache may
miss, it never loads wrong bytes.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from ..chunks.keys import Chunk
from ..engine_stats import Counters
from ..errors import CorruptChunkError
from ..layout.kv_layout import KVLayout
from ..metrics.recorders import OpLog
from ..storage.manager import StorageManager
from .plan import BlockTables, StoredPart, retrieve_part_segments

logger = logging.getLogger("kvconnect.engine")  # the engine's log: where operators look for its misses


class ChunkLoader:
    """Loads pinned objects with ``scatter`` (segment tables -> the engine's planes, on the
    load's threads and transfer route), counting into ``counters`` and ``ops``."""

    def __init__(self, layout: KVLayout, storage: StorageManager, scatter: Callable[[object], None], counters: Counters,
                 ops: OpLog) -> None:
        self.layout = layout
        self.storage = storage
        self.scatter = scatter
        self.counters = counters
        self.ops = ops

    def load(self, load: list[Chunk], parts: Sequence[Sequence[StoredPart]], boundary: int, tables: BlockTables, skip: int,
             start_s: float, *, pieces: int) -> int:
        """Scatter the rows needed at ``boundary`` from the pinned ``parts`` of ``load``; tokens
        loaded beyond ``skip`` (0 when an object was corrupt)."""
        try:
            builder = retrieve_part_segments(self.layout, load, parts, boundary, tables, present_tokens=skip)
        except CorruptChunkError as exc:
            logger.warning("kvconnect: dropping an inconsistent chunk; reporting a miss: %s", exc)
            self._drop(exc, load, parts)
            self.counters.add(corrupt_chunks=1)
            return 0
        built = builder.build()
        self.scatter(built)
        nbytes = built.payload_bytes(self.layout)
        chunks_used = sum(1 for mine in parts if mine)
        self.counters.add(retrieved_chunks=chunks_used, retrieved_bytes=nbytes, retrieved_tokens=boundary - skip,
                          window_pieces_retrieved=pieces)
        self.ops.retrieved(chunks_used, nbytes, time.perf_counter() - start_s)
        return boundary - skip

    def _drop(self, exc: CorruptChunkError, load: list[Chunk], parts: Sequence[Sequence[StoredPart]]) -> None:
        """Drop the bad object when the planner named it, else every object of the bad chunk."""
        key = getattr(exc, "key", None)
        index = getattr(exc, "chunk_index", None)
        if key is not None:
            self.storage.drop(key)
            return
        for chunk, mine in zip(load, parts):
            if index is None or chunk.index == index:
                for part in mine:
                    if part.key is not None:
                        self.storage.drop(part.key)
