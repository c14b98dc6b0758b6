"""``OtherTPReader``: on a miss, a rank's chunks assembled from what ranks of other TP sizes wrote.

The engine asks it before a lookup or a retrieve over its own keys (engine.py). For the
chunks of the prompt that neither the pool nor this rank's tiers hold, from the first such
chunk on, it tries each other TP size of ``Config.read_tp_sizes`` in turn
(``other_tp.sources_at``): the writer ranks' chunk keys (their fingerprint seeds the same
chain: same tokens, namespace and generation), their objects in the lower tiers (each
writer's fingerprint is a directory of the disk tier, a key prefix of Redis and Mooncake,
read as a follower that never writes nor removes), and ``other_tp.assemble`` of this rank's
heads. Each assembled chunk is committed into the pool under this rank's own key, header and
fingerprint, as a promotion is: the ordinary restore then reads it, and later lookups of
this rank find it there. Nothing is queued for this rank's lower tiers (the writers' copies
are there). It stops at the first chunk no size holds whole (a prefix is contiguous).

Over the node server (``Config.server_url``) the writers' objects also live in the server's
pool, which keeps each layout under its own client: the reader opens one more client per
writer fingerprint (``pool_factory``, as the engine makes its own pool), reads only, and asks
it before the lower tiers.

Cost: nothing while this rank's own objects hit (the chunks of the hit are never looked at);
on a miss, one ``masks`` call per place (node server, lower tiers) per candidate size and
writer rank, then for the chunks found one read per writer rank and one copy of this rank's
rows into the pool (docs/performance.md, "Reads across TP sizes").
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
from ..storage.manager import StorageManager, open_tiers
from ..storage.pool_protocol import Pool, PoolFactory
from .other_tp import Sources, assemble, cross_readable, refusal, sources_at

logger = logging.getLogger(__name__)


def read_refusal(layout: KVLayout, config: Config, reader: "Optional[OtherTPReader]", tp_size: int, *,
                 window_parts: bool) -> Optional[str]:
    """Why this rank's engine cannot restore what ranks of TP size ``tp_size`` stored, or None:
    the layout's own reasons (``other_tp.refusal``), then this engine's where the writers'
    objects need translating (``sources_at``): window pieces (``window_parts``: only
    whole-chunk objects are read across sizes), a size ``read_tp_sizes`` leaves out, or no
    node server or lower tier to read them from (``reader`` None)."""
    why = refusal(layout, tp_size)
    if why is not None or sources_at(layout, tp_size) is None:
        return why  # None: the same size, TP-free groups, or the writers' objects are this rank's own
    if window_parts:
        return ("its window groups are stored in window pieces, whose planes group by byte sizes that differ with "
                "the TP size (only whole-chunk objects are read across sizes)")
    if tp_size not in config.other_tp_sizes:
        return f"read_tp_sizes (KVCONNECT_READ_TP_SIZES) does not list TP {tp_size}"
    if reader is None or all(s.tp_size != tp_size for s in reader.sources):
        return "no node server or lower tier to read another TP size's objects from"
    return None


class OtherTPReader:
    def __init__(self, layout: KVLayout, config: Config, storage: StorageManager,
                 pool_factory: Optional[PoolFactory] = None) -> None:
        self.layout = layout
        self.config = config
        self.storage = storage
        # the node server's pool, read per writer fingerprint (None: no node server)
        self.pool_factory = pool_factory if storage.pool.shared else None
        self.sources: list[Sources] = [s for size in config.other_tp_sizes if size != layout.tp_size
                                       for s in [sources_at(layout, size)] if s is not None]
        self._tiers: dict[bytes, list[LowerTier]] = {}
        self._lock = threading.Lock()
        self._fill_lock = threading.Lock()  # a lookup thread and a retrieve may fill at once: one at a time
        self.assembled_chunks = 0  # chunks committed from other TP sizes' objects
        self.assembled_bytes = 0

    @classmethod
    def of(cls, layout: KVLayout, config: Config, storage: StorageManager,
           pool_factory: Optional[PoolFactory] = None) -> "Optional[OtherTPReader]":
        """A reader where another TP size's objects can serve this layout: head-sharded groups,
        a node server or a lower tier to find them in, and at least one other size that splits the heads."""
        shared_pool = storage.pool.shared and pool_factory is not None
        if not (config.has_lower_tier or shared_pool) or not cross_readable(layout):
            return None
        reader = cls(layout, config, storage, pool_factory)
        return reader if reader.sources else None

    def tiers_of(self, fingerprint: bytes) -> list:
        """Where a writer's objects are, opened once: the node server's pool under the writer's
        fingerprint (``PoolReader``), then the lower tiers as a follower (reads only)."""
        with self._lock:
            tiers = self._tiers.get(fingerprint)
            if tiers is None:
                tiers = []
                if self.pool_factory is not None:
                    # a writer's payload holds at most every head: total / count times this rank's
                    slot = self.storage.pool.slot_bytes * max(s.total // s.count for s in self.layout.shards)
                    tiers.append(PoolReader(self.pool_factory(self.config, slot, pin_memory=False,
                                                              fingerprint=fingerprint)))
                tiers += open_tiers(self.config, fingerprint, writes_shared=False)
                self._tiers[fingerprint] = tiers
            return tiers

    def fill(self, tokens: np.ndarray, chunks: Sequence[Chunk], namespace: Namespace, generation: bytes) -> int:
        """Commit the chunks after this rank's own stored run that other TP sizes hold; returns how many."""
        if not chunks:
            return 0
        with self._fill_lock:
            return self._fill(tokens, chunks, namespace, generation)

    def _fill(self, tokens: np.ndarray, chunks: Sequence[Chunk], namespace: Namespace, generation: bytes) -> int:
        masks = self.storage.masks([c.key for c in chunks])
        start = next((i for i, m in enumerate(masks) if m is None), None)
        if start is None:
            return 0
        bounds = [(c.start, c.end) for c in chunks]
        for sources in self.sources:
            done = self._fill_from(sources, tokens, bounds, chunks, start, namespace, generation)
            if done:
                return done
        return 0

    def _fill_from(self, sources: Sources, tokens, bounds, chunks, start: int, namespace, generation) -> int:
        keys = [ChunkKeyer(fp, self.config.chunk_size, generation=generation).keys(tokens, bounds, namespace, [c.extras for c in chunks])[start:]
                for fp in sources.fingerprints]
        found = [self._present(fp, k) for fp, k in zip(sources.fingerprints, keys)]
        run = 0  # chunks from ``start`` on that every writer rank holds
        while run < len(chunks) - start and all(f[run] for f in found):
            run += 1
        done = 0
        for j in range(run):
            objects = [self._get(fp, k[j]) for fp, k in zip(sources.fingerprints, keys)]
            if any(o is None for o in objects) or not self._commit(chunks[start + j], sources, objects):
                break
            done += 1
        return done

    def _present(self, fingerprint: bytes, keys: list) -> list[bool]:
        present = [False] * len(keys)
        for tier in self.tiers_of(fingerprint):
            missing = [i for i, p in enumerate(present) if not p]
            if not missing or not tier.healthy():
                continue
            try:
                masks = tier.masks([keys[i] for i in missing])
            except Exception:  # tiers promise not to raise; a bug must not reach the engine
                logger.exception("kvconnect: the %s tier raised; treating it as a miss", tier.name)
                continue
            for i, m in zip(missing, masks):
                present[i] = m is not None
        return present

    def _get(self, fingerprint: bytes, key) -> Optional[tuple[ChunkHeader, memoryview]]:
        for tier in self.tiers_of(fingerprint):
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

    def _commit(self, chunk: Chunk, sources: Sources, objects) -> bool:
        built = assemble(self.layout, sources, [h for h, _ in objects], [p for _, p in objects])
        if built is None:
            return False
        plane_rows, payload = built
        pool = self.storage.pool
        if len(payload) > pool.slot_bytes:
            return False
        slots = pool.reserve(1)
        if not slots:
            return False
        pool.slot_view(slots[0])[: len(payload)].numpy()[:] = payload
        header = ChunkHeader(fingerprint=self.layout.fingerprint, key=chunk.key, token_start=chunk.start,
                             token_end=chunk.end, group_mask=objects[0][0].group_mask, plane_rows=plane_rows,
                             payload_bytes=len(payload))
        pool.commit(chunk.key, header, slots[0])
        with self._lock:
            self.assembled_chunks += 1
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
