"""``ServerSession``: one engine process's session with the node cache server.

What ``client.SharedPoolClient`` stands on: the hello under a fresh client id, the mapped
segment (swapped when the server restarted), the heartbeat every lease/4, the backoff while
the server is gone, and the calls on the main channel, each bounded by ``timeout_s``.

- A call that times out or is refused counts an error and returns ``FAILED``; the session is
  then *disconnected*: every call fails at once while the keeper thread says hello again.
- A new session (a fresh id, ``incarnation`` + 1) starts only when the pool holds no pin and no
  reservation of the old one (``may_reconnect``), so the old id's pages, freed by ``bye`` or the
  server's lease, are never still read or written here. ``lock`` guards this state and the
  pool's pins and reservations together, for that reason.
- Trust: on ``ipc://`` every reply, the hello's and each call's, names the uid of the process
  that sent it (``SO_PEERCRED`` of the connection it came on, ``channel.Channel``). Without a
  token only this user's and root's replies are accepted, and only the segment owned by the
  uid that answered the hello is mapped: another user who binds the path (``/tmp`` is
  everyone's) before the server starts or while it restarts would otherwise hand this engine
  its own segment and checksums. Owning or unlinking the socket *file* proves nothing, so the
  file is not what is checked. A refused reply disconnects the session and drops the socket,
  so the next hello reaches whoever listens at the path then.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections import Counter
from typing import Any, Callable, Optional

import torch
import zmq

from ..errors import StorageError
from ..layout.spec import Fingerprint
from ..throttled_warning import RepeatingWarning
from . import protocol
from .channel import Channel, UntrustedServer
from .protocol import OK, STALE_INSTANCE, UNKNOWN_CLIENT, Limits, ProtocolError
from .shm import SHM_DIR, Segment, register_host_memory, unregister_host_memory

logger = logging.getLogger(__name__)

FAILED = object()  # a call that did not complete


class ServerSession:
    def __init__(self, url: str, *, token: Optional[str], slot_bytes: int, timeout_s: float,
                 fingerprint: Optional[Fingerprint], limits: Limits, pin_memory: bool, shm_dir: str = SHM_DIR,
                 warn_unreachable: bool = True, counters: Counter, may_reconnect: Callable[[], bool]) -> None:
        """``counters``: the pool client's (errors by kind, connects); ``may_reconnect``: called
        with ``lock`` held, True when the pool holds nothing of the current session."""
        self._token = protocol.token_bytes(token)
        self.url = protocol.check_url(url, token=self._token, allow_remote=True)
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.fingerprint = fingerprint
        self.limits = limits
        self.counters = counters
        self._may_reconnect = may_reconnect
        self._pin_memory = pin_memory
        self._shm_dir = shm_dir
        self._ctx = zmq.Context()
        ipc = protocol.ipc_path(self.url) is not None
        # without a token nothing but the kernel proves who answers; with one, the replies' tags do
        self._trusted_uids = frozenset((os.geteuid(), 0)) if ipc and self._token is None else None
        self.lock = threading.Lock()  # the main channel, the state below, the pool's pins and reservations
        self._main: Optional[Channel] = None  # engine calls, under the lock
        self._client_id: Optional[bytes] = None
        self.instance: Optional[bytes] = None
        self._segment: Optional[Segment] = None
        self.page_locked = False  # the mapping is registered with CUDA (cudaHostRegister)
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.page_bytes = 1
        self.run_pages = 1
        self.num_pages = 0
        self.num_slots = 0
        self.incarnation = 0
        self.connected = False
        self._heartbeat_s = 1.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.prefaulted = threading.Event()  # set once the mapping's pages are all faulted in
        self._unreachable = RepeatingWarning(logger.warning if warn_unreachable else logger.debug)
        self._untrusted = RepeatingWarning(logger.error)  # a foreign server at the path: always said, apart
        self._beat = self._channel()  # hello and heartbeats: __init__, then the keeper thread only
        self._try_connect()  # synchronously once, so the first store can already use the server
        self._keeper = threading.Thread(target=self._keep, name="kvconnect-server-client", daemon=True)
        self._keeper.start()

    # -- calls -------------------------------------------------------------------------
    def call(self, op: str, args: list, incarnation: Optional[int] = None) -> Any:
        """The result of ``op`` on the main socket, or FAILED (counted; disconnects when due).

        ``incarnation``: send only if the session is still that one (ids and slots in
        ``args`` mean nothing to a newer session).
        """
        with self.lock:
            if not self.connected or (incarnation is not None and incarnation != self.incarnation):
                self.counters["calls_while_disconnected"] += 1
                return FAILED
            try:
                status, result = self._main.request(op, args, self._client_id, self.instance)
            except UntrustedServer as exc:  # the socket reconnected to another listener at the path
                self._disconnect("untrusted_servers", exc)
                self._refused(exc)
                return FAILED
            except StorageError as exc:
                self._disconnect("timeouts", exc)
                return FAILED
            if status == OK:
                return result
            if status in (UNKNOWN_CLIENT, STALE_INSTANCE):
                self._disconnect("lost_sessions", result)
            else:
                self.counters["refused_calls"] += 1
                if self.counters["refused_calls"] in (1, 100, 10000):
                    logger.warning("kvconnect: cache server refused %s: %s", op, result)
            return FAILED

    def post(self, op: str, args: list, incarnation: int) -> bool:
        """Send ``op`` without waiting for its reply, if still connected as ``incarnation``;
        False when it was not sent (disconnected, a newer session, or the queue is full)."""
        with self.lock:
            return (self.connected and incarnation == self.incarnation
                    and self._main.post(op, args, self._client_id, self.instance))

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat, say bye (frees this client's pins at once), unmap."""
        self._stop.set()
        self._wake.set()
        self._keeper.join(timeout=self.timeout_s + 1.0)
        with self.lock:
            if self.connected and self._main is not None:
                self._main.post("bye", [], self._client_id, self.instance)
            self.connected = False
            for channel in (self._main, self._beat):
                if channel is not None:
                    channel.close(linger_ms=100)
            self._main = None
            self._drop_segment()
        if self._keeper.is_alive():  # stuck in a call: term() would wait for its socket forever
            logger.warning("kvconnect: cache-server client thread did not stop; leaving its context open")
        else:
            self._ctx.term()

    # -- connection --------------------------------------------------------------------
    def _channel(self) -> Channel:
        return Channel(self._ctx, self.url, token=self._token, limits=self.limits, timeout_s=self.timeout_s,
                       trusted_uids=self._trusted_uids)

    def _disconnect(self, reason: str, detail: Any) -> None:
        """Called with the lock held: from now on calls miss until the keeper reconnects."""
        if self.connected:
            logger.warning("kvconnect: cache server %s unreachable (%s); serving misses until it is back", self.url, detail)
        self.connected = False
        self.counters[reason] += 1
        self._wake.set()

    def _try_connect(self) -> bool:
        """Say hello under a fresh client id and, if that works, switch to it (keeper thread)."""
        with self.lock:
            if not self._may_reconnect():  # the engine still uses the old session's pages
                return False
        new_id = secrets.token_bytes(protocol.ID_BYTES)
        args = [os.getpid(), None if self.fingerprint is None else bytes(self.fingerprint), self.slot_bytes]
        try:
            status, result = self._beat.request("hello", args, new_id, None)
            owner_uid = self._beat.peer_uid  # the uid that answered this hello, on this connection
            info, lease_s = protocol.check_hello_reply(status, result)
            segment = self._segment
            if segment is None or segment.info != info:
                segment = Segment.attach(info, shm_dir=self._shm_dir, owner_uid=owner_uid)
        except UntrustedServer as exc:
            self._beat.reset()  # the next hello connects afresh, to whoever listens at the path then
            self.counters["failed_hellos"] += 1
            self.counters["untrusted_servers"] += 1
            self._refused(exc)
            return False
        except (StorageError, ProtocolError) as exc:
            self._beat.reset()  # drop whatever is queued towards a dead peer
            self.counters["failed_hellos"] += 1
            self._unreachable.failed(
                "kvconnect: no answer from the cache server %s (%s): is `kvconnect server` running there, and is "
                "KVCONNECT_SERVER_TOKEN the server's token? (the server drops frames with a wrong or missing token, "
                "which looks like no answer). Serving misses; retrying", self.url, exc)
            return False
        with self.lock:
            old_id, old_instance = self._client_id, self.instance
            if segment is not self._segment:
                self._drop_segment()
                self._segment = segment
                self.page_locked = self._pin_memory and register_host_memory(segment.buffer)
                self.buffer = segment.buffer
                self.prefaulted.clear()
                if self.page_locked:  # registration already faulted every page in
                    self.prefaulted.set()
                else:
                    threading.Thread(target=self._prefault, args=(segment,), name="kvconnect-prefault", daemon=True).start()
            self.page_bytes, self.num_pages = info.page_bytes, info.num_pages
            self.run_pages = -(-self.slot_bytes // info.page_bytes)
            self.num_slots = info.num_pages // self.run_pages
            if self._main is not None:
                self._main.close()
            self._main = self._channel()
            self._client_id, self.instance = new_id, info.instance
            self._heartbeat_s = min(max(lease_s / 4, 0.05), 30.0)
            self.incarnation += 1
            self.connected = True
            self.counters["connects"] += 1
        if old_id is not None:  # best effort: the old session's pins and reservations go now, not at lease end
            self._beat.post("bye", [], old_id, old_instance)
        self._unreachable.cleared()
        self._untrusted.cleared()
        logger.info("kvconnect: connected to cache server %s (%d pages of %d bytes)", self.url, info.num_pages, info.page_bytes)
        return True

    def _refused(self, exc: UntrustedServer) -> None:
        self._untrusted.failed("kvconnect: refusing the cache server %s: %s. Nothing is loaded from it; serving misses "
                               "and retrying", self.url, exc)

    def _keep(self) -> None:
        """Heartbeat while connected; reconnect with backoff while not."""
        backoff_s = 0.05
        while not self._stop.is_set():
            if self.connected:
                self._wake.wait(self._heartbeat_s)
                self._wake.clear()
                if self._stop.is_set() or not self.connected:
                    continue
                client_id, instance = self._client_id, self.instance
                try:
                    status, _ = self._beat.request("ping", [], client_id, instance)
                except StorageError as exc:
                    status = -1
                    detail: Any = exc
                    self._beat.reset()
                    if isinstance(exc, UntrustedServer):  # another listener answered at the path
                        self.counters["untrusted_servers"] += 1
                        self._refused(exc)
                else:
                    detail = f"status {status}"
                if status != OK:
                    with self.lock:
                        if self._client_id == client_id:
                            self._disconnect("lost_heartbeats", detail)
                backoff_s = 0.05
            elif not self._try_connect():
                self._wake.wait(backoff_s)
                self._wake.clear()
                backoff_s = min(backoff_s * 2, 2.0)

    def _prefault(self, segment: Segment) -> None:
        try:
            segment.prefault(self._stop)
        finally:
            self.prefaulted.set()

    def _drop_segment(self) -> None:
        if self._segment is None:
            return
        if self.page_locked:
            unregister_host_memory(self._segment.buffer)
            self.page_locked = False
        self._segment.close()
        self._segment = None
