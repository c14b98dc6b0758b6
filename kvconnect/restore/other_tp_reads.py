"""``OtherTPReader``: on a miss, a rank's chunks assembled from what ranks of other TP sizes wrote.

The restore scheme asks it (``fill``, through the engine's ``ShortHitFill``, engine.py) when a
lookup or a retrieve over this rank's own keys falls short of the prompt's last restore point,
and hands over what it found of this rank's own objects (``scheme.OwnObjects``): the reader
never asks for them again. It tries each
other TP size of ``Config.read_tp_sizes`` in turn (``other_tp.sources_at``): the writer ranks'
chunk keys (their fingerprint seeds the same chain: same tokens, namespace and generation),
their objects in the lower tiers (each writer's fingerprint is a directory of the disk tier, a
key prefix of Redis and Mooncake, read as a follower that never writes nor removes), and
``other_tp.assemble`` of this rank's part. Each assembled object is committed into the pool
under this rank's own key, header and fingerprint, as a promotion is: the ordinary restore then
reads it, and later lookups of this rank find it there. Nothing is queued for this rank's lower
tiers (the writers' copies are there).

Whole chunks (no window groups, or parts off): from the first chunk the pool and this rank's
tiers miss, the chunks every writer rank holds, until the first one no size holds (a prefix is
contiguous).

Restore points (window parts, parts.py: sliding windows, recurrent states): the writers' prefix
parts and window parts, found by the writers' own part layout (``other_tp.writer_layout``: its
pieces group planes by the writer's byte sizes). Only where they raise this rank's hit: the
restore gate over this rank's own parts and the writers' together gives the largest restore
point P; the prefix parts of [0, P) and the window part at P that this rank lacks are assembled
(every window piece of a chunk from all of the writers' pieces of it) and committed as this
rank's own pieces. While this rank's own parts reach the largest restore point the prompt has,
the reader is not asked at all.

Over the node server (``Config.server_url``) the writers' objects also live in the server's
pool, which keeps each layout under its own client: the reader opens one more client per
writer fingerprint (``pool_factory``, as the engine makes its own pool), reads only, and asks
it before the lower tiers.

Cost: nothing while this rank's own objects reach the prompt's last restore point; short of it
(a miss, or a prompt longer than what is stored), one ``masks`` call per place (node server,
lower tiers) per candidate size and writer rank for the chunks this rank lacks, then for the
objects found one read per writer rank (and writer piece), one copy of this rank's rows into
the pool, and the scheme's own masks once more (docs/performance.md, "Reads across TP sizes").
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import numpy as np

from ..chunks import chunk_format
from ..chunks.chunk_format import ChunkHeader
from ..chunks.keys import Chunk, ChunkKeyer, Namespace
from ..config import Config
from ..errors import CorruptChunkError
from ..layout.kv_layout import KVLayout
from ..layout.spec import ChunkKey
from ..storage.manager import StorageManager, open_tiers
from ..storage.pool_protocol import Pool, PoolFactory
from ..storage.tier import LowerTier
from .gate import effective_masks, restorable_boundary, window_chunks
from .other_tp import Sources, assemble, cross_readable, refusal, sources_at, writer_layout
from .parts import PartLayout, wide_planes, window_key
from .scheme import OwnObjects

logger = logging.getLogger(__name__)


def read_refusal(layout: KVLayout, config: Config, reader: "Optional[OtherTPReader]", tp_size: int) -> Optional[str]:
    """Why this rank's engine cannot restore what ranks of TP size ``tp_size`` stored, or None:
    the layout's own reasons (``other_tp.refusal``), then this engine's where the writers'
    objects need translating (``sources_at``): a size ``read_tp_sizes`` leaves out, a writer whose
    window planes would travel in column slices (a wide plane of its byte sizes), or no node
    server or lower tier to read them from (``reader`` None)."""
    why = refusal(layout, tp_size)
    if why is not None or sources_at(layout, tp_size) is None:
        return why  # None: the same size, TP-free groups, or the writers' objects are this rank's own
    if tp_size not in config.other_tp_sizes:
        return f"read_tp_sizes (KVCONNECT_READ_TP_SIZES) does not list TP {tp_size}"
    if reader is None or all(s.tp_size != tp_size for s in reader.sources):
        if reader is not None and tp_size in reader.sliced_sizes:
            return (f"at TP {tp_size} a writer's window planes are wider than its pool slot and travel in column "
                    "slices, which are not cut into another size's ranges")
        return "no node server or lower tier to read another TP size's objects from"
    return None


class OtherTPReader:
    def __init__(self, layout: KVLayout, config: Config, storage: StorageManager, parts: PartLayout,
                 pool_factory: Optional[PoolFactory] = None) -> None:
        self.layout = layout
        self.config = config
        self.storage = storage
        self.parts = parts
        # the node server's pool, read per writer fingerprint (None: no node server)
        self.pool_factory = pool_factory if storage.pool.shared else None
        self.sources: list[Sources] = []
        self.writer_parts: dict[int, PartLayout] = {}  # per TP size: how its writers split a chunk
        self.sliced_sizes: list[int] = []
        for size in config.other_tp_sizes:
            sources = sources_at(layout, size) if size != layout.tp_size else None
            if sources is None:
                continue
            theirs = writer_layout(layout, sources.shards[0])  # the ranks of one size hold equal byte sizes
            if wide_planes(theirs, config.chunk_size, split=parts.split):
                self.sliced_sizes.append(size)
                continue
            self.sources.append(sources)
            self.writer_parts[size] = PartLayout.of(theirs, config.chunk_size, split=parts.split)
        self.prefix_planes = np.array([(parts.prefix_mask >> p.group_index) & 1 == 1 for p in layout.planes], np.bool_)
        self.piece_planes = parts.piece_planes(len(layout.planes))
        self._tiers: dict[bytes, list[LowerTier]] = {}
        self._lock = threading.Lock()
        self._fill_lock = threading.Lock()  # a lookup thread and a retrieve may fill at once: one at a time
        self.assembled_chunks = 0  # whole chunks or prefix parts committed from other TP sizes' objects
        self.assembled_window_parts = 0  # window parts (every piece of a chunk) committed from them
        self.assembled_bytes = 0
        self.probes = 0  # masks calls to the writers' places (node server, lower tiers)

    @classmethod
    def of(cls, layout: KVLayout, config: Config, storage: StorageManager, parts: PartLayout,
           pool_factory: Optional[PoolFactory] = None) -> "Optional[OtherTPReader]":
        """A reader where another TP size's objects can serve this layout: head-sharded or
        range-split groups, a node server or a lower tier to find them in, and at least one other
        size that splits them."""
        shared_pool = storage.pool.shared and pool_factory is not None
        if not (config.has_lower_tier or shared_pool) or not cross_readable(layout):
            return None
        reader = cls(layout, config, storage, parts, pool_factory)
        return reader if reader.sources or reader.sliced_sizes else None

    def tiers_of(self, fingerprint: bytes, slot_bytes: int) -> list:
        """Where a writer's objects are, opened once: the node server's pool under the writer's
        fingerprint (``PoolReader``, slots of the writer's largest object), then the lower tiers
        as a follower (reads only)."""
        with self._lock:
            tiers = self._tiers.get(fingerprint)
            if tiers is None:
                tiers = []
                if self.pool_factory is not None:
                    slot = max(self.storage.pool.slot_bytes, slot_bytes)
                    tiers.append(PoolReader(self.pool_factory(self.config, slot, pin_memory=False,
                                                              fingerprint=fingerprint)))
                tiers += open_tiers(self.config, fingerprint, writes_shared=False)
                self._tiers[fingerprint] = tiers
            return tiers

    def fill(self, tokens: np.ndarray, chunks: Sequence[Chunk], namespace: Namespace, generation: bytes,
             own: OwnObjects) -> int:
        """Commit what other TP sizes hold beyond this rank's own objects (``own``: what the restore
        scheme found of them, short of the prompt's last restore point); returns the chunks (whole,
        prefix parts and window parts) committed."""
        if not chunks or not self.sources:
            return 0
        with self._fill_lock:
            if self.parts.split:
                return self._fill_parts(tokens, list(chunks), namespace, generation, own)
            return self._fill(tokens, chunks, namespace, generation, own)

    def _writer_keys(self, sources: Sources, tokens, chunks: Sequence[Chunk], namespace, generation) -> list[list[ChunkKey]]:
        bounds = [(c.start, c.end) for c in chunks]
        return [ChunkKeyer(fp, self.config.chunk_size, generation=generation).keys(tokens, bounds, namespace,
                                                                                   [c.extras for c in chunks])
                for fp in sources.fingerprints]

    # -- whole chunks ------------------------------------------------------------------
    def _fill(self, tokens: np.ndarray, chunks: Sequence[Chunk], namespace: Namespace, generation: bytes,
              own: OwnObjects) -> int:
        start = next((i for i, m in enumerate(own.prefix) if m is None), None)
        if start is None:
            return 0
        for sources in self.sources:
            done = self._fill_from(sources, tokens, chunks, start, namespace, generation)
            if done:
                return done
        return 0

    def _fill_from(self, sources: Sources, tokens, chunks, start: int, namespace, generation) -> int:
        keys = [k[start:] for k in self._writer_keys(sources, tokens, chunks, namespace, generation)]
        found = [self._present(sources, fp, k) for fp, k in zip(sources.fingerprints, keys)]
        run = 0  # chunks from ``start`` on that every writer rank holds
        while run < len(chunks) - start and all(f[run] for f in found):
            run += 1
        done = 0
        for j in range(run):
            objects = [self._get(sources, fp, k[j]) for fp, k in zip(sources.fingerprints, keys)]
            if any(o is None for o in objects):
                break
            built = assemble(self.layout, sources, [[o] for o in objects])
            if built is None or not self._commit(chunks[start + j], chunks[start + j].key, built):
                break
            done += 1
        with self._lock:
            self.assembled_chunks += done
        return done

    # -- restore points: prefix parts and window parts --------------------------------------
    def _fill_parts(self, tokens, chunks: list[Chunk], namespace, generation, own: OwnObjects) -> int:
        want = self.parts.prefix_mask  # a prefix part lacking one of its groups is no part here
        prefix = [m if m is not None and m & want == want else None for m in own.prefix]
        for sources in self.sources:
            done = self._fill_parts_from(sources, tokens, chunks, namespace, generation, prefix, own)
            if done:
                return done
        return 0

    def _fill_parts_from(self, sources: Sources, tokens, chunks: list[Chunk], namespace, generation,
                         own_prefix: list[Optional[int]], own: OwnObjects) -> int:
        """``own_prefix``: this rank's whole prefix parts (None: lacking); ``own``: the rest of what
        the scheme found (its window parts, hit and masked prefix)."""
        own_window, present_below = own.window, own.present_below
        parts, theirs = self.parts, self.writer_parts[sources.tp_size]
        keys = self._writer_keys(sources, tokens, chunks, namespace, generation)
        prefix = list(own_prefix)
        lacking = [i for i, m in enumerate(own_prefix) if m is None]
        if lacking:
            found = [self._present(sources, fp, [k[i] for i in lacking]) for fp, k in zip(sources.fingerprints, keys)]
            for n, i in enumerate(lacking):
                if all(f[n] for f in found):
                    prefix[i] = parts.prefix_mask
        run = next((i for i, m in enumerate(prefix) if m is None), len(chunks))
        window = list(own_window)
        # window parts that can raise the hit: of restore points past it, and the chunks their windows reach back to
        reach = max((g.window_tokens or 0) for g in self.layout.geometries)
        wanted = [i for i in range(run) if not own_window[i] and chunks[i].end > max(own.hit - reach, present_below)]
        npieces = len(theirs.pieces)
        if wanted:
            for fp, k in zip(sources.fingerprints, keys):
                masks = self._masks(sources, fp, [window_key(k[i], p) for i in wanted for p in range(npieces)])
                for n, i in enumerate(wanted):
                    got = _all_pieces(masks[n * npieces:(n + 1) * npieces], parts.window_mask)
                    window[i] = got if fp == sources.fingerprints[0] else window[i] & got
        best = restorable_boundary(self.layout, chunks, effective_masks(prefix, window), present_below=present_below)
        if best <= own.hit:
            return 0
        k = next(c.index for c in chunks if c.end == best)
        done = 0
        for i in range(k + 1):  # the prefix parts of [0, P) this rank lacks
            if own_prefix[i] is not None:
                continue
            objects = [self._get(sources, fp, key[i]) for fp, key in zip(sources.fingerprints, keys)]
            built = None if any(o is None for o in objects) else assemble(
                self.layout, sources, [[o] for o in objects], self.prefix_planes)
            if built is None or not self._commit(chunks[i], chunks[i].key, built):
                return self._counted(done, 0)
            done += 1
        windows = 0
        for j in window_chunks(self.layout, parts.window_mask, chunks, k):  # the window part at P
            if own_window[j] or chunks[j].end <= present_below:
                continue
            objects = [[self._get(sources, fp, window_key(key[j], p)) for p in range(npieces)]
                       for fp, key in zip(sources.fingerprints, keys)]
            if any(o is None for mine in objects for o in mine):
                break
            built = [assemble(self.layout, sources, objects, sel) for sel in self.piece_planes]
            if any(b is None for b in built) or not all(
                    self._commit(chunks[j], window_key(chunks[j].key, p), b) for p, b in enumerate(built)):
                break
            windows += 1
        return self._counted(done, windows)

    def _counted(self, prefix_parts: int, window_parts: int) -> int:
        with self._lock:
            self.assembled_chunks += prefix_parts
            self.assembled_window_parts += window_parts
        return prefix_parts + window_parts

    # -- the writers' objects ----------------------------------------------------------
    def _slot_bytes(self, sources: Sources) -> int:
        theirs = self.writer_parts[sources.tp_size]
        return theirs.slot_bytes

    def _masks(self, sources: Sources, fingerprint: bytes, keys: list) -> list[Optional[int]]:
        """Each key's group mask in the first place that holds it (None: nowhere)."""
        out: list[Optional[int]] = [None] * len(keys)
        for tier in self.tiers_of(fingerprint, self._slot_bytes(sources)):
            missing = [i for i, m in enumerate(out) if m is None]
            if not missing or not tier.healthy():
                continue
            try:
                with self._lock:
                    self.probes += 1
                masks = tier.masks([keys[i] for i in missing])
            except Exception:  # tiers promise not to raise; a bug must not reach the engine
                logger.exception("kvconnect: the %s tier raised; treating it as a miss", tier.name)
                continue
            for i, m in zip(missing, masks):
                out[i] = m
        return out

    def _present(self, sources: Sources, fingerprint: bytes, keys: list) -> list[bool]:
        return [m is not None for m in self._masks(sources, fingerprint, keys)]

    def _get(self, sources: Sources, fingerprint: bytes, key) -> Optional[tuple[ChunkHeader, memoryview]]:
        for tier in self.tiers_of(fingerprint, self._slot_bytes(sources)):
            if not tier.healthy():
                continue
            try:
                (data,) = tier.get([key])
            except Exception:
                logger.exception("kvconnect: the %s tier raised; treating it as a miss", tier.name)
                continue
            if data is None:
                continue
            try:  # verified by the tier; checked again against the writer's identity
                return chunk_format.decode(data, fingerprint=fingerprint, key=key)
            except CorruptChunkError:
                continue
        return None

    def _commit(self, chunk: Chunk, key: ChunkKey, built) -> bool:
        """One assembled object into the pool under this rank's ``key`` (a chunk key or a piece's)."""
        plane_rows, payload, group_mask = built
        pool = self.storage.pool
        if len(payload) > pool.slot_bytes:
            return False
        slots = pool.reserve(1)
        if not slots:
            return False
        pool.slot_view(slots[0])[: len(payload)].numpy()[:] = payload
        header = ChunkHeader(fingerprint=self.layout.fingerprint, key=key, token_start=chunk.start,
                             token_end=chunk.end, group_mask=group_mask, plane_rows=plane_rows,
                             payload_bytes=len(payload))
        pool.commit(key, header, slots[0])
        with self._lock:
            self.assembled_bytes += len(payload)
        return True

    def close(self) -> None:
        with self._lock:
            tiers = [t for ts in self._tiers.values() for t in ts]
            self._tiers.clear()
        for tier in tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("kvconnect: closing the %s tier failed", tier.name)


def _all_pieces(masks: Sequence[Optional[int]], window_mask: int) -> int:
    """The window groups every piece holds; 0 unless every piece is present."""
    out = window_mask
    for m in masks:
        out = out & m if m is not None else 0
    return out


class PoolReader:
    """Reads of the node server's pool under a writer's fingerprint, in the tiers' terms
    (``masks``, ``get`` of encoded, checksummed chunks). The client verifies each entry's
    checksum on its first acquire; it is released at once (the bytes are copied out)."""

    name = "server"

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def healthy(self) -> bool:
        return True

    def masks(self, keys) -> list[Optional[int]]:
        return self.pool.masks(keys)

    def get(self, keys) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for entry in self.pool.acquire(list(keys), touch=False):
            if entry is None:
                out.append(None)
                continue
            try:
                out.append(chunk_format.encode(entry.header, self.pool.entry_view(entry).numpy()))
            finally:
                self.pool.release([entry])
        return out

    def close(self) -> None:
        self.pool.close()
