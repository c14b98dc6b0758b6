"""One request/reply channel from a client to the cache server, bounded in time.

    channel = Channel(ctx, url, token=token, limits=limits, timeout_s=1.0)
    status, result = channel.request("masks", [keys], client_id, instance)  # or StorageError
    channel.post("bye", [], client_id, instance)                            # fire and forget
    channel.reset()                                                          # after a failure
    channel.close()

A DEALER socket with IMMEDIATE set (nothing queues towards a server that is not there),
replies matched to requests by id (a late reply to a request that timed out is skipped),
every reply authenticated and decoded under the same limits as requests. Not thread-safe,
like the ZMQ socket under it: the owner serialises calls.

Who answered: on ``ipc://`` libzmq reads ``SO_PEERCRED`` of the connection each reply came
on (the uid of the process that listens at the path *now*, not of whoever owns the file) and
hands it out as the frame's ``Peer-Address``. With ``trusted_uids`` set, a reply from any
other uid, or one the kernel did not name, raises ``UntrustedServer`` before it is decoded:
the check is on every reply, so a socket that silently reconnected to another listener at
the same path (a squatter who bound it during a restart) is refused at its first answer.
``peer_uid`` is the uid of the last reply accepted.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Optional

import zmq

from ..errors import StorageError
from . import protocol
from .admission import parse_peer_address
from .protocol import Limits, ProtocolError

_request_ids = itertools.count(1)  # shared by all channels of a process: ids never repeat


class UntrustedServer(StorageError):
    """The process answering at the URL runs as a user this client has no reason to trust."""


class Channel:
    def __init__(self, ctx: zmq.Context, url: str, *, token: Optional[bytes], limits: Limits, timeout_s: float,
                 trusted_uids: Optional[frozenset[int]] = None) -> None:
        """``trusted_uids``: on ``ipc://``, the uids whose replies are accepted (None: any, for a
        token that proves the server, or ``tcp://`` where the kernel names no uid)."""
        self.url = url
        self.timeout_s = timeout_s
        self.bad_replies = 0
        self.trusted_uids = trusted_uids
        self.peer_uid: Optional[int] = None
        self._ctx = ctx
        self._token = token
        self._limits = limits
        self._sock: Optional[zmq.Socket] = self._open()

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_frame_bytes + protocol.TAG_BYTES + 64)
        sock.connect(self.url)
        return sock

    def request(self, op: str, args: list, client_id: bytes, instance: Optional[bytes]) -> tuple[int, Any]:
        """(status, result) of one request; StorageError when it cannot be sent or no reply
        comes within ``timeout_s`` (the whole call, send included, is bounded by it)."""
        deadline = time.monotonic() + self.timeout_s
        request_id = self._send(op, args, client_id, instance, wait=True)
        sock = self._sock
        while (remaining := deadline - time.monotonic()) > 0:
            sock.setsockopt(zmq.RCVTIMEO, max(1, int(remaining * 1000)))
            try:  # a blocking receive with a timeout: cheaper than poll + receive
                frame = sock.recv(copy=False)
            except zmq.Again:
                continue
            uid = self._check_peer(frame)
            try:
                reply_id, status, result = protocol.check_reply(protocol.open_frame(frame.bytes, self._token, self._limits, reply=True))
            except ProtocolError:
                self.bad_replies += 1
                continue
            if reply_id == request_id:
                self.peer_uid = uid
                return status, result
        raise StorageError(f"{op} to {self.url}: no reply within {self.timeout_s} s")

    def _check_peer(self, frame: zmq.Frame) -> Optional[int]:
        """The uid the kernel names for the reply's connection (None on tcp); raises
        UntrustedServer for a uid outside ``trusted_uids``."""
        try:
            creds = parse_peer_address(frame.get("Peer-Address"))
        except Exception:  # a frame without properties (libzmq built without SO_PEERCRED)
            creds = None
        uid = None if creds is None else creds[0]
        if self.trusted_uids is not None and uid not in self.trusted_uids:
            path = protocol.ipc_path(self.url)
            who = "a process whose uid the kernel did not name" if uid is None else f"uid {uid}"
            raise UntrustedServer(f"the server answering at {path} runs as {who}, not as this user (uid {os.geteuid()}) or "
                                  "root: another user may have bound the path; set KVCONNECT_SERVER_TOKEN (the server's "
                                  "token) to use a server of another user")
        return uid

    def post(self, op: str, args: list, client_id: bytes, instance: Optional[bytes]) -> bool:
        """Send without waiting for the reply; False when it cannot be sent right now (not
        connected, or the send queue is full). The reply is skipped by a later ``request``."""
        try:
            self._send(op, args, client_id, instance, wait=False)
        except StorageError:
            return False
        return True

    def _send(self, op: str, args: list, client_id: bytes, instance: Optional[bytes], *, wait: bool) -> int:
        if self._sock is None:
            raise StorageError("channel closed")
        request_id = next(_request_ids)
        frame = protocol.pack_request(op, request_id, client_id, instance, args, self._token)
        sock = self._sock
        try:  # with IMMEDIATE, the socket is writable only once the connection is up
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                if not (wait and sock.poll(max(1, int(self.timeout_s * 1000)), zmq.POLLOUT)):
                    raise StorageError(f"{op}: no connection to {self.url} within {self.timeout_s if wait else 0} s") from None
                sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise StorageError(f"cannot send {op} to {self.url}: {exc}") from exc
        return request_id

    def reset(self) -> None:
        """A fresh socket: whatever was queued towards a dead or hung server is dropped."""
        self.close()
        self._sock = self._open()

    def close(self, linger_ms: int = 0) -> None:
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None
