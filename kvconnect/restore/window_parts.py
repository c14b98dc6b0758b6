"""``WindowParts``: prefix groups per chunk, window groups only at restore points (parts.py).

Store: the prefix parts of the stored chunks, and the window parts of this store's restore
points (``points.restore_points``), in one order by chunk so that a pool short of slots
keeps the earliest restore points whole.

Lookup: the largest restore point P whose prefix parts of [0, P) and window part at P are
present. The pool's objects of the hit become its most recently used; prefix parts no
restore point of the prompt reaches and the pieces of incomplete window parts are demoted.

Retrieve: pin the prefix parts, then the window pieces of the largest candidate; when a
piece vanished between the lookup and the pin (evicted, dropped by a tier), that chunk's
window mask drops to what was pinned and the gate runs again: the retrieve falls back to
an earlier restore point, until one is pinned whole or none is left (a miss).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..chunks.keys import Chunk
from ..engine_stats import Counters
from ..errors import LayoutError
from ..layout.kv_layout import KVLayout
from ..metrics.recorders import OpLog
from ..storage.manager import StorageManager
from .gate import effective_masks, restorable_boundary, window_chunks
from .parts import PartLayout, window_key
from .plan import BlockTables, StoredPart, plan_pieces, plan_store
from .points import restore_points
from .reads import ChunkLoader
from .scheme import OwnObjects, RestoreScheme, ShortHitFill
from .writes import ObjectWriter, Prompt, chunk_identity


class WindowParts(RestoreScheme):
    def __init__(self, layout: KVLayout, parts: PartLayout, storage: StorageManager, writer: ObjectWriter,
                 loader: ChunkLoader, counters: Counters, ops: OpLog, *, interval_tokens: int,
                 step_end_parts: bool = False) -> None:
        super().__init__(layout, parts, storage, writer, loader, counters, ops)
        self.interval_tokens = interval_tokens
        self.step_end_parts = step_end_parts
        self.npieces = len(parts.pieces)
        self.piece_planes = parts.piece_planes(len(layout.planes))
        self.prefix_planes = np.array([(parts.prefix_mask >> p.group_index) & 1 == 1 for p in layout.planes], np.bool_)
        storage.pool.on_evict.append(self._count_evicted)

    def _window(self, chunks: list[Chunk], k: int) -> list[int]:
        return window_chunks(self.layout, self.parts.window_mask, chunks, k)

    # -- store -----------------------------------------------------------------------
    def store(self, every: list[Chunk], chunks: list[Chunk], tables: BlockTables, start_s: float,
              prompt: Optional[Prompt], *, step_end: bool = False, continues: bool = False,
              next_chunk: Optional[Chunk] = None) -> int:
        parts = self.parts
        first = chunks[0].index if chunks else len(every)
        prefix_plans = plan_store(self.layout, chunks, tables, groups=parts.prefix_mask) if parts.prefix_mask else []
        prefix_existing = self.storage.masks([p.chunk.key for p in prefix_plans])

        def whole_prefix(mask: Optional[int]) -> bool:
            return mask is not None and (mask & parts.prefix_mask) == parts.prefix_mask

        present = [False] * len(every)
        for p, m in zip(prefix_plans, prefix_existing):
            present[p.chunk.index] = whole_prefix(m)
        next_present = None  # looked up only where it decides: a step end inside a stored prefix
        if step_end and next_chunk is not None and prefix_plans and present[-1]:
            (m,) = self.storage.masks([next_chunk.key])
            next_present = whole_prefix(m)
        points, short_lived = restore_points(every, first, present, self.interval_tokens, step_end=step_end,
                                             continues=continues, step_end_parts=self.step_end_parts,
                                             next_present=next_present)
        window_of: dict[int, list[int]] = {}  # chunk index -> the restore points needing its window rows
        for k in points:
            for j in self._window(every, k):
                window_of.setdefault(j, []).append(k)
        window_plans = []
        for j in sorted(window_of):
            for piece, (plan,) in enumerate(plan_pieces(self.layout, [every[j]], tables, groups=parts.window_mask,
                                                        pieces=self.piece_planes)):
                if plan.group_mask:
                    window_plans.append((plan, window_key(every[j].key, piece)))
        window_existing = self.storage.masks([k for _, k in window_plans])
        # one order, by chunk: a pool short of slots keeps the earliest restore points whole
        prefix_objects = [((p, p.chunk.key), m) for p, m in zip(prefix_plans, prefix_existing) if p.group_mask]
        window_set = {k for _, k in window_plans}
        ordered = sorted(prefix_objects + list(zip(window_plans, window_existing)), key=lambda o: (o[0][0].chunk.index, o[0][1] in window_set))
        writes = self.writer.write([o for o, _ in ordered], [m for _, m in ordered])
        if points:  # what this store's restore points reach is worth keeping again
            last = points[-1]
            self.storage.pool.reinstate([k for (p, k), m in ordered if m is not None and p.chunk.index <= last])
        if short_lived:  # a step end's own window rows: first evicted, unless another point needs them too
            kept = {j for k in points if k not in short_lived for j in self._window(every, k)}
            only = {j for k in short_lived for j in self._window(every, k)} - kept
            self.storage.pool.demote([k for p, k in window_plans if p.chunk.index in only])
        prefix_writes = [p for p, k in writes if k not in window_set]
        window_writes = [(p, k) for p, k in writes if k in window_set]
        if self.events is not None and prefix_writes:
            self.events.stored("cpu", [chunk_identity(p.chunk, prompt) for p in prefix_writes])
        written_chunks = {p.chunk.index for p, _ in window_writes}
        written_bytes = sum(p.payload_bytes for p, _ in writes)
        self.counters.add(
            stored_chunks=len(prefix_writes), stored_bytes=written_bytes, skipped_chunks=len(prefix_objects) - len(prefix_writes),
            window_pieces_stored=len(window_writes), window_bytes_stored=sum(p.payload_bytes for p, _ in window_writes),
            window_parts_stored=sum(1 for k in points if any(j in written_chunks for j in self._window(every, k))))
        self.ops.stored(len(writes), written_bytes, time.perf_counter() - start_s)
        # a chunk counts as stored when any of its objects is
        stored = {p.chunk.index for p, _ in writes} | {k for k in range(len(every)) if present[k]}
        stored |= {p.chunk.index for (p, _), m in zip(window_plans, window_existing) if m is not None}
        stored |= {p.chunk.index for p, m in zip(prefix_plans, prefix_existing) if m is not None and (m | p.group_mask) == m}
        return sum(c.end - c.start for c in chunks if c.index in stored)

    def _count_evicted(self, entry) -> None:
        """Pool eviction listener: count window pieces (a prefix part's groups are never all window groups)."""
        mask = entry.header.group_mask
        if mask and not mask & self.parts.prefix_mask:
            self.counters.add(window_pieces_evicted=1)

    # -- lookup ----------------------------------------------------------------------
    def lookup(self, chunks: list[Chunk], fill: Optional[ShortHitFill] = None) -> int:
        prefix, run, begun, window, hit = self._own_parts(chunks)
        if fill is not None and self._short(chunks, hit) and fill(chunks, OwnObjects(tuple(prefix), tuple(window), hit)):
            prefix, run, begun, window, hit = self._own_parts(chunks)
        if hit:
            k = next(c.index for c in chunks if c.end == hit)
            used = [c.key for c in chunks if c.end <= hit] if self.parts.prefix_mask else []
            used += [window_key(chunks[j].key, p) for j in self._window(chunks, k) for p in range(self.npieces)]
            pool = self.storage.pool
            pool.release(pool.acquire(used))  # acquire touches
        self._demote_unreachable(chunks, hit, run, window, begun)
        self._count_lookup(chunks, hit)
        return hit

    def _own_parts(self, chunks: list[Chunk]) -> tuple[list[Optional[int]], int, list, list[int], int]:
        """This rank's parts of ``chunks``: prefix masks, the prefix run, whether each chunk of the
        run has a window piece (begun), window masks, and the restorable boundary they give."""
        prefix = self._prefix_masks(chunks)
        run = self._prefix_run(prefix)
        begun: list = []
        window = self._window_masks(chunks, run, begun)
        return prefix, run, begun, window, restorable_boundary(self.layout, chunks, effective_masks(prefix, window))

    def _prefix_masks(self, chunks: list[Chunk]) -> list[Optional[int]]:
        """Prefix groups stored per chunk (None: absent); all-zero masks when no group is a prefix group."""
        if not self.parts.prefix_mask:
            return [0] * len(chunks)
        return [m & self.parts.prefix_mask if m is not None else None for m in self.storage.masks([c.key for c in chunks])]

    def _prefix_run(self, prefix: list[Optional[int]]) -> int:
        """How many leading chunks hold every prefix group."""
        want = self.parts.prefix_mask
        for i, m in enumerate(prefix):
            if m is None or (m & want) != want:
                return i
        return len(prefix)

    def _window_masks(self, chunks: list[Chunk], run: int, begun: Optional[list] = None) -> list[int]:
        """Window groups stored for each of the first ``run`` chunks (0 past them): the groups every
        piece holds, 0 unless every piece is present. Asks for piece 0 first: most chunks have none."""
        out = [0] * len(chunks)
        npieces = self.npieces
        first = self.storage.masks([window_key(c.key, 0) for c in chunks[:run]])
        have = [i for i, m in enumerate(first) if m is not None]
        if begun is not None:  # chunks whose piece 0 is present (a window part was begun)
            begun.extend(m is not None for m in first)
        for i in have:
            out[i] = first[i] & self.parts.window_mask
        if npieces > 1 and have:
            rest = self.storage.masks([window_key(chunks[i].key, p) for i in have for p in range(1, npieces)])
            for n, i in enumerate(have):
                for m in rest[n * (npieces - 1) : (n + 1) * (npieces - 1)]:
                    out[i] = out[i] & m if m is not None else 0
        return out

    def _demote_unreachable(self, chunks: list[Chunk], hit: int, run: int, window: list[int], begun: list) -> None:
        """Tell the pool what this lookup found worth less: prefix parts of this prompt past its
        last usable restore point (no restore point of this prompt reaches them; a branch that
        still does touches them back), and the pieces of incomplete window parts."""
        pool = self.storage.pool
        keys = [c.key for c in chunks[:run] if c.end > hit] if self.parts.prefix_mask else []
        moved = pool.demote(keys) if keys else 0
        partial = [c for c, w, b in zip(chunks[:run], window, begun) if not w and b]
        if partial and self.npieces > 1:
            pool.demote([window_key(c.key, p) for c in partial for p in range(self.npieces)])
        if moved:
            self.counters.add(prefix_chunks_demoted=moved)

    # -- retrieve --------------------------------------------------------------------
    def retrieve_pass(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float,
                      fill: Optional[ShortHitFill]) -> Optional[int]:
        """Pin the prefix parts, find the largest restore point whose window pieces can be pinned too, load."""
        parts, npieces = self.parts, self.npieces
        wanted = [c for c in chunks if c.end > skip]
        below = len(chunks) - len(wanted)
        if parts.prefix_mask:
            entries = [None] * below + list(self.storage.acquire([c.key for c in wanted]))
        else:
            entries = [None] * len(chunks)
        pieces: dict[int, list] = {}  # chunk index -> its pinned window pieces
        try:
            prefix = [(e.header.group_mask & parts.prefix_mask if e is not None else None) for e in entries]
            if not parts.prefix_mask:
                prefix = [0] * len(chunks)
            present = [parts.prefix_mask if c.end <= skip else m for c, m in zip(chunks, prefix)]
            run = self._prefix_run(present)
            window = self._window_masks(chunks, run)
            boundary = restorable_boundary(self.layout, chunks, effective_masks(prefix, window), present_below=skip)
            if fill is not None and self._short(chunks, boundary) and fill(
                    chunks, OwnObjects(tuple(present), tuple(window), boundary, skip)):
                return None
            for _ in range(len(chunks) + 1):  # each round pins one candidate's pieces or rules a chunk out
                if boundary <= skip:
                    return 0
                k = next(c.index for c in chunks if c.end == boundary)
                need = [j for j in self._window(chunks, k) if chunks[j].end > skip and j not in pieces]
                got = self.storage.acquire([window_key(chunks[j].key, p) for j in need for p in range(npieces)])
                lost = False
                for n, j in enumerate(need):
                    mine = got[n * npieces : (n + 1) * npieces]
                    mask = parts.window_mask
                    for e in mine:
                        mask = mask & e.header.group_mask if e is not None else 0
                    if mask != window[j]:
                        lost = True
                        window[j] = mask
                    if all(e is not None for e in mine) and mask:
                        pieces[j] = mine
                    else:
                        self.storage.release(mine)
                if not lost:
                    break
                boundary = restorable_boundary(self.layout, chunks, effective_masks(prefix, window), present_below=skip)
            else:
                return 0
            load = [c for c in chunks if c.end > skip and c.end <= boundary]
            needed = set(self._window(chunks, k))
            pool = self.storage.pool
            stored = []
            for c in load:
                mine = []
                if (e := entries[c.index]) is not None:
                    mine.append(StoredPart(e.header, pool.slot_offset(e.slot), self.prefix_planes, e.key))
                if c.index in needed:
                    mine += [StoredPart(e.header, pool.slot_offset(e.slot), self.piece_planes[p], e.key)
                             for p, e in enumerate(pieces[c.index])]
                stored.append(mine)
            got = self.loader.load(load, stored, boundary, tables, skip, start_s,
                                   pieces=sum(len(pieces[j]) for j in needed if j in pieces))
            if got:
                self.counters.add(restore_point_hits=1)
            return got
        finally:
            self.storage.release(entries)
            for mine in pieces.values():
                self.storage.release(mine)

    # -- caller keys -----------------------------------------------------------------
    def check_caller_keys(self, what: str) -> None:
        raise _whole_chunks_only(what)

    def store_chunks(self, chunks: list[Chunk], tables: BlockTables, start_s: float) -> int:
        raise _whole_chunks_only("store_chunks")

    def lookup_chunks(self, chunks: list[Chunk]) -> int:
        raise _whole_chunks_only("lookup_chunks")

    def retrieve_chunks(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float) -> int:
        raise _whole_chunks_only("retrieve_chunks")


def _whole_chunks_only(what: str) -> LayoutError:
    return LayoutError(f"{what} stores whole chunks under caller keys; this engine splits its window groups "
                       "into restore-point parts: make it with KVCacheEngine(..., window_parts=False)")
