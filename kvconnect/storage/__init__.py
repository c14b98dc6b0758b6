"""Storage tiers. ``ChunkPool`` is the CPU pool (L1); ``StorageManager`` fronts all tiers;
the lower tiers are ``disk``, ``redis_tier`` and the ``mooncake`` package."""

from .manager import StorageManager
from .pool import ChunkPool, PoolEntry

__all__ = ["ChunkPool", "PoolEntry", "StorageManager"]
