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
from typing import Optional

from ..storage.mooncake.config import MooncakeSpec
from ..storage.mooncake.link import MooncakeLink

logger = logging.getLogger(__name__)


class MooncakeHolder:
    def __init__(self, spec: MooncakeSpec) -> None:
        """Contribute ``spec.global_segment_bytes`` to the store at ``spec.master_address``.

        Raises StorageError when Mooncake is not installed (a start-up configuration error).
        The connection is the tier's (``MooncakeLink``): same probing, setup retries and close.
        """
        self.spec = spec
        self._link = MooncakeLink(spec, name="segment holder", adopt=self._adopt)

    def _adopt(self, store) -> bool:
        logger.info("kvconnect server: holding a %d-byte Mooncake segment for master %s",
                    self.spec.global_segment_bytes, self.spec.master_address)
        return True

    @property
    def attempts(self) -> int:
        return self._link.connect_polls

    def wait_connected(self, timeout_s: Optional[float] = None) -> bool:
        return self._link.wait_connected(timeout_s)

    def status(self) -> dict:
        return {"master": self.spec.master_address, "protocol": self.spec.protocol,
                "local_hostname": self.spec.local_hostname, "segment_bytes": self.spec.global_segment_bytes,
                "connected": self._link.connected, "connect_polls": self._link.connect_polls}

    def close(self) -> None:
        """Withdraw the segment (its objects vanish from the store) and stop connecting."""
        self._link.close()
