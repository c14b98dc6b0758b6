"""One process's connection to a Mooncake master: connect behind, count calls in flight, back off.

    link = MooncakeLink(spec, name="tier", timeout_s=1.0, adopt=register_scratch)  # returns at once
    store = link.enter()        # the store for one call, or None (not connected, closed, backing off)
    try: ... finally: link.exit()
    link.failure() / link.success()    # the breaker hears how the call went (codes.py)
    link.close()                # stop connecting; close the store once no call is in flight

Used by the Mooncake tier (which moves chunks) and by the node server's segment holder
(which only contributes memory): both connect the same way.

Connecting. ``setup`` runs on a background thread (with no master, Mooncake's own setup
retries for ~90 s and misses a master that starts meanwhile, so ``connect_store`` probes
the port first). Until it succeeds every ``enter`` returns None at once; a call that
arrives while ``setup`` runs (the master answered: a fresh engine's first lookups) waits
for it, at most ``timeout_s``.

Bounding. Each Mooncake RPC is bounded by ``MC_RPC_TIMEOUT_MS`` (Mooncake's own variable;
``config._bind_transfer_engine`` defaults it to the tier's ``timeout_s``), after
which Mooncake returns -901 (a timeout; ``codes``) instead of waiting 30 s.
Transport and timeout codes open the breaker (``tier.Breaker``): the tier is skipped,
doubling its pause, until a probe succeeds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from .config import MooncakeSpec, connect_store, import_store
from ..tier import Breaker

logger = logging.getLogger(__name__)


class MooncakeLink:
    def __init__(self, spec: MooncakeSpec, *, name: str, timeout_s: float = 1.0,
                 adopt: Optional[Callable[[object], bool]] = None, retry_after_s: float = 0.5,
                 max_retry_after_s: float = 10.0) -> None:
        """Connect to ``spec.master_address`` in the background; ``adopt(store)`` prepares a
        fresh store (e.g. registers buffers) before it is used: False drops it and retries.

        Raises StorageError when Mooncake cannot be imported (a configuration error at start).
        """
        self.spec = spec
        self.name = name
        self.timeout_s = timeout_s
        self._store_cls = import_store(spec, rpc_timeout_s=timeout_s)
        self._adopt_fn = adopt
        self.breaker = Breaker(retry_after_s, max_retry_after_s)
        self._state = threading.Condition()
        self._store = None
        self._setting_up = False  # the master answered and setup() is running
        self._closed = False
        self._in_flight = 0
        self.connect_polls = 0
        self.connects = 0
        self._thread = threading.Thread(target=self._connect_loop, name=f"kvconnect-mooncake-{name}", daemon=True)
        self._thread.start()

    # -- connecting ---------------------------------------------------------------------
    def _connect_loop(self) -> None:
        def wait_stop(seconds: float) -> bool:
            with self._state:
                self.connect_polls += 1
                return self._state.wait_for(lambda: self._closed, seconds)

        def on_setup(running: bool) -> None:
            with self._state:
                self._setting_up = running
                self._state.notify_all()

        while True:
            store = connect_store(self.spec, self._store_cls, wait_stop, logger.warning, on_setup)
            if store is None or self._adopt(store):
                return

    def _adopt(self, store) -> bool:
        """Publish ``store``; True when done (published, or closing), False to set up again."""
        try:
            ok = self._adopt_fn is None or self._adopt_fn(store)
        except Exception:  # a binding error while registering: set up again
            logger.exception("kvconnect: preparing the Mooncake client failed")
            ok = False
        with self._state:
            self._setting_up = False
            self._state.notify_all()
            if ok and not self._closed:
                self._store = store
                self.connects += 1
        if not ok or self._closed:
            if not ok:
                logger.warning("kvconnect: Mooncake refused a buffer of the %s client; setting up again", self.name)
            store.close()
            return self._closed
        logger.info("kvconnect: Mooncake %s connected to %s (contributing %d bytes)", self.name,
                    self.spec.master_address, self.spec.global_segment_bytes)
        return True

    @property
    def connected(self) -> bool:
        with self._state:
            return self._store is not None

    def wait_connected(self, timeout_s: Optional[float] = None) -> bool:
        with self._state:
            return self._state.wait_for(lambda: self._store is not None or self._closed, timeout_s) \
                and self._store is not None

    # -- calls ----------------------------------------------------------------------------
    def enter(self):
        """The store for one call (the caller must ``exit``), or None: not connected, closed,
        or the breaker is open. Waits at most ``timeout_s`` for a ``setup`` in progress."""
        with self._state:
            if self._store is None and self._setting_up and not self._closed:
                self._state.wait_for(lambda: self._store is not None or not self._setting_up or self._closed,
                                     self.timeout_s)
            if self._store is None or self._closed or not self.breaker.allow():
                return None
            self._in_flight += 1
            return self._store

    def exit(self) -> None:
        with self._state:
            self._in_flight -= 1
            self._state.notify_all()

    def healthy(self) -> bool:
        with self._state:
            return self._store is not None and not self._closed and self.breaker.allow()

    def failure(self) -> None:
        self.breaker.failure()

    def success(self) -> None:
        self.breaker.success()

    # -- closing --------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop connecting; close the store once no call is in flight. False when a call was
        still inside Mooncake at the deadline (the client is then left open: closing it under
        a running call would crash the process)."""
        deadline = time.monotonic() + timeout_s
        with self._state:
            self._closed = True
            self._state.notify_all()
            while self._in_flight and time.monotonic() < deadline:
                self._state.wait(max(0.0, deadline - time.monotonic()))
            store, self._store = self._store, None
            stuck = self._in_flight
        self._thread.join(min(2.0, max(0.0, deadline - time.monotonic())))  # a setup under way ends by itself
        if store is None:
            return True
        if stuck:
            logger.warning("kvconnect: a Mooncake call is still in flight at close; leaving the client open")
            return False
        store.close()
        return True
