"""How an engine stores a chunk's groups and finds them again: one interface, two ways.

``WholeChunks`` (restore/whole_chunks.py) stores every group's rows of a chunk in one object
under the chunk's key: layouts without window groups, a restore interval of 0, and engines
that hand over pages under their own keys. ``WindowParts`` (restore/window_parts.py) stores
the prefix groups per chunk and the window groups only at restore points (parts.py).
The engine picks one when it is made (``PartLayout.split``) and then only calls it.

In the order an engine calls them:

    scheme.store(every, chunks, tables, start_s, prompt)  -> tokens of ``chunks`` stored after the call
    scheme.lookup(chunks, fill)                           -> P, the restorable boundary
    scheme.retrieve(chunks, tables, skip, start_s, fill)  -> tokens loaded beyond ``skip``

``fill`` (optional, a ``ShortHitFill``): asked only when this rank's own objects fall short of
the prompt's last restore point, with what the scheme found of them (``OwnObjects``); it may
commit more objects into the pool under this rank's keys (restore/other_tp_reads.py: what ranks
of another TP size wrote), and the scheme then finds its hit again. One lookup is counted.

``store_chunks`` / ``lookup_chunks`` / ``retrieve_chunks`` do the same over chunks whose keys
the caller computed; only ``WholeChunks`` has them (a caller key names one whole object).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Protocol

from ..chunks.keys import Chunk
from ..engine_stats import Counters
from ..events import ChunkEventLog
from ..layout.kv_layout import KVLayout
from ..metrics.recorders import OpLog
from ..storage.manager import StorageManager
from .gate import resumable_end
from .parts import PartLayout
from .plan import BlockTables
from .reads import ChunkLoader
from .writes import ObjectWriter, Prompt


@dataclass(frozen=True)
class OwnObjects:
    """What a lookup or a retrieve found of this rank's own objects, per chunk of the prompt.

    ``prefix``: the groups of the chunk's prefix part (``WholeChunks``: of its one object); None:
    absent. ``window``: the window groups of its complete window part (0: none; always 0 under
    ``WholeChunks``). ``hit``: the restorable boundary they give. ``present_below``: chunks
    ending at or below it are already in the engine (a retrieve's masked prefix).
    """

    prefix: tuple[Optional[int], ...]
    window: tuple[int, ...]
    hit: int
    present_below: int = 0


class ShortHitFill(Protocol):
    def __call__(self, chunks: list[Chunk], own: OwnObjects) -> int:
        """Commit into the pool, under this rank's own keys, objects that raise ``own.hit``;
        returns how many were committed (0: the scheme's hit stands). Never raises."""


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
    def lookup(self, chunks: list[Chunk], fill: Optional[ShortHitFill] = None) -> int:
        """The largest restorable boundary; the pool's objects of the hit become its most recently used."""

    def retrieve(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float,
                 fill: Optional[ShortHitFill] = None) -> int:
        """Pin what the largest restorable boundary needs and load it beyond ``skip`` tokens.
        Short of the prompt's last restore point, ``fill`` is asked first; when it committed
        objects, everything pinned is released and the retrieve runs once more without it."""
        got = self.retrieve_pass(chunks, tables, skip, start_s, fill)
        return got if got is not None else self.retrieve_pass(chunks, tables, skip, start_s, None)

    @abstractmethod
    def retrieve_pass(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float,
                      fill: Optional[ShortHitFill]) -> Optional[int]:
        """``retrieve``'s one pass: None when ``fill`` committed objects (nothing loaded, nothing pinned)."""

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

    def _short(self, chunks: list[Chunk], hit: int) -> bool:
        """Whether the prompt has a restore point past ``hit`` (only then can a fill raise it)."""
        for c in reversed(chunks):
            if c.end <= hit:
                return False
            if resumable_end(self.layout, c.end):
                return True
        return False

    def _count_lookup(self, chunks: list[Chunk], hit: int) -> None:
        self.counters.add(lookups=1, lookup_requested_tokens=chunks[-1].end if chunks else 0, lookup_hit_tokens=hit)

