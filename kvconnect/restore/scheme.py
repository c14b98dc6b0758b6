"""How an engine stores a chunk's groups and finds them again: one interface, two ways.

``WholeChunks`` (restore/whole_chunks.py) stores every group's rows of a chunk in one object
under the chunk's key: layouts without window groups, a restore interval of 0, and engines
that hand over pages under their own keys. ``WindowParts`` (restore/window_parts.py) stores
the prefix groups per chunk and the window groups only at restore points (parts.py).
The engine picks one when it is made (``PartLayout.split``) and then only calls it.

In the order an engine calls them:

    scheme.store(every, chunks, tables, start_s, prompt)  -> tokens of ``chunks`` stored after the call
    scheme.lookup(chunks)                                 -> P, the restorable boundary
    scheme.retrieve(chunks, tables, skip, start_s)        -> tokens loaded beyond ``skip``

``store_chunks`` / ``lookup_chunks`` / ``retrieve_chunks`` do the same over chunks whose keys
the caller computed; only ``WholeChunks`` has them (a caller key names one whole object).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from ..chunks.keys import Chunk
from ..engine_stats import Counters
from ..events import ChunkEventLog
from ..layout.kv_layout import KVLayout
from ..metrics.recorders import OpLog
from ..storage.manager import StorageManager
from .parts import PartLayout
from .plan import BlockTables
from .reads import ChunkLoader
from .writes import ObjectWriter, Prompt


class RestoreScheme(ABC):
    """One way of storing a layout's chunks and reading them back (see the module doc).

    ``events``: the chunk event log stored chunks are reported to (None: not recorded); the
    engine sets it when a router asks for events.
    """

    def __init__(self, layout: KVLayout, parts: PartLayout, storage: StorageManager, writer: ObjectWriter,
                 loader: ChunkLoader, counters: Counters, ops: OpLog) -> None:
        self.layout = layout
        self.parts = parts
        self.storage = storage
        self.writer = writer
        self.loader = loader
        self.counters = counters
        self.ops = ops
        self.events: Optional[ChunkEventLog] = None

    @abstractmethod
    def store(self, every: list[Chunk], chunks: list[Chunk], tables: BlockTables, start_s: float,
              prompt: Optional[Prompt], *, step_end: bool = False, continues: bool = False,
              next_chunk: Optional[Chunk] = None) -> int:
        """Store ``chunks`` (the chunks of ``every``, the whole prompt, beyond its masked prefix).
        ``step_end`` / ``continues``: ``KVCacheEngine.store``'s; ``next_chunk``: at a step end,
        the prompt's chunk the engine computes next, if known (restore points only)."""

    @abstractmethod
    def lookup(self, chunks: list[Chunk]) -> int:
        """The largest restorable boundary; the pool's objects of the hit become its most recently used."""

    @abstractmethod
    def retrieve(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float) -> int:
        """Pin what the largest restorable boundary needs and load it beyond ``skip`` tokens."""

    @abstractmethod
    def check_caller_keys(self, what: str) -> None:
        """Raise LayoutError, before anything is read, unless chunks with caller keys can be
        stored and read here (``what``: the engine method asked)."""

    @abstractmethod
    def store_chunks(self, chunks: list[Chunk], tables: BlockTables, start_s: float) -> int:
        """``store`` over chunks with caller keys, each one object."""

    @abstractmethod
    def lookup_chunks(self, chunks: list[Chunk]) -> int:
        """``lookup`` over chunks with caller keys."""

    @abstractmethod
    def retrieve_chunks(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float) -> int:
        """``retrieve`` over chunks with caller keys."""

    def _count_lookup(self, chunks: list[Chunk], hit: int) -> None:
        self.counters.add(lookups=1, lookup_requested_tokens=chunks[-1].end if chunks else 0, lookup_hit_tokens=hit)

