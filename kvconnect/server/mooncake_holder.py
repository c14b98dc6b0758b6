"""The node server as the node's Mooncake segment holder.

    holder = MooncakeHolder(spec.with_segment(segment_bytes))   # returns at once
    holder.status()     # {"master": ..., "segment_bytes": ..., "connected": ...}
    holder.close()

Mooncake keeps an object's bytes in the *segment* of a client process that contributed
memory (``global_segment_size``); the master only places objects and keeps metadata. If
engine processes contributed the segments, restarting an engine would erase its share of
the cache. ``kvconnect server --mooncake-segment-gb N`` makes the node server (one per
node, outliving engine restarts) contribute the node's memory instead; engines then
contribute nothing (their default when they use the node server) and read and write
through the transfer engine straight from and to their CPU pool.

The holder only contributes memory: it stores and reads nothing itself. It connects on a
background thread (with the master down, Mooncake's ``setup`` retries for ~90 s), so the
server's own start never waits for the master, and retries until the master answers.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from ..storage.mooncake_config import MooncakeSpec, connect_store, import_store

logger = logging.getLogger(__name__)


class MooncakeHolder:
    def __init__(self, spec: MooncakeSpec) -> None:
        """Contribute ``spec.global_segment_bytes`` to the store at ``spec.master_address``.

        Raises StorageError when Mooncake is not installed (a start-up configuration error).
        """
        self.spec = spec
        self._cls = import_store(spec)
        self._cond = threading.Condition()
        self._store = None
        self._closed = False
        self.attempts = 0
        self._thread = threading.Thread(target=self._connect, name="kvconnect-mooncake-holder", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        def wait_stop(seconds: float) -> bool:
            with self._cond:
                self.attempts += 1
                return self._cond.wait_for(lambda: self._closed, seconds)

        store = connect_store(self.spec, self._cls, wait_stop, logger.warning)
        if store is None:
            return
        with self._cond:
            if self._closed:
                store.close()
                return
            self._store = store
            self._cond.notify_all()
        logger.info("kvconnect server: holding a %d-byte Mooncake segment for master %s",
                    self.spec.global_segment_bytes, self.spec.master_address)

    def wait_connected(self, timeout_s: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._store is not None or self._closed, timeout_s) and self._store is not None

    def status(self) -> dict:
        with self._cond:
            connected = self._store is not None
            attempts = self.attempts
        return {"master": self.spec.master_address, "protocol": self.spec.protocol,
                "local_hostname": self.spec.local_hostname, "segment_bytes": self.spec.global_segment_bytes,
                "connected": connected, "connect_polls": attempts}

    def close(self) -> None:
        """Withdraw the segment (its objects vanish from the store) and stop connecting."""
        with self._cond:
            self._closed = True
            store, self._store = self._store, None
            self._cond.notify_all()
        if store is not None:
            store.close()
