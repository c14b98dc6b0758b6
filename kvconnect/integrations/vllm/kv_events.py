"""kvconnect's chunk events through vLLM's connector KV-event interface.

vLLM publishes KV-cache events (``--kv-events-config``: its ZMQ publisher) for KV-aware
routers. A connector contributes through two calls: each worker returns a
``KVConnectorKVEvents`` from ``get_kv_connector_kv_cache_events()`` (it travels in the step's
``KVConnectorOutput``), and the scheduler-side connector receives it in
``update_connector_output`` and hands vLLM the events in ``take_events()``, which vLLM
publishes with its own.

Mapping (kvconnect.events -> vllm.distributed.kv_events), one event per chunk:

- stored  -> ``BlockStored``: ``block_hashes`` = [the chunk key] (converted as vLLM converts
  its own hashes, ``maybe_convert_block_hash``), ``parent_block_hash`` = the previous chunk's
  key, ``token_ids`` = the chunk's tokens, ``block_size`` = their number (the chunk size),
  ``extra_keys`` = [the chunk's multimodal extra keys as vLLM 0.32's own block events publish
  them (``to_event_extra_keys``: its block hash's ``("mm", identifier, offset)`` keys, untagged):
  a tuple of (item identifier, item offset - chunk start) pairs, or None for a text chunk]
  (vLLM releases whose ``BlockStored`` declares the field);
- removed -> ``BlockRemoved``;
- cleared (a reset) -> ``AllBlocksCleared``.

``medium`` is ``CPU`` for the CPU pool and ``STORAGE`` for a lower tier; ``ownership``
(vLLM: "secondary offloading tier identifier") names the tier: ``kvconnect-cpu``,
``kvconnect-disk``, ``kvconnect-redis``... Only worker 0 (TP rank 0, PP rank 0) reports:
every rank stores the same chunks of its own shard (keys differ per rank), and a router
needs each chunk once. Events are recorded only when vLLM's KV events are enabled.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from kvconnect.events import ChunkEvent

try:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # pragma: no cover - older vLLM

    def maybe_convert_block_hash(h):
        return h


# vLLM's medium names (``MEDIUM_CPU`` / ``MEDIUM_STORAGE`` from vLLM 0.32; vLLM 0.23 defines only
# ``MEDIUM_GPU`` and takes any string): the values, so every release gets the same events.
MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"


def _event(cls, **fields):
    """``cls(**fields)`` with only the fields this vLLM release's event declares (vLLM 0.23's
    events lack ``ownership``; newer ones add optional fields with defaults)."""
    declared = getattr(cls, "__struct_fields__", None)
    if declared is not None:
        fields = {k: v for k, v in fields.items() if k in declared}
    return cls(**fields)


def events_enabled(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


class KVConnectKVEvents(KVConnectorKVEvents):
    """vLLM events of one or more workers (only worker 0 contributes: see the module doc)."""

    def __init__(self, events: Optional[list[KVCacheEvent]] = None, num_workers: int = 1) -> None:
        self._events = list(events or [])
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> "KVConnectKVEvents":
        return self  # one reporting worker: nothing to reconcile

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


def _hash(key: bytes):
    return maybe_convert_block_hash(bytes(key))


def mm_extra_keys(extras) -> Optional[tuple]:
    """A chunk's (identifier, offset) pairs as vLLM's block events publish multimodal extra keys."""
    return tuple((identifier, offset) for identifier, offset in extras) if extras else None


def to_vllm(events: Iterable[ChunkEvent]) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for e in events:
        medium = MEDIUM_CPU if e.medium == "cpu" else MEDIUM_STORAGE
        owner = f"kvconnect-{e.medium}"
        if e.kind == "stored":
            out.append(_event(BlockStored, block_hashes=[_hash(e.key)],
                              parent_block_hash=_hash(e.parent) if e.parent else None,
                              token_ids=list(e.token_ids), block_size=len(e.token_ids), lora_id=None,
                              medium=medium, lora_name=None, ownership=owner,
                              extra_keys=[mm_extra_keys(e.extra_keys)]))
        elif e.kind == "removed":
            out.append(_event(BlockRemoved, block_hashes=[_hash(e.key)], medium=medium, ownership=owner))
        elif e.kind == "cleared":
            out.append(AllBlocksCleared())
    return out


class SchedulerEvents:
    """Scheduler side: events arriving with the workers' outputs, until vLLM takes them."""

    def __init__(self) -> None:
        self._pending: list[KVCacheEvent] = []

    def add(self, kv_connector_output: Any) -> None:
        events = getattr(kv_connector_output, "kv_cache_events", None)
        if isinstance(events, KVConnectorKVEvents):
            self._pending.extend(events.get_all_events())

    def take(self) -> list[KVCacheEvent]:
        out, self._pending = self._pending, []
        return out
