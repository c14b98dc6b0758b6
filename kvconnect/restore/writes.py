"""The write path: store plans -> one gather into pool slots -> headers committed.

``ObjectWriter.write`` is what both ways of storing (``whole_chunks``, ``window_parts``)
end in: it never shrinks a stored object to fewer groups, pins the prompt's own objects
while the pool makes room, and returns what it wrote (a prefix of what was asked when the
pool had too few free slots).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ..chunks.chunk_format import ChunkHeader
from ..chunks.keys import Chunk
from ..layout.kv_layout import KVLayout
from ..storage.manager import StorageManager
from .plan import StorePlan, store_segments

Prompt = tuple[np.ndarray, Sequence[Chunk]]  # (token ids, every chunk of them): what a chunk event names


class ObjectWriter:
    """Writes ``(plan, key)`` objects into the pool of ``storage`` with ``gather`` (segment
    tables -> pool buffer, on the store's threads and transfer route)."""

    def __init__(self, layout: KVLayout, storage: StorageManager, gather: Callable[[object], None]) -> None:
        self.layout = layout
        self.storage = storage
        self.gather = gather
        self.check = None  # a verify.RowCheck when restores are verified: present objects awaiting a check are compared

    def write(self, objects: list[tuple[StorePlan, bytes]], existing: list[Optional[int]]) -> list[tuple[StorePlan, bytes]]:
        """Gather and commit ``objects`` in order, skipping those stored with a superset of
        their groups (``existing``: the stored group mask of each, None: absent); returns
        those written."""
        pool = self.storage.pool
        # rewrite a stored object only when the new one holds strictly more groups: a re-store
        # with fewer groups (window blocks already freed) must not shrink a good entry
        todo = [(p, k) for (p, k), m in zip(objects, existing) if m is None or (m != p.group_mask and (m & p.group_mask) == m)]
        if self.check is not None:  # verified restores (verify.py): the fresh rows of what is already stored
            awaited = [((p, k), m) for (p, k), m in zip(objects, existing) if self.check.wanted(p)]
            for (p, _), m in awaited:
                if m is None:
                    self.check.verifier.unverifiable(p.chunk, p.group_mask)
            self.check.check([o for o, m in awaited if m is not None])
            if self.check.verifier.retired:  # a mismatch: this layout's rows are not what it would store
                return []
        # pin the objects of this prompt already in the pool while making room: eviction must
        # not drop the prompt's own prefix to store its suffix (a pin, not a use)
        held = pool.acquire([k for (_, k), m in zip(objects, existing) if m is not None], touch=False) if todo else []
        try:
            slots = self.storage.reserve(len(todo))
        finally:
            pool.release(held)
        writes = todo[: len(slots)]
        if len(slots) > len(writes):
            self.storage.abort(slots[len(writes):])
        if writes:
            builder = store_segments(self.layout, [p for p, _ in writes], [pool.slot_offset(s) for s in slots])
            try:
                self.gather(builder.build())
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


def chunk_identity(chunk: Chunk, prompt: Optional[Prompt]) -> tuple[bytes, Optional[bytes], np.ndarray, tuple]:
    """(key, parent key, token ids, extra keys) of a stored chunk for its event; no tokens when unknown."""
    if prompt is None:
        return bytes(chunk.key), None, np.zeros(0, np.int64), chunk.extras
    tokens, every = prompt
    parent = bytes(every[chunk.index - 1].key) if chunk.index > 0 else None
    return bytes(chunk.key), parent, tokens[chunk.start : chunk.end], chunk.extras
