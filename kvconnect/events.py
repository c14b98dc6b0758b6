"""Chunk events: what an engine's tiers gained and lost, for KV-aware routers.

An adapter that forwards events (vLLM's connector KV-event interface) turns them on with
``KVCacheEngine.enable_events()``; until then nothing is recorded and nothing costs. Events,
in the order they happened:

    ChunkEvent("stored",  key, parent, token_ids, medium, extra_keys)   a chunk landed in a tier
    ChunkEvent("removed", key, None, (), medium)            a tier evicted or dropped it
    ChunkEvent("cleared", b"", None, (), "")                the engine was reset: nothing it
                                                            held before is served any more

``medium`` is ``"cpu"`` for the CPU pool, else the lower tier's name (``"disk"``,
``"redis"``, ...). ``parent`` is the key of the chunk before it in its prompt (None for the
first chunk), ``token_ids`` the chunk's tokens, ``extra_keys`` what besides them entered its
key (the multimodal items it covers, as (identifier, offset from the chunk's start) pairs:
kvconnect/chunks/extra_keys.py; empty for a text chunk): a router rebuilds prefixes from
these. A tier write learns them from the pool's earlier ``stored`` event of the key (a chunk promoted from
a lower tier and written upward has no tokens known: empty). The log is bounded: past
``max_events`` undrained events the oldest are dropped and counted in ``dropped`` (a stalled
consumer must never grow memory).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

MAX_EVENTS = 100_000
_KNOWN_CHUNKS = 65_536  # identities remembered for the lower tiers' events


@dataclass(frozen=True)
class ChunkEvent:
    kind: str  # "stored" | "removed" | "cleared"
    key: bytes
    parent: Optional[bytes]
    token_ids: tuple[int, ...]
    medium: str
    extra_keys: tuple[tuple[str, int], ...] = ()  # the chunk's multimodal extra keys (empty: none)


class ChunkEventLog:
    """Thread-safe, bounded event buffer; ``drain()`` takes everything recorded so far."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self._lock = threading.Lock()
        self._events: "collections.deque[ChunkEvent]" = collections.deque(maxlen=max_events)
        self._chunks: "collections.OrderedDict[bytes, tuple[Optional[bytes], tuple[int, ...], tuple]]" = collections.OrderedDict()
        self.dropped = 0

    def stored(self, medium: str, chunks: Sequence[tuple]) -> None:
        """``chunks``: (key, parent key, token ids[, extra keys]) of each chunk stored in ``medium``."""
        with self._lock:
            for key, parent, tokens, *extras in chunks:
                ident = (parent, tuple(int(t) for t in tokens), tuple(extras[0]) if extras else ())
                self._chunks[key] = ident
                self._chunks.move_to_end(key)
                self._append(ChunkEvent("stored", key, ident[0], ident[1], medium, ident[2]))
            while len(self._chunks) > _KNOWN_CHUNKS:
                self._chunks.popitem(last=False)

    def stored_keys(self, medium: str, keys: Sequence[bytes]) -> None:
        """Chunks written to a lower tier, by key only (their tokens as the pool recorded them)."""
        with self._lock:
            for key in keys:
                parent, tokens, extras = self._chunks.get(key, (None, (), ()))
                self._append(ChunkEvent("stored", key, parent, tokens, medium, extras))

    def removed(self, medium: str, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._append(ChunkEvent("removed", key, None, (), medium))

    def cleared(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._append(ChunkEvent("cleared", b"", None, (), ""))

    def drain(self) -> list[ChunkEvent]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def _append(self, event: ChunkEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)
