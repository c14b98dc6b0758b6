"""Restore points at lookup and retrieve: the reads of KVCacheEngine (engine.py) over the two parts (parts.py).

A hit is the largest restore point P such that every prefix part of [0, P) and the window
part at P are present. ``_lookup_parts`` finds it (the pool's objects of the hit become its
most recently used; prefix parts no restore point of the prompt reaches and the pieces of
incomplete window parts are demoted). ``_retrieve_parts`` pins the prefix parts, then the
window pieces of the largest candidate; when a piece vanished between the lookup and the
pin (evicted, dropped by a tier), that chunk's window mask drops to what was pinned and the
restore gate runs again: the retrieve falls back to an earlier restore point, until one is
pinned whole or none is left (a miss). It then loads exactly the rows each group needs at P
(``KVCacheEngine._load``).

``RestorePoints`` is a mixin of KVCacheEngine: its methods use the engine's ``layout``,
``parts``, ``storage``, ``pool``, ``stats`` (under ``_stats_lock``), ``_prefix_planes``,
``_piece_planes``, ``_count_lookup`` and ``_load``.
"""

from __future__ import annotations

from typing import Optional

from .parts import window_chunks, window_key
from .plan import BlockTables, Chunk, StoredPart, restorable_boundary


class RestorePoints:
    def _lookup_parts(self, chunks: list[Chunk]) -> int:
        """``lookup`` with window groups: the largest restore point whose prefix and window parts are present."""
        prefix = self._prefix_masks(chunks)
        run = self._prefix_run(prefix)
        begun: list = []
        window = self._window_masks(chunks, run, begun)
        hit = restorable_boundary(self.layout, chunks, self._effective(prefix, window))
        if hit:
            k = next(c.index for c in chunks if c.end == hit)
            used = [c.key for c in chunks if c.end <= hit] if self.parts.prefix_mask else []
            used += [window_key(chunks[j].key, p) for j in window_chunks(self.layout, self.parts.window_mask, chunks, k)
                     for p in range(len(self.parts.pieces))]
            self.pool.release(self.pool.acquire(used))  # acquire touches
        self._demote_unreachable(chunks, hit, run, window, begun)
        self._count_lookup(chunks, hit)
        return hit

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
        npieces = len(self.parts.pieces)
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

    def _effective(self, prefix: list[Optional[int]], window: list[int]) -> list[Optional[int]]:
        return [None if p is None and not w else (p or 0) | w for p, w in zip(prefix, window)]

    def _demote_unreachable(self, chunks: list[Chunk], hit: int, run: int, window: list[int], begun: list) -> None:
        """Tell the pool what this lookup found worth less: prefix parts of this prompt past its
        last usable restore point (no restore point of this prompt reaches them; a branch that
        still does touches them back), and the pieces of incomplete window parts."""
        demote = getattr(self.pool, "demote", None)
        if demote is None:
            return
        keys = [c.key for c in chunks[:run] if c.end > hit] if self.parts.prefix_mask else []
        moved = demote(keys) if keys else 0
        npieces = len(self.parts.pieces)
        partial = [c for c, w, b in zip(chunks[:run], window, begun) if not w and b]
        if partial and npieces > 1:
            demote([window_key(c.key, p) for c in partial for p in range(npieces)])
        if moved:
            with self._stats_lock:
                self.stats.prefix_chunks_demoted += moved

    def _retrieve_parts(self, chunks: list[Chunk], tables: BlockTables, skip: int, start_s: float) -> int:
        """Pin the prefix parts, find the largest restore point whose window pieces can be pinned too, load."""
        parts, npieces = self.parts, len(self.parts.pieces)
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
            run = self._prefix_run([parts.prefix_mask if c.end <= skip else m for c, m in zip(chunks, prefix)])
            window = self._window_masks(chunks, run)
            for _ in range(len(chunks) + 1):  # each round pins one candidate's pieces or rules a chunk out
                boundary = restorable_boundary(self.layout, chunks, self._effective(prefix, window), present_below=skip)
                if boundary <= skip:
                    return 0
                k = next(c.index for c in chunks if c.end == boundary)
                need = [j for j in window_chunks(self.layout, parts.window_mask, chunks, k) if chunks[j].end > skip and j not in pieces]
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
            else:
                return 0
            load = [c for c in chunks if c.end > skip and c.end <= boundary]
            needed = set(window_chunks(self.layout, parts.window_mask, chunks, k))
            stored = []
            for c in load:
                mine = []
                if (e := entries[c.index]) is not None:
                    mine.append(StoredPart(e.header, self.pool.slot_offset(e.slot), self._prefix_planes, e.key))
                if c.index in needed:
                    mine += [StoredPart(e.header, self.pool.slot_offset(e.slot), self._piece_planes[p], e.key)
                             for p, e in enumerate(pieces[c.index])]
                stored.append(mine)
            got = self._load(load, stored, boundary, tables, skip, start_s, pieces=sum(len(pieces[j]) for j in needed if j in pieces))
            if got:
                with self._stats_lock:
                    self.stats.restore_point_hits += 1
            return got
        finally:
            self.storage.release(entries)
            for mine in pieces.values():
                self.storage.release(mine)
