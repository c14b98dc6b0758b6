"""The node-level cache server: one shared CPU pool for every engine process on a node.

    kvconnect server --url ipc:///tmp/kvc.sock --size-gb 8      # once per node
    KVCONNECT_SERVER_URL=ipc:///tmp/kvc.sock <engine>            # every engine process

Modules, by who runs them:
- ``protocol``: frame schema, limits, HMAC (both sides).
- ``shm``: the shared-memory segment (server creates, clients map).
- ``allocator`` + ``index``: page runs, entries, LRU, per-client pins and leases (server).
- ``server``: the ZMQ loop (server). ``client``: ``SharedPoolClient``, the ``Pool`` contract
  over the shared segment, on ``session``'s ``ServerSession`` (hello, heartbeat, reconnect,
  the mapped segment, whose server to trust) (engine processes).

``make_pool`` is the pool factory that chooses between the in-process pool and the server:
``KVCacheEngine``'s default, so ``server_url`` in the configuration is enough. The package sits
beside ``restore`` on the floor under the engine (docs/design.md, "The map"): it imports
``config``, ``layout``, ``chunks`` and ``storage`` only, and this ``__init__`` imports no
ZMQ (``client`` is imported when a URL is set).
"""

from __future__ import annotations

from typing import Optional, Union

from ..config import Config
from ..layout.spec import Fingerprint
from ..storage.pool import ChunkPool
from ..storage.pool_protocol import private_pool

__all__ = ["make_pool", "close_pool"]


def make_pool(config: Config, slot_bytes: int, *, pin_memory: bool, fingerprint: Optional[Fingerprint] = None) -> Union[ChunkPool, "SharedPoolClient"]:  # noqa: F821
    """The engine's CPU pool: ``SharedPoolClient`` when ``config.server_url`` is set, else a
    private ``ChunkPool`` of ``config.private_pool_bytes`` (with ``local_cpu`` false: only the
    buffer the lower tiers go through, 0 without one, as in LMCache).

    In server mode the pool size is the server's (``--size-gb``); ``pin_memory`` page-locks
    the mapping with cudaHostRegister; every call is bounded by ``config.remote_timeout_s``.
    """
    if config.server_url:
        from .client import SharedPoolClient

        return SharedPoolClient(
            config.server_url, slot_bytes, token=config.server_token, timeout_s=config.remote_timeout_s,
            pin_memory=pin_memory, fingerprint=fingerprint,
        )
    return private_pool(config, slot_bytes, pin_memory=pin_memory, fingerprint=fingerprint)


def close_pool(pool) -> None:
    """End an engine's use of its pool: a private pool is emptied; a shared one is left to the
    other engines (this process's pins and reservations are released, its mapping dropped)."""
    pool.close()  # a private ChunkPool is emptied; a SharedPoolClient leaves the server's entries
