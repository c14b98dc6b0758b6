"""kvconnect: KV-cache offload and connector library for LLM serving engines.

Engine-neutral core for hybrid, multi-group KV caches. Start with::

    from kvconnect import KVCacheEngine, KVLayout, GroupSpec, Config
"""

from .config import Config
from .engine import KVCacheEngine
from .engine_stats import EngineStats
from .errors import (
    BlockTableError,
    ConfigError,
    CorruptChunkError,
    KVConnectError,
    LayoutError,
    StorageError,
    TokenError,
    TransferError,
)
from .layout.kv_layout import FORMAT_VERSION, KVLayout
from .layout.slots import block_ids_from_slot_mapping
from .layout.spec import ChunkKey, DCPSpec, Fingerprint, GroupKind, GroupSpec, PlaneSpec

__version__ = "0.1.0"

__all__ = [
    "BlockTableError", "ChunkKey", "Config", "ConfigError", "CorruptChunkError", "DCPSpec", "EngineStats",
    "FORMAT_VERSION", "Fingerprint", "GroupKind", "GroupSpec", "KVCacheEngine", "KVConnectError", "KVLayout",
    "LayoutError", "PlaneSpec", "StorageError", "TokenError", "TransferError", "block_ids_from_slot_mapping",
]
