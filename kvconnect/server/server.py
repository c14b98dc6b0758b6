"""``CacheServer``: owns the node's shared CPU pool and answers engines over ZMQ.

    server = CacheServer(url="ipc:///tmp/kvc.sock", size_bytes=1 << 30)
    server.serve(stop_event)      # until stop_event is set (the CLI sets it on SIGTERM)
    server.close()                # unlinks the segment and the socket file

One thread, one ROUTER socket, one ``CacheIndex``: requests are handled in arrival order,
so the index needs no lock. Every frame passes ``protocol.open_frame`` + ``check_request``
before it can touch state; a refused frame gets a BAD_REQUEST reply (nothing when its
tag is wrong: no oracle for forgers) and the loop goes on serving everyone else. Clients
silent for longer than the lease lose their pins and reservations (``CacheIndex.expire``).

Who is answered (``admission``): on ``ipc://`` the peers the kernel names (``SO_PEERCRED``)
as the server's own uid or one the ``PeerPolicy`` allows, checked on every frame; the socket
file and the segment get the policy's mode (0600, or 0660 for an allowed group). ``tcp://``
needs a token, loopback or not, and any other address than loopback also ``allow_remote``
(``protocol.check_url``). Frames of a peer not admitted are dropped unanswered and counted.
Sessions are bounded per principal (``CacheIndex.max_clients_per_principal``).
Before binding an ipc path that exists, the server probes it and refuses to steal the
socket of a live server.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Optional

import msgpack
import zmq

from ..errors import ConfigError
from ..storage.eviction import DEFAULT_POLICY
from ..storage.host_memory import check_fits_host
from . import protocol
from .admission import Gate, PeerPolicy, parse_peer_address
from .index import CacheIndex, ClientState, RequestError
from .protocol import BAD_REQUEST, INTERNAL, OK, STALE_INSTANCE, UNKNOWN_CLIENT, AuthError, Limits, ProtocolError
from .shm import DATA_OFFSET, SHM_DIR, Segment

logger = logging.getLogger(__name__)

DEFAULT_PAGE_BYTES = 64 << 10
DEFAULT_LEASE_S = 10.0
_POLL_MS = 50  # bounds how late a stop request or a lease sweep is noticed
_BATCH = 256  # frames handled per wakeup before the loop checks leases and stop again


class CacheServer:
    def __init__(
        self,
        url: str,
        size_bytes: int,
        *,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        token: Optional[str] = None,
        allow_remote: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
        limits: Limits = Limits(),
        shm_dir: str = SHM_DIR,
        eviction: str = DEFAULT_POLICY,
        peers: PeerPolicy = PeerPolicy(),
    ) -> None:
        """``peers``: who may connect to an ``ipc://`` server (default: this process's uid only)."""
        self.token = protocol.token_bytes(token)
        self.url = protocol.check_url(url, token=self.token, allow_remote=allow_remote)
        self.peers = peers
        if lease_s <= 0:
            raise ConfigError(f"lease must be > 0 s, got {lease_s}")
        num_pages = (size_bytes - DATA_OFFSET) // page_bytes if page_bytes > 0 else 0
        if num_pages <= 0:
            raise ConfigError(f"a pool of {size_bytes} bytes holds no {page_bytes}-byte page")
        self.limits = limits
        self.lease_s = lease_s
        self.instance = secrets.token_bytes(protocol.ID_BYTES)  # identifies this start, not a secret
        self.index = CacheIndex(num_pages, page_bytes, lease_s=lease_s, eviction=eviction,
                                max_clients_per_principal=peers.max_sessions_per_peer)
        self._ctx = zmq.Context()
        self._socket: Optional[zmq.Socket] = None
        self._ipc_path = protocol.ipc_path(url)
        self._gate = Gate(peers, ipc=self._ipc_path is not None)
        self._refuse_if_live()
        # the segment lives in RAM (tmpfs) and every page of it is written: the engine's check of its own pool
        check_fits_host(size_bytes, f"the server's pool (--size-gb, LMCACHE_MAX_LOCAL_CPU_SIZE) = {size_bytes / (1 << 30):g} GB",
                        advice="lower --size-gb")
        self.segment = Segment.create(url, self.instance, page_bytes, num_pages, shm_dir=shm_dir)
        try:
            try:
                peers.apply_to(self.segment.path)
            except OSError as exc:  # e.g. --allow-group names a group this user is not in
                raise ConfigError(f"cannot give {self.segment.path} mode {peers.file_mode:o} (group {peers.allow_gid}): {exc}") from exc
            self._bind()
        except BaseException:
            self.segment.unlink()
            raise
        self._last_sweep_s = time.monotonic()
        self._auth_failures = 0

    # -- setup -----------------------------------------------------------------------
    def _refuse_if_live(self) -> None:
        if self._ipc_path is None or not os.path.exists(self._ipc_path):
            return
        probe = self._ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        try:
            probe.connect(self.url)
            probe.send(protocol.pack_request("ping", 1, secrets.token_bytes(16), None, [], self.token))
            if probe.poll(300, zmq.POLLIN):
                raise ConfigError(f"a cache server already serves {self.url}")
        finally:
            probe.close()

    def _bind(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer that sends a larger message before it is buffered whole
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + protocol.TAG_BYTES + 64)
        old_umask = os.umask(0o077) if self._ipc_path else None
        try:
            sock.bind(self.url)
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"cannot bind {self.url}: {exc}") from exc
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if self._ipc_path:
            try:
                self.peers.apply_to(self._ipc_path)
            except OSError as exc:
                sock.close()
                raise ConfigError(f"cannot give {self._ipc_path} mode {self.peers.file_mode:o}: {exc}") from exc
        self._socket = sock

    # -- loop ------------------------------------------------------------------------
    def serve(self, stop: Optional[threading.Event] = None, *, max_seconds: Optional[float] = None) -> None:
        """Serve until ``stop`` is set (or ``max_seconds`` pass)."""
        assert self._socket is not None
        end = None if max_seconds is None else time.monotonic() + max_seconds
        while not (stop is not None and stop.is_set()) and (end is None or time.monotonic() < end):
            if self._socket.poll(_POLL_MS, zmq.POLLIN):
                for _ in range(_BATCH):
                    try:  # not copied: a frame's properties name its peer
                        frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    principal = self._gate.principal(frames[-1])
                    if principal is None:
                        self._refuse_peer(frames[-1])
                        continue
                    self.handle([f.bytes for f in frames], principal)
                    if not self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
            now = time.monotonic()
            if now - self._last_sweep_s >= min(1.0, self.lease_s / 4):
                self._last_sweep_s = now
                for client_id in self.index.expire():
                    logger.warning("kvconnect server: client %s missed its lease; its pins and reservations are released", client_id.hex()[:8])

    def _refuse_peer(self, frame) -> None:
        """Drop a frame of a peer not admitted, unanswered (no oracle), counted and logged sparingly."""
        self.index.counters["refused_requests"] += 1
        self.index.counters["refused_peers"] += 1
        if self.index.counters["refused_peers"] in (1, 10, 100, 1000, 10000):
            try:
                creds = parse_peer_address(frame.get("Peer-Address"))
            except Exception:
                creds = None
            why = ("libzmq gave no peer credentials (SO_PEERCRED)" if creds is None else
                   f"uid {creds[0]} (gid {creds[1]}) is neither this server's nor allowed by --allow-uid / --allow-group")
            logger.warning("kvconnect server: %d frames from peers not admitted dropped (latest: %s)",
                           self.index.counters["refused_peers"], why)

    def handle(self, frames: list, principal: str = "self") -> None:
        """Answer one ROUTER message ``[identity, frame]`` from an admitted ``principal``; never raises."""
        if len(frames) != 2:
            self.index.counters["refused_requests"] += 1
            if frames:
                self._reply(frames[0], 0, BAD_REQUEST, "a request is exactly one frame")
            return
        identity, frame = frames
        try:
            request = protocol.check_request(protocol.open_frame(frame, self.token, self.limits, reply=False), self.limits)
        except ProtocolError as exc:
            self.index.counters["refused_requests"] += 1
            if isinstance(exc, AuthError):
                self._auth_failures += 1
                if self._auth_failures in (1, 10, 100, 1000):
                    logger.warning("kvconnect server: %d frames with a bad or missing token dropped", self._auth_failures)
                return
            self._reply(identity, 0, BAD_REQUEST, str(exc)[:200])
            return
        except Exception:  # a decoder bug must cost one frame, not the node's cache
            logger.exception("kvconnect server: unexpected error decoding a frame")
            self.index.counters["refused_requests"] += 1
            self._reply(identity, 0, BAD_REQUEST, "undecodable frame")
            return
        try:
            status, result = self._dispatch(request, principal)
        except RequestError as exc:
            self.index.counters["refused_requests"] += 1
            status, result = BAD_REQUEST, str(exc)[:200]
        except Exception as exc:  # a bug here must cost one request, not the node's cache
            logger.exception("kvconnect server: internal error on %s", request.op)
            status, result = INTERNAL, f"internal error: {type(exc).__name__}"
        self._reply(identity, request.request_id, status, result)

    def _dispatch(self, req: protocol.Request, principal: str) -> tuple[int, object]:
        index = self.index
        if req.op == "hello":
            if not self._gate.readmit(principal):
                index.counters["refused_peers"] += 1
                raise RequestError(f"{principal} is no longer a member of the allowed group")
            pid, fingerprint, slot_bytes = req.args
            index.hello(req.client_id, pid, fingerprint, slot_bytes, principal=principal)
            seg = self.segment.info
            return OK, [self.instance, seg.name, seg.page_bytes, seg.num_pages, self.lease_s, self.limits.max_frame_bytes]
        state = index.touch(req.client_id, principal)
        if req.op == "bye":
            if state is not None:
                index.drop_client(state)
            return OK, []
        if state is None:
            return UNKNOWN_CLIENT, "unknown client: say hello"
        if req.instance != self.instance:
            return STALE_INSTANCE, "request addressed to another server instance"
        return OK, getattr(self, "_op_" + req.op)(state, req.args)

    def _op_ping(self, state: ClientState, args: list) -> list:
        return []

    def _op_masks(self, state: ClientState, args: list) -> list:
        return [self.index.masks(args[0])]

    def _op_acquire(self, state: ClientState, args: list) -> list:
        return [self.index.acquire(state, args[0], self.limits.max_frame_bytes - 1024)]

    def _op_release(self, state: ClientState, args: list) -> list:
        return [self.index.release(state, args[0])]

    def _op_reserve(self, state: ClientState, args: list) -> list:
        slots, evicted = self.index.reserve(state, args[0])
        budget = self.limits.max_frame_bytes // 2
        reported = []
        for entry in evicted:  # listeners are best effort: never grow the reply past the limit
            cost = 128 + len(entry.header[5])
            if entry.fingerprint != state.fingerprint or budget < cost:
                continue
            budget -= cost
            reported.append([entry.first_page, entry.header])
        return [slots, reported]

    def _op_commit(self, state: ClientState, args: list) -> list:
        key, header, first_page = args
        return [self.index.commit(state, key, header, first_page)]

    def _op_abort(self, state: ClientState, args: list) -> list:
        return [self.index.abort(state, args[0])]

    def _op_remove(self, state: ClientState, args: list) -> list:
        return [self.index.remove(args[0])]

    def _op_clear(self, state: ClientState, args: list) -> list:
        return [self.index.clear(args[0])]

    def _op_stats(self, state: ClientState, args: list) -> list:
        return [self.index.stats(state.fingerprint)]

    def _reply(self, identity: bytes, request_id: int, status: int, result: object) -> None:
        try:
            frame = protocol.pack_reply(request_id, status, result, self.token)
            self._socket.send_multipart([identity, frame], zmq.NOBLOCK)
        except (zmq.ZMQError, msgpack.PackException, ValueError, TypeError):
            # the peer is gone or its queue is full: it will time out and retry
            logger.debug("kvconnect server: reply dropped", exc_info=True)

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            if self._ipc_path:
                try:
                    os.unlink(self._ipc_path)
                except FileNotFoundError:
                    pass
        self._ctx.term()
        self.segment.unlink()
        self.segment.close()

    def __enter__(self) -> "CacheServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
