"""The cache server's control channel: frame layout, fixed msgpack schema, limits, HMAC.

Only control messages cross the socket; chunk bytes stay in shared memory. A frame is::

    body                    (no token)
    body || HMAC-SHA256     (token set: 32-byte tag over a direction label + body)

and ``body`` is msgpack of one fixed-shape array (no maps, no extension types)::

    request: [PROTOCOL_VERSION, op: str, request_id: int, client_id: bin16,
              instance: bin16 | nil, args: array]
    reply:   [PROTOCOL_VERSION, request_id: int, status: int, result: array | str]

Receiving, in this order, each step refusing the frame with ``ProtocolError`` before the
next one runs: the frame size (``Limits.max_frame_bytes``), the tag (``hmac.compare_digest``;
checked before a single byte is decoded), msgpack decoding with every length bounded,
maps and extension types refused (``max_map_len=0``, ``max_ext_len=0``; the frame size and
msgpack's own stack limit bound the work), the nesting depth (``Limits.max_nesting``),
then the schema of the op (``check_request``): exact arity, types, ranges, at most
``Limits.max_keys`` keys or ids per request. Nothing here can execute code: msgpack yields
only None/bool/int/float/str/bytes/list, and the schema narrows that further.

The direction label makes a captured request useless as a reply and the reverse.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

import msgpack
import numpy as np

from ..chunks.chunk_format import ChunkHeader
from ..errors import ConfigError, KVConnectError
from ..layout.spec import ChunkKey, Fingerprint
from .shm import SegmentInfo

PROTOCOL_VERSION = 1
TAG_BYTES = 32
ID_BYTES = 16  # client ids, server instance ids, chunk keys and fingerprints
MAX_INT = (1 << 64) - 1

OK = 0
BAD_REQUEST = 1
UNKNOWN_CLIENT = 2  # never said hello, or its lease expired: say hello again
STALE_INSTANCE = 3  # addressed to a previous server instance: state is gone, re-map
INTERNAL = 4

_REQUEST_LABEL = b"kvconnect-request\0"
_REPLY_LABEL = b"kvconnect-reply\0"


class ProtocolError(KVConnectError, ValueError):
    """A frame was refused: too large, unauthenticated, undecodable or off-schema."""


class AuthError(ProtocolError):
    """A frame's authentication tag is missing or wrong (the server drops it unanswered)."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Bounds on every frame (defaults fit 4096 keys with headers of a few hundred planes)."""

    max_frame_bytes: int = 1 << 20
    max_keys: int = 4096
    max_nesting: int = 5  # the deepest messages (acquire and reserve replies) nest 5 lists
    max_planes: int = 4096

    def __post_init__(self) -> None:
        if min(self.max_frame_bytes, self.max_keys, self.max_nesting, self.max_planes) <= 0:
            raise ConfigError(f"protocol limits must be > 0, got {self}")


@dataclass(frozen=True)
class Request:
    op: str
    request_id: int
    client_id: bytes
    instance: Optional[bytes]
    args: list


# --- frames ----------------------------------------------------------------------------


def _tag(token: bytes, label: bytes, body: bytes) -> bytes:
    return hmac.new(token, label + body, hashlib.sha256).digest()


def seal(body: bytes, token: Optional[bytes], *, reply: bool) -> bytes:
    """A frame ready to send: ``body`` plus its tag when a token is set."""
    if token is None:
        return body
    return body + _tag(token, _REPLY_LABEL if reply else _REQUEST_LABEL, body)


def unseal(frame: bytes, token: Optional[bytes], *, reply: bool) -> bytes:
    """``frame``'s body once its tag matches (``hmac.compare_digest``); AuthError otherwise.
    Without a token the frame is the body."""
    if token is None:
        return frame
    if len(frame) < TAG_BYTES:
        raise AuthError("frame too short to carry its authentication tag")
    body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
    if not hmac.compare_digest(_tag(token, _REPLY_LABEL if reply else _REQUEST_LABEL, body), tag):
        raise AuthError("bad authentication tag")
    return body


def open_frame(frame: bytes, token: Optional[bytes], limits: Limits, *, reply: bool) -> Any:
    """Size check, tag check (before decoding), bounded decode, nesting check."""
    if len(frame) > limits.max_frame_bytes + (TAG_BYTES if token is not None else 0):
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {limits.max_frame_bytes}-byte limit")
    body = unseal(frame, token, reply=reply)
    try:
        obj = msgpack.unpackb(
            body, raw=False, use_list=True, strict_map_key=True,
            max_str_len=limits.max_frame_bytes, max_bin_len=limits.max_frame_bytes, max_array_len=max(limits.max_keys, 16),
            max_map_len=0, max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException) as exc:  # ExtraData, StackError, FormatError, bad UTF-8
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
    check_nesting(obj, limits.max_nesting)
    return obj


def check_nesting(obj: Any, max_nesting: int) -> None:
    """Raise ProtocolError when lists nest deeper than ``max_nesting`` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list):
            if depth > max_nesting:
                raise ProtocolError(f"frame nests deeper than {max_nesting} levels")
            stack.extend((child, depth + 1) for child in item if isinstance(child, list))
        elif isinstance(item, dict):  # unreachable with max_map_len=0; kept as a guard
            raise ProtocolError("maps are not part of the schema")


def pack_request(op: str, request_id: int, client_id: bytes, instance: Optional[bytes], args: list, token: Optional[bytes]) -> bytes:
    body = msgpack.packb([PROTOCOL_VERSION, op, request_id, client_id, instance, args], use_bin_type=True)
    return seal(body, token, reply=False)


def pack_reply(request_id: int, status: int, result: Any, token: Optional[bytes]) -> bytes:
    body = msgpack.packb([PROTOCOL_VERSION, request_id, status, result], use_bin_type=True)
    return seal(body, token, reply=True)


# --- schema ----------------------------------------------------------------------------


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be an int in [{lo}, {hi}], got {type(value).__name__}")
    return value


def _id(value: Any, what: str) -> bytes:
    if type(value) is not bytes or len(value) != ID_BYTES:
        raise ProtocolError(f"{what} must be {ID_BYTES} bytes")
    return value


def _list(value: Any, what: str, max_len: int) -> list:
    if type(value) is not list or len(value) > max_len:
        raise ProtocolError(f"{what} must be a list of at most {max_len} items")
    return value


def check_header(value: Any, limits: Limits) -> list:
    """A ChunkHeader as sent: [fingerprint, key, token_start, token_end, group_mask,
    plane_rows, payload_bytes, checksum]; plane_rows is bin of little-endian u32
    (first_row, num_rows) pairs, one per plane (one object, not P small lists: a reply
    for thousands of chunks decodes without feeding the garbage collector)."""
    h = _list(value, "header", 8)
    if len(h) != 8:
        raise ProtocolError("header must have 8 fields")
    _id(h[0], "header fingerprint")
    _id(h[1], "header key")
    start, end = _int(h[2], "token_start"), _int(h[3], "token_end")
    if end < start:
        raise ProtocolError("header token range is reversed")
    _int(h[4], "group_mask")
    if type(h[5]) is not bytes or len(h[5]) % 8 or len(h[5]) > 8 * limits.max_planes:
        raise ProtocolError(f"plane_rows must be bin of at most {limits.max_planes} (u32, u32) pairs")
    _int(h[6], "payload_bytes")
    _int(h[7], "checksum")
    return h


def header_to_wire(h: ChunkHeader) -> list:
    rows = np.asarray(h.plane_rows, dtype="<u4").reshape(-1, 2).tobytes()
    return [bytes(h.fingerprint), bytes(h.key), h.token_start, h.token_end, h.group_mask, rows, h.payload_bytes, h.checksum]


def header_from_wire(h: list) -> ChunkHeader:
    """The ChunkHeader of a wire header already passed through ``check_header``."""
    rows = np.frombuffer(h[5], dtype="<u4").reshape(-1, 2).tolist()
    return ChunkHeader(
        fingerprint=Fingerprint(h[0]), key=ChunkKey(h[1]), token_start=h[2], token_end=h[3], group_mask=h[4],
        plane_rows=tuple((a, n) for a, n in rows), payload_bytes=h[6], checksum=h[7],
    )


def _keys(value: Any, limits: Limits) -> list:
    keys = _list(value, "keys", limits.max_keys)
    for k in keys:
        _id(k, "key")
    return keys


def _ints(value: Any, what: str, limits: Limits) -> list:
    items = _list(value, what, limits.max_keys)
    for v in items:
        _int(v, what)
    return items


# op -> checker of its args list (returns the args, validated)
def _args_hello(a: list, limits: Limits) -> list:
    if len(a) != 3:
        raise ProtocolError("hello takes [pid, fingerprint | nil, slot_bytes]")
    _int(a[0], "pid")
    if a[1] is not None:
        _id(a[1], "fingerprint")
    _int(a[2], "slot_bytes", lo=1)
    return a


def _args_none(a: list, limits: Limits) -> list:
    if a:
        raise ProtocolError("this op takes no arguments")
    return a


def _args_keys(a: list, limits: Limits) -> list:
    if len(a) != 1:
        raise ProtocolError("this op takes [keys]")
    _keys(a[0], limits)
    return a


def _args_ids(a: list, limits: Limits) -> list:
    if len(a) != 1:
        raise ProtocolError("this op takes [ids]")
    _ints(a[0], "ids", limits)
    return a


def _args_reserve(a: list, limits: Limits) -> list:
    if len(a) != 1:
        raise ProtocolError("reserve takes [n]")
    _int(a[0], "n", hi=limits.max_keys)
    return a


def _args_commit(a: list, limits: Limits) -> list:
    if len(a) != 3:
        raise ProtocolError("commit takes [key, header, slot]")
    _id(a[0], "key")
    check_header(a[1], limits)
    _int(a[2], "slot")
    return a


def _args_remove(a: list, limits: Limits) -> list:
    if len(a) != 1:
        raise ProtocolError("remove takes [key]")
    _id(a[0], "key")
    return a


def _args_clear(a: list, limits: Limits) -> list:
    if len(a) != 1:
        raise ProtocolError("clear takes [fingerprint | nil]")
    if a[0] is not None:
        _id(a[0], "fingerprint")
    return a


ARGS = {
    "hello": _args_hello,
    "ping": _args_none,
    "bye": _args_none,
    "masks": _args_keys,
    "acquire": _args_keys,
    "release": _args_ids,
    "reserve": _args_reserve,
    "commit": _args_commit,
    "abort": _args_ids,
    "remove": _args_remove,
    "clear": _args_clear,
    "stats": _args_none,
}


def check_request(obj: Any, limits: Limits) -> Request:
    """The validated request in a decoded frame, or ProtocolError."""
    if type(obj) is not list or len(obj) != 6:
        raise ProtocolError("a request is [version, op, request_id, client_id, instance, args]")
    version, op, request_id, client_id, instance, args = obj
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"protocol version {version!r}, this server speaks {PROTOCOL_VERSION}")
    if type(op) is not str or op not in ARGS:
        raise ProtocolError("unknown op")
    _int(request_id, "request_id")
    _id(client_id, "client_id")
    if instance is not None:
        _id(instance, "instance")
    if type(args) is not list:
        raise ProtocolError("args must be a list")
    return Request(op, request_id, client_id, instance, ARGS[op](args, limits))


def check_reply(obj: Any) -> tuple[int, int, Any]:
    """(request_id, status, result) of a decoded reply; the caller checks the result's shape."""
    if type(obj) is not list or len(obj) != 4 or obj[0] != PROTOCOL_VERSION:
        raise ProtocolError("a reply is [version, request_id, status, result]")
    _, request_id, status, result = obj
    _int(request_id, "request_id")
    _int(status, "status", hi=255)
    return request_id, status, result


def check_hello_reply(status: int, result: Any) -> tuple[SegmentInfo, float]:
    """(segment to map, lease seconds) from a hello reply: [instance, segment name,
    page_bytes, num_pages, lease_s, max_frame_bytes]."""
    if status != OK:
        raise ProtocolError(f"hello refused: {result}")
    if type(result) is not list or len(result) != 6 or type(result[0]) is not bytes or len(result[0]) != ID_BYTES \
            or type(result[1]) is not str or type(result[2]) is not int or type(result[3]) is not int \
            or result[2] <= 0 or result[3] <= 0:
        raise ProtocolError("malformed hello reply")
    lease_s = check_float(result[4], "lease_s")
    return SegmentInfo(name=result[1], instance=result[0], page_bytes=result[2], num_pages=result[3]), lease_s


def check_float(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ProtocolError(f"{what} must be a positive finite number")
    return float(value)


# --- addresses ---------------------------------------------------------------------------


def is_loopback(url: str) -> bool:
    """True for ``ipc://`` and for ``tcp://`` on a loopback address (never for ``tcp://*``)."""
    parts = urlsplit(url)
    if parts.scheme == "ipc":
        return True
    if parts.scheme != "tcp":
        return False
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, *, token: Optional[bytes], allow_remote: bool) -> str:
    """Raise ConfigError unless ``url`` may be used: ipc:// always (the kernel names each peer,
    see ``admission``); tcp:// only with a token, loopback or not (any local user can connect
    to a loopback port, and nothing tells the server who did), and a non-loopback address
    only with ``allow_remote`` too (the server's explicit flag)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ipc", "tcp"):
        raise ConfigError(f"cache server URL must be ipc:// or tcp://, got {url!r}")
    if parts.scheme == "ipc" and not parts.path and not parts.netloc:
        raise ConfigError(f"ipc:// URL needs a socket path, got {url!r}")
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"bad port in {url!r}: {exc}") from exc
        if port is None:
            raise ConfigError(f"tcp:// URL needs a port, got {url!r}")
    if parts.scheme == "tcp" and token is None:
        raise ConfigError(f"{url!r} is a tcp:// address: a token (KVCONNECT_SERVER_TOKEN or --token-file) is required, "
                          "loopback or not (any user on the host can reach a TCP port); or use ipc://")
    if not is_loopback(url):
        if not allow_remote:
            raise ConfigError(f"{url!r} is not a loopback address: pass --allow-remote to bind it")
    return url


def ipc_path(url: str) -> Optional[str]:
    """The socket file of an ``ipc://`` URL, else None."""
    return url[len("ipc://") :] if url.startswith("ipc://") else None


def token_bytes(token: Optional[str]) -> Optional[bytes]:
    """The HMAC key for a configured token (None = no authentication)."""
    if token is None or token == "":
        return None
    return token.encode("utf-8")
