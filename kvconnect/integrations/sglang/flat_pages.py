"""SGLang's generic storage API (``batch_set`` / ``batch_get`` with flat page tensors).

Without ``"interface_v1": 1`` in the extra config SGLang hands the backend one standalone
tensor per page (``host_pool.get_data_page(i, flat=True)``, the pool's own byte order) and
asks for pages back into ``get_dummy_flat_data_page()`` tensors. These bytes are not in the
plane order of ``PageStore`` pages, so they are kept apart: their keys are SGLang's page
keys folded in a ``flat`` namespace of the same layout, the payload is one plane of
``page_bytes`` (the header says so), and they go through the same chunk format, checksum,
pool and tiers. One memcpy per page is inherent to this API (SGLang passes a list of
tensors); ``interface_v1`` avoids it and is what docs/sglang.md recommends.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from kvconnect.chunks.chunk_format import ChunkHeader
from kvconnect.engine import KVCacheEngine
from kvconnect.chunks.page_keys import PageKeyFolder

logger = logging.getLogger(__name__)


class FlatPages:
    def __init__(self, engine: KVCacheEngine, pool, page_bytes: int) -> None:
        self.engine = engine
        self.page_bytes = int(page_bytes)
        self.page_tokens = int(pool.page_size)
        self._folder = PageKeyFolder(engine.layout.fingerprint, self.page_tokens, namespace="sglang-flat-page")
        planes = len(engine.layout.planes)
        # a flat page claims no plane rows: PageStore never accepts it as a plane-ordered page
        self._rows = tuple((0, 0) for _ in range(planes))
        if self.page_bytes > engine.pool.slot_bytes:
            raise ValueError(f"flat page of {self.page_bytes} bytes exceeds the pool's {engine.pool.slot_bytes}-byte slots")

    def _header(self, key) -> ChunkHeader:
        return ChunkHeader(fingerprint=self.engine.layout.fingerprint, key=key, token_start=0, token_end=self.page_tokens,
                           group_mask=0, plane_rows=self._rows, payload_bytes=self.page_bytes)

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().view(-1).view(torch.uint8)

    def leading_hits(self, keys: Sequence[str]) -> int:
        masks = self.engine.storage.masks(self._folder.fold(keys))
        return next((i for i, m in enumerate(masks) if m is None), len(keys))

    def set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        storage = self.engine.storage
        folded = self._folder.fold(keys)
        present = storage.masks(folded)
        ok = [m is not None for m in present]
        todo = [i for i, done in enumerate(ok) if not done]
        slots = storage.reserve(len(todo)) if todo else []
        for i, slot in zip(todo, slots):
            data = self._bytes(values[i])
            if data.numel() != self.page_bytes:
                logger.error("kvconnect: flat page of %d bytes, expected %d; not stored", data.numel(), self.page_bytes)
                storage.abort([slot])
                continue
            self.engine.pool.slot_view(slot)[: self.page_bytes].copy_(data)
            storage.commit(folded[i], self._header(folded[i]), slot)
            ok[i] = True
        return ok

    def get(self, keys: Sequence[str], targets: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        storage = self.engine.storage
        folded = self._folder.fold(keys)
        entries = storage.acquire(folded)
        out: list[Optional[torch.Tensor]] = [None] * len(keys)
        try:
            for i, e in enumerate(entries):
                if e is None:
                    break  # SGLang uses the leading run
                h = e.header
                if h.payload_bytes != self.page_bytes or h.group_mask != 0 or h.plane_rows != self._rows:
                    storage.drop(e.key)
                    break
                dst = targets[i]
                view = self._bytes(dst) if dst.is_contiguous() else None
                if view is None or view.numel() != self.page_bytes:
                    break
                view.copy_(self.engine.pool.entry_view(e))
                out[i] = dst
        finally:
            storage.release(entries)
        return out
