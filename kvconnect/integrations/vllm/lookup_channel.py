"""Scheduler <-> worker lookup channel: how much of a prompt every worker can restore.

Every worker (one per TP x PP rank) serves a ZMQ ROUTER socket on its own address; the
scheduler holds one DEALER per worker, asks them all and takes the minimum, because a hit
is only real if every rank holds its shard. A worker that does not answer within the
timeout counts as a 0 hit, so a stuck worker costs recomputation, never a wrong answer.

    server = LookupServer(address, handler, token=None)     # worker: handler.lookup/stats/clear
    client = LookupClient(addresses, timeout_s, token=None) # scheduler
    client.lookup(tokens, namespace=b"", generation=None) -> int # min over workers, 0 on any failure
    client.stats() -> list[dict | None]; client.clear(generation=None, retire=None) -> bool
    client.retired(generation) -> bool                           # True if any worker says so, or is silent
    client.tp_refusal(tp_size) -> str | None                     # why some worker cannot read TP tp_size's chunks
    server.close(); client.close()

Wire format: msgpack maps with a fixed schema, no extension types, sizes capped; no
object serialisation of any other kind. Requests ``{"id": int, "op": "lookup", "tokens": bin,
"ns": bin, "gen": bin, "mm": bin}`` (tokens little-endian int64; ``ns``, the request's namespace, only when
not empty; ``gen``, the key generation to look under, empty or 16 bytes, absent: the worker's
own; ``mm``, the prompt's multimodal items, only when it has any: msgpack of (identifier str,
offset, length) triples, unpacked under its own caps, kvconnect/chunks/extra_keys.py),
``probe``, true for a P/D wait's probe, which the worker never samples for verification
(kvconnect/restore/verify.py), ``{"id": int, "op": "stats"}``, ``{"id": int, "op": "clear", "gen": bin, "retire": bin}``
(``gen``: the 16-byte generation every worker moves to, chosen by the scheduler; absent: a
random one per worker; ``retire``, only from a P/D producer: the generation its saves used,
whose marker the workers leave in the tiers), ``{"id": int, "op": "retired", "gen": bin}``
(whether a marker says some producer left ``gen`` behind), ``{"id": int, "op": "tp_refusal",
"tp": int}`` (why the worker cannot restore what ranks of TP size ``tp`` stored: a P/D
producer of another size, pd.py); replies ``{"id": int, "ok": bool, ...}`` with ``hit``
(int), ``stats`` (str -> int), ``retired`` (bool) or ``refusal`` (str, empty when it can).

Addresses: ``ipc://`` paths (the default) or ``tcp://`` on a loopback host.
``dp_rank_base(base, dp_rank, workers)`` derives a data-parallel rank's prefix (each DP rank
is a separate engine with its own scheduler and workers), then ``rank_address(prefix, i)``
worker i's address.

Who may talk on it: a lookup is a probe of what is cached and ``clear`` resets every worker,
so only the engine's own processes may (issue 31; the node server's rule, reused from
``kvconnect.server.admission`` and ``protocol``). On ``ipc://`` the socket file is born
owner-only (umask 077 around the bind, no window with a wider mode) and both ends check the
other's uid from ``SO_PEERCRED`` on every frame: a frame of another uid is dropped
unanswered. On ``tcp://`` nothing names the peer, so a token is required (``lookup_token``,
KVCONNECT_LOOKUP_TOKEN; refused at start without one) and every frame carries its
HMAC-SHA256, checked before decoding; a frame with a bad tag is dropped unanswered. A token
set on ``ipc://`` is checked as well.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import stat
import threading
import time
from typing import Optional, Protocol, Sequence
from urllib.parse import urlsplit

import msgpack
import numpy as np
import zmq

from kvconnect.errors import ConfigError
from kvconnect.chunks.extra_keys import MAX_IDENTIFIER_BYTES, MAX_ITEMS, MediaItem, as_triples, media_items
from kvconnect.chunks.keys import MAX_NAMESPACE_BYTES, generation_bytes
from kvconnect.server.admission import Gate, PeerPolicy
from kvconnect.server.protocol import AuthError, TAG_BYTES, seal, token_bytes, unseal

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # 8M tokens of int64
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_POLL_MS = 100
MAX_TP_SIZE = 4096  # as Config.read_tp_sizes
MAX_REFUSAL_BYTES = 240  # under the unpacker's max_str_len (256)


class LookupHandler(Protocol):
    def lookup(self, tokens: np.ndarray, namespace: bytes = b"", generation: Optional[bytes] = None,
               media: Sequence[MediaItem] = (), verify: bool = True) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def clear(self, generation: Optional[bytes] = None, retire: Optional[bytes] = None) -> None: ...
    def retired(self, generation: bytes) -> bool: ...
    def tp_refusal(self, tp_size: int) -> str: ...


def check_address(address: str) -> str:
    """Return ``address`` if it is ipc:// or loopback tcp://, else raise ConfigError."""
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return address
    if address.startswith("tcp://"):
        parts = urlsplit(address)
        if parts.hostname in _LOOPBACK and parts.port:
            return address
    raise ConfigError(f"lookup channel address {address!r} must be ipc://PATH or tcp://127.0.0.1:PORT (loopback only)")


def check_token(address: str, token: Optional[str]) -> Optional[bytes]:
    """The HMAC key of ``token`` (None: no token); ConfigError for a tcp:// address without
    one, because any local user can reach a loopback port and nothing names who did."""
    key = token_bytes(token)
    if key is None and address.startswith("tcp://"):
        raise ConfigError(f"lookup channel address {address!r} is tcp://: a token (lookup_token in "
                          "kv_connector_extra_config, or KVCONNECT_LOOKUP_TOKEN) is required; or use ipc://")
    return key


def _refuse_foreign_file(path: str) -> None:
    """Remove a socket file a dead process of ours left. ConfigError when another user owns it
    (in a sticky directory such as /tmp we could not remove it, and must not serve beside it),
    and when a live process still listens on it: another engine, or another data-parallel rank,
    given the same address; unlinking it would silently take that engine's lookups."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise ConfigError(f"lookup channel socket {path} exists and belongs to uid {st.st_uid}, not to this "
                          f"process's uid {os.geteuid()}: remove it as that user, or set another lookup_url")
    if stat.S_ISSOCK(st.st_mode) and _listening(path):
        raise ConfigError(f"lookup channel socket {path} is in use: a live process of this uid listens on it (another "
                          "engine, or another data-parallel rank, with the same lookup_url?): give each engine its own "
                          "lookup_url, or leave it unset to derive one per engine")
    os.unlink(path)  # left by a process of ours that died; the engine id makes the name ours


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket at ``path`` (a stale file left
    by a dead process refuses them)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:  # ECONNREFUSED: nobody listens (a file left behind); anything else: not a live peer either
        return False
    finally:
        probe.close()
    return True


def rank_address(base: str, index: int) -> str:
    """Worker ``index``'s address: ``base-index`` for ipc, ``port + index`` for tcp."""
    check_address(base)
    if base.startswith("ipc://"):
        return f"{base}-{index}"
    parts = urlsplit(base)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"tcp://{host}:{parts.port + index}"


def dp_rank_base(base: str, dp_rank: int, workers_per_rank: int) -> str:
    """The channel prefix of data-parallel rank ``dp_rank`` (each rank is an engine of its own).

    Rank 0 keeps ``base``; rank r > 0 gets ``base-dpR`` for ipc and, for tcp, the port block
    after every lower rank's ``workers_per_rank`` workers (``port + r * workers_per_rank``),
    so ranks of one host never share a socket whether the address was given or derived.
    """
    check_address(base)
    if dp_rank < 0 or workers_per_rank < 1:
        raise ConfigError(f"bad data-parallel rank {dp_rank} or worker count {workers_per_rank}")
    if dp_rank == 0:
        return base
    if base.startswith("ipc://"):
        return f"{base}-dp{dp_rank}"
    return rank_address(base, dp_rank * workers_per_rank)


def _unpack(raw: bytes) -> dict:
    msg = msgpack.unpackb(
        raw, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES, max_str_len=256,
        max_array_len=0, max_map_len=64, max_ext_len=0, use_list=False,
    )
    if not isinstance(msg, dict) or not isinstance(msg.get("id"), int) or isinstance(msg.get("id"), bool):
        raise ValueError("a message must be a map with an integer id")
    return msg


def pack_media(media: Sequence[MediaItem]) -> bytes:
    """A prompt's multimodal items as the ``mm`` field: msgpack of (identifier, offset, length) triples."""
    return msgpack.packb(as_triples(media))


def _media(msg: dict) -> tuple[MediaItem, ...]:
    """A request's ``mm`` items (none when absent), checked (media_items); ValueError otherwise."""
    raw = msg.get("mm")
    if raw is None:
        return ()
    if not isinstance(raw, bytes):
        raise ValueError("mm must be msgpack bytes")
    triples = msgpack.unpackb(raw, raw=False, max_str_len=MAX_IDENTIFIER_BYTES, max_bin_len=0, max_map_len=0,
                              max_ext_len=0, max_array_len=MAX_ITEMS, use_list=False)
    if not isinstance(triples, tuple) or not all(isinstance(t, tuple) and len(t) == 3 for t in triples):
        raise ValueError("mm must be a list of (identifier, offset, length)")
    return media_items(triples)  # TokenError is a ValueError


def _clip(text: str) -> str:
    """``text`` cut to MAX_REFUSAL_BYTES of UTF-8."""
    return text.encode()[:MAX_REFUSAL_BYTES].decode(errors="ignore")


def _generation(msg: dict) -> Optional[bytes]:
    """A request's ``gen`` (None when absent); ValueError unless empty or 16 bytes."""
    if "gen" not in msg:
        return None
    return generation_bytes(msg["gen"])  # TokenError is a ValueError


class LookupServer:
    """Answers lookups for one worker on a background thread until ``close()``."""

    def __init__(self, address: str, handler: LookupHandler, *, token: Optional[str] = None) -> None:
        self.address = check_address(address)
        self._token = check_token(address, token)
        self._handler = handler
        self._ipc_path = address[len("ipc://"):] if address.startswith("ipc://") else None
        self._gate = Gate(PeerPolicy(), ipc=self._ipc_path is not None)  # the default policy: our uid only
        self.num_refused = 0  # frames dropped unanswered: a foreign peer or a bad token
        if self._ipc_path:
            _refuse_foreign_file(self._ipc_path)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + TAG_BYTES)
        # the umask is the process's: kept for the bind only, so the file never has a wider mode
        old_umask = os.umask(0o077) if self._ipc_path else None
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"cannot bind the lookup channel at {self.address}: {exc}") from exc
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if self._ipc_path:
            PeerPolicy().apply_to(self._ipc_path)  # 0600: the x bit a socket file never needs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvconnect-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(_POLL_MS):
                    continue
                frames = self._sock.recv_multipart(copy=False)  # not copied: a frame's properties name its peer
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.warning("kvconnect: lookup channel receive failed", exc_info=True)
                continue
            if len(frames) != 2:
                continue  # not a DEALER request: ignore
            if self._gate.principal(frames[-1]) is None:
                self._refuse("a peer of another uid (SO_PEERCRED)")
                continue
            identity, raw = frames[0].bytes, frames[1].bytes
            try:
                body = unseal(raw, self._token, reply=False)
            except AuthError:
                self._refuse("a bad or missing token")
                continue
            try:
                reply = self._answer(_unpack(body))
            except Exception as exc:  # malformed input must never stop the server
                reply = {"id": -1, "ok": False, "error": type(exc).__name__}
            try:
                self._sock.send_multipart([identity, seal(msgpack.packb(reply), self._token, reply=True)])
            except zmq.ZMQError:
                logger.warning("kvconnect: lookup channel reply failed", exc_info=True)

    def _refuse(self, why: str) -> None:
        """Drop a frame unanswered (no oracle for the sender), logged sparingly."""
        self.num_refused += 1
        if self.num_refused in (1, 10, 100, 1000, 10000):
            logger.warning("kvconnect: lookup channel %s dropped %d frames unanswered (latest: %s)",
                           self.address, self.num_refused, why)

    def _answer(self, msg: dict) -> dict:
        op, rid = msg.get("op"), msg["id"]
        try:
            if op == "lookup":
                data, namespace = msg.get("tokens"), msg.get("ns", b"")
                if not isinstance(data, bytes) or len(data) % 8:
                    raise ValueError("tokens must be little-endian int64 bytes")
                if not isinstance(namespace, bytes) or len(namespace) > MAX_NAMESPACE_BYTES:
                    raise ValueError(f"ns must be at most {MAX_NAMESPACE_BYTES} bytes")
                tokens = np.frombuffer(data, dtype="<i8")
                if msg.get("probe") is True:  # a P/D wait's probe: never a verification (KVCONNECT_VERIFY_RATE)
                    hit = self._handler.lookup(tokens, namespace, _generation(msg), _media(msg), verify=False)
                else:
                    hit = self._handler.lookup(tokens, namespace, _generation(msg), _media(msg))
                return {"id": rid, "ok": True, "hit": int(hit)}
            if op == "stats":
                return {"id": rid, "ok": True, "stats": {str(k): int(v) for k, v in self._handler.stats().items()}}
            if op == "clear":
                retire = msg.get("retire")
                self._handler.clear(_generation(msg), None if retire is None else generation_bytes(retire))
                return {"id": rid, "ok": True}
            if op == "retired":
                generation = _generation(msg)
                if generation is None:
                    raise ValueError("retired needs gen")
                return {"id": rid, "ok": True, "retired": bool(self._handler.retired(generation))}
            if op == "tp_refusal":
                size = msg.get("tp")
                if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_TP_SIZE:
                    raise ValueError(f"tp must be an integer in [1, {MAX_TP_SIZE}]")
                return {"id": rid, "ok": True, "refusal": _clip(str(self._handler.tp_refusal(size)))}
            raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            logger.warning("kvconnect: lookup channel request %r failed: %s", op, exc)
            return {"id": rid, "ok": False, "error": type(exc).__name__}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
        self._ctx.term()
        if self._ipc_path and os.path.exists(self._ipc_path):
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass


class LookupClient:
    """Asks every worker; thread-safe; never raises for a worker's failure or silence."""

    def __init__(self, addresses: Sequence[str], timeout_s: float = 1.0, *, token: Optional[str] = None) -> None:
        if not addresses:
            raise ConfigError("the lookup channel needs at least one worker address")
        if timeout_s <= 0:
            raise ConfigError(f"lookup timeout must be > 0 s, got {timeout_s}")
        self.addresses = [check_address(a) for a in addresses]
        for address in self.addresses:
            check_token(address, token)
        self._token = token_bytes(token)
        # a worker's socket file is its own uid's: a reply from another uid is a squatter's
        self._gates = [Gate(PeerPolicy(), ipc=a.startswith("ipc://")) for a in self.addresses]
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self.num_errors = 0
        self.num_lookups = 0
        self.requested_tokens = 0
        self.hit_tokens = 0  # the minimum over workers, as the scheduler sees it
        self._ctx = zmq.Context()
        self._socks = []
        for address in self.addresses:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.connect(address)
            self._socks.append(sock)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _ask(self, msg: dict) -> list[Optional[dict]]:
        """One reply per worker (None: no answer in time, or an error reply)."""
        with self._lock:
            rid = next(self._ids)
            payload = seal(msgpack.packb({**msg, "id": rid}), self._token, reply=False)
            replies: list[Optional[dict]] = [None] * len(self._socks)
            for sock in self._socks:
                try:
                    sock.send(payload, zmq.NOBLOCK)
                except zmq.ZMQError:  # queue full: that worker is not keeping up
                    pass
            deadline = time.monotonic() + self.timeout_s
            waiting = set(range(len(self._socks)))
            poller = zmq.Poller()
            for sock in self._socks:
                poller.register(sock, zmq.POLLIN)
            while waiting:
                left_ms = (deadline - time.monotonic()) * 1000
                if left_ms <= 0:
                    break
                ready = dict(poller.poll(left_ms))
                for i in list(waiting):
                    sock = self._socks[i]
                    while sock in ready and sock.poll(0):
                        try:
                            frame = sock.recv(zmq.NOBLOCK, copy=False)
                            if self._gates[i].principal(frame) is None:
                                raise AuthError("a reply from a peer of another uid")
                            reply = _unpack(unseal(frame.bytes, self._token, reply=True))
                        except Exception:
                            self.num_errors += 1
                            continue
                        if reply["id"] != rid:
                            continue  # a late answer to an earlier, timed-out question
                        if reply.get("ok") is True:
                            replies[i] = reply
                        else:
                            self.num_errors += 1
                        waiting.discard(i)
                        break
            if waiting:
                self.num_timeouts += 1
                logger.warning("kvconnect: %d of %d workers did not answer a %s within %.2f s; treating it as a miss",
                               len(waiting), len(self._socks), msg.get("op"), self.timeout_s)
            return replies

    def lookup(self, tokens: np.ndarray, namespace: bytes = b"", *, count: bool = True,
               generation: Optional[bytes] = None, media: Sequence[MediaItem] = ()) -> int:
        """Tokens every worker can restore from token 0 (0 if any worker fails or is silent).

        ``count=False``: a probe (P/D waits, pd.py) left out of the lookup figures.
        ``generation``: the key generation to look under (None: each worker's own).
        ``media``: the prompt's multimodal items (kvconnect/chunks/extra_keys.py)."""
        msg = {"op": "lookup", "tokens": np.ascontiguousarray(tokens, dtype="<i8").tobytes()}
        if namespace:
            msg["ns"] = bytes(namespace)
        if media:
            msg["mm"] = pack_media(media)
        if generation is not None:
            msg["gen"] = generation_bytes(generation)
        if not count:
            msg["probe"] = True  # the workers serve a probe's hit as it is, never sampling it for verification
        if count:
            self.num_lookups += 1  # figures for kvconnect.metrics (the scheduler calls from one thread)
            self.requested_tokens += len(tokens)
        hits = []
        for reply in self._ask(msg):
            hit = reply.get("hit") if reply else None
            if not isinstance(hit, int) or hit < 0:
                return 0
            hits.append(hit)
        if count:
            self.hit_tokens += min(hits)
        return min(hits)

    def stats(self) -> list[Optional[dict]]:
        return [r.get("stats") if r else None for r in self._ask({"op": "stats"})]

    def clear(self, generation: Optional[bytes] = None, retire: Optional[bytes] = None) -> bool:
        """Every worker resets its engine to ``generation`` (None: a random one each), leaving
        ``retire``'s marker in the tiers when given; True when all did."""
        msg: dict = {"op": "clear"}
        if generation is not None:
            msg["gen"] = generation_bytes(generation)
        if retire is not None:
            msg["retire"] = generation_bytes(retire)
        return all(r is not None for r in self._ask(msg))

    def retired(self, generation: bytes) -> bool:
        """Whether a producer left ``generation`` behind: True when any worker reads its marker,
        and when any worker does not answer (a decode then recomputes rather than risk stale KV)."""
        replies = self._ask({"op": "retired", "gen": generation_bytes(generation)})
        return any(r is None or r.get("retired") is not False for r in replies)

    def tp_refusal(self, tp_size: int) -> Optional[str]:
        """Why some worker cannot restore what ranks of TP size ``tp_size`` stored (the first
        such reason, naming the worker), or None when every worker can. A worker that does not
        answer is a reason too: the caller then does not wait on chunks it may not read."""
        for i, reply in enumerate(self._ask({"op": "tp_refusal", "tp": int(tp_size)})):
            why = reply.get("refusal") if reply else None
            if not isinstance(why, str):
                return f"worker {i} did not answer whether it reads TP {tp_size}'s chunks"
            if why:
                return f"worker {i}: {why}"
        return None

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()
