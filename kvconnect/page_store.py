"""PageStore: store, find and load whole engine pages under keys the engine computed.

For engines that hand the cache page keys instead of token ids (SGLang's HiCache storage
API). A layout group here is one engine *pool* whose engine block is one page
(``block_size`` = the pool's page in tokens). A stored object is one page of one pool: a
chunk in kvconnect's format (header, checksum, plane-major rows) whose key is the engine's
page key folded with the layout fingerprint, the page size and the pool (``page_keys``).

Pages are position-free: every page chunk covers tokens ``[0, page_tokens)`` of its group,
because the engine's key chain already names the page's place in its prefix and the engine
may hand the same page over at different offsets of a batch. The restore gate therefore
runs over the pages of one query at relative positions (``restorable_prefixes``).

Data moves with the engine's compiled transfer kernel: one gather for a batch of pages on
store, one scatter on load; the segment tables are built with numpy, no per-page loop.
A page that fails verification (checksum, identity, size, rows) is a miss and is dropped.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .chunks.chunk_format import ChunkHeader
from .engine import KVCacheEngine
from .errors import BlockTableError
from .chunks.page_keys import PageKey, PageKeyFolder
from .restore.plan import PlaneArrays
from .layout.rows import GroupGeometry
from .layout.spec import ChunkKey, DCPSpec, GroupSpec
from .transfer.tables import SegmentBuilder

logger = logging.getLogger(__name__)


@dataclass
class PageCounters:
    """What a PageStore did; one small place for an adapter's metrics to read."""

    pages_stored: int = 0
    pages_already_stored: int = 0
    pages_not_stored: int = 0  # no room in the pool
    bytes_stored: int = 0
    pages_loaded: int = 0
    pages_missed: int = 0
    bytes_loaded: int = 0
    pages_corrupt: int = 0
    exists_queries: int = 0
    exists_pages_queried: int = 0
    exists_pages_hit: int = 0


def group_folder(fingerprint, page_tokens: int, group: int, *, namespace: Optional[str] = None,
                 generation: bytes = b"") -> PageKeyFolder:
    """The folder a ``PageStore`` names group ``group``'s pages with: a stored page's chunk key
    is ``group_folder(...).fold([engine page key])`` (what a tool or test needs to find the
    object an engine stored under one of its keys)."""
    return PageKeyFolder(fingerprint, page_tokens, namespace=f"{namespace or ''}\x00pool{group}", generation=generation)


class PageStore:
    """Pages of one ``KVCacheEngine`` layout (one group per engine pool) under engine keys."""

    def __init__(self, engine: KVCacheEngine, *, namespace: Optional[str] = None) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.arrays = PlaneArrays(self.layout)
        self.counters = PageCounters()
        self._lock = threading.Lock()
        self._namespace = namespace
        self._folders = self._make_folders()
        # per group: planes, their row bytes, the page's bytes and the header's plane rows
        self._planes = [np.asarray(self.layout.planes_of_group(g), np.int64) for g in range(self.layout.num_groups)]
        self._rpb = [geo.rows_per_block for geo in self.layout.geometries]
        self._page_bytes = [int(self.arrays.row_bytes[p].sum()) * r for p, r in zip(self._planes, self._rpb)]
        self._plane_rows = []
        for g in range(self.layout.num_groups):
            rows = tuple((0, self._rpb[g]) if p.group_index == g else (0, 0) for p in self.layout.planes)
            self._plane_rows.append(rows)

    # -- keys ------------------------------------------------------------------------
    def _make_folders(self) -> tuple[bytes, list[PageKeyFolder]]:
        generation = self.engine.generation
        return generation, [
            group_folder(self.layout.fingerprint, group.block_size, g, namespace=self._namespace, generation=generation)
            for g, group in enumerate(self.layout.groups)
        ]

    def keys(self, group: int, page_keys: Sequence[PageKey]) -> list[ChunkKey]:
        folders = self._folders
        if folders[0] != self.engine.generation:  # the engine was reset: fold under its new generation
            folders = self._folders = self._make_folders()
        return folders[1][group].fold(page_keys)

    def page_bytes(self, group: int) -> int:
        return self._page_bytes[group]

    # -- presence --------------------------------------------------------------------
    def present(self, group: int, page_keys: Sequence[PageKey]) -> np.ndarray:
        """Bool per page: stored (pool or a lower tier) with this group's rows."""
        if not page_keys:
            return np.zeros(0, bool)
        masks = self.engine.storage.masks(self.keys(group, page_keys))
        return np.array([m is not None and (m >> group) & 1 == 1 for m in masks], bool)

    def leading_hits(self, group: int, page_keys: Sequence[PageKey]) -> int:
        """Pages stored from the first on (the hit of a pool every page of which is needed)."""
        found = self.present(group, page_keys)
        hit = int(np.argmin(found)) if not found.all() else len(found)
        with self._lock:
            self.counters.exists_queries += 1
            self.counters.exists_pages_queried += len(found)
            self.counters.exists_pages_hit += hit
        return hit

    # -- store -----------------------------------------------------------------------
    def store(self, group: int, page_keys: Sequence[PageKey], blocks) -> list[bool]:
        """Store page i of ``group`` from engine block ``blocks[i]``; True per page stored after the call."""
        blocks = self._blocks(group, blocks, len(page_keys))
        keys = self.keys(group, page_keys)
        existing = self.engine.storage.masks(keys)
        ok = [m is not None and (m >> group) & 1 == 1 for m in existing]
        todo = [i for i, done in enumerate(ok) if not done]
        slots = self.engine.storage.reserve(len(todo)) if todo else []
        writes = todo[: len(slots)]
        if writes:
            offsets = np.array([self.engine.pool.slot_offset(s) for s in slots], np.int64)
            tables = self._segments(group, blocks[writes], offsets).build()
            try:
                self.engine.gather_to_pool(tables)
            except BaseException:
                self.engine.storage.abort(slots)
                raise
            for i, slot in zip(writes, slots):
                header = ChunkHeader(
                    fingerprint=self.layout.fingerprint, key=keys[i], token_start=0, token_end=self.layout.groups[group].block_size,
                    group_mask=1 << group, plane_rows=self._plane_rows[group], payload_bytes=self._page_bytes[group],
                )
                self.engine.storage.commit(keys[i], header, slot)
                ok[i] = True
        with self._lock:
            self.counters.pages_stored += len(writes)
            self.counters.pages_already_stored += len(page_keys) - len(todo)
            self.counters.pages_not_stored += len(todo) - len(writes)
            self.counters.bytes_stored += len(writes) * self._page_bytes[group]
        return ok

    # -- load ------------------------------------------------------------------------
    def load(self, group: int, page_keys: Sequence[PageKey], blocks, *, leading_only: bool = True) -> list[bool]:
        """Load stored pages of ``group`` into engine blocks ``blocks[i]``; True per page loaded.

        ``leading_only``: stop at the first page that is missing or bad (what an engine that
        counts the leading run of successes can use); pages past it are not written.
        """
        blocks = self._blocks(group, blocks, len(page_keys))
        keys = self.keys(group, page_keys)
        storage = self.engine.storage
        entries = storage.acquire(keys)
        idx, bad = np.zeros(0, np.int64), []
        try:
            good = np.array([self._valid(group, e) for e in entries], bool)
            bad = [e for e, ok in zip(entries, good) if e is not None and not ok]
            for e in bad:
                logger.warning("kvconnect: a stored page does not match its pool's layout; dropping it (a miss)")
                storage.drop(e.key)
            if leading_only and not good.all():
                good[int(np.argmin(good)):] = False
            idx = np.flatnonzero(good)
            if len(idx):
                offsets = np.array([self.engine.pool.slot_offset(entries[i].slot) for i in idx], np.int64)
                tables = self._segments(group, blocks[idx], offsets).build()
                self.engine.scatter_from_pool(tables)
        finally:
            storage.release(entries)
        with self._lock:
            self.counters.pages_loaded += len(idx)
            self.counters.pages_missed += len(page_keys) - len(idx)
            self.counters.bytes_loaded += len(idx) * self._page_bytes[group]
            self.counters.pages_corrupt += len(bad)
        return good.tolist()

    def _valid(self, group: int, entry) -> bool:
        if entry is None:
            return False
        h = entry.header
        return ((h.group_mask >> group) & 1 == 1 and h.plane_rows == self._plane_rows[group]
                and h.payload_bytes == self._page_bytes[group] and h.token_start == 0
                and h.token_end == self.layout.groups[group].block_size)

    # -- helpers ---------------------------------------------------------------------
    def _blocks(self, group: int, blocks, n: int) -> np.ndarray:
        arr = np.asarray(blocks.detach().cpu().numpy() if hasattr(blocks, "detach") else blocks)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or len(arr) != n:
            raise BlockTableError(f"expected {n} page indices (1-D ints), got {arr.dtype} {arr.shape}")
        arr = arr.astype(np.int64)
        limit = self.layout.group_num_blocks(group)
        if n and (arr.min() < 0 or arr.max() >= limit):
            raise BlockTableError(f"group {group}: page index out of range [0, {limit})")
        return arr

    def _segments(self, group: int, blocks: np.ndarray, buffer_offsets: np.ndarray) -> SegmentBuilder:
        """Every plane of ``group`` for each page: rows [0, rpb) of block b <-> the page's chunk bytes."""
        rpb, planes = self._rpb[group], self._planes[group]
        builder = SegmentBuilder()
        base = builder.add_slots((blocks[:, None] * rpb + np.arange(rpb, dtype=np.int64)).ravel())
        plane_bytes = self.arrays.row_bytes[planes] * rpb
        plane_off = np.cumsum(plane_bytes) - plane_bytes  # chunk layout: plane-major in layout order
        n, k = len(blocks), len(planes)
        builder.add_segments(
            np.tile(planes, n), np.full(n * k, rpb, np.int64),
            np.repeat(base + np.arange(n, dtype=np.int64) * rpb, k),
            (buffer_offsets[:, None] + plane_off[None, :]).ravel(),
        )
        return builder


def restorable_prefixes(page_tokens: int, windows_pages: Sequence[Optional[int]], present: Sequence[Sequence[bool]]) -> list[int]:
    """Page counts P at which every pool can resume, by kvconnect's restore rule.

    ``windows_pages[g]``: None for a pool whose every page of [0, P) is needed (SGLang's
    ALL_PAGES), else the trailing pages it needs (TRAILING_PAGES). ``present[g][i]``: page
    i of pool g is stored. Pages are placed at relative positions of the query.
    """
    geos = [
        GroupGeometry.of(GroupSpec(block_size=page_tokens, sliding_window=None if w is None else w * page_tokens),
                         is_page=False, dcp=DCPSpec())
        for w in windows_pages
    ]
    n = min((len(p) for p in present), default=0)
    have = np.array([list(p[:n]) for p in present], bool).reshape(len(geos), n)
    legal = []
    for end in range(1, n + 1):
        ok = True
        for g, geo in enumerate(geos):
            lo, hi = geo.needed_rows(end * page_tokens)
            first, last = lo // page_tokens, -(-hi // page_tokens)
            if not have[g, first:last].all():
                ok = False
                break
        if ok:
            legal.append(end)
    return legal
