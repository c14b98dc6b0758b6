"""The cache server's control channel under hostile input.

Unit level: the address policy, HMAC sealing (every flipped byte refused, a reply never
passes as a request), size / nesting / extension-type / map / pickle refusals, and
hypothesis fuzzing of ``open_frame`` + ``check_request``: random bytes, random msgpack
structures and mutated valid requests are either a valid request or a ``ProtocolError``,
never anything else.

Live: the same fuzz sent to a running server over a raw socket. Each refused frame gets
a BAD_REQUEST reply (or none, when its size makes libzmq drop the peer or its tag is
wrong) and a well-behaved client keeps being served, with the same bytes, after each one.
A pickle payload whose unpickling would create a file creates nothing.
"""

from __future__ import annotations

import os
import pickle

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.errors import ConfigError
from kvconnect.server import protocol
from kvconnect.server.client import SharedPoolClient
from kvconnect.server.protocol import BAD_REQUEST, Limits, ProtocolError
from support.server_rig import PAGE, server_thread, socket_dir

LIMITS = Limits()
CID, INST, FP = b"c" * 16, b"i" * 16, b"F" * 16
KEY = b"k" * 16
ROWS = b"\x00\x00\x00\x00\x04\x00\x00\x00" * 2  # two planes, rows [0, 4): (u32, u32) pairs
HEADER = [FP, KEY, 0, 64, 1, ROWS, PAGE, 0]
VALID = {
    "hello": [1, FP, PAGE],
    "ping": [],
    "masks": [[KEY, KEY]],
    "acquire": [[KEY]],
    "release": [[1, 2]],
    "reserve": [3],
    "commit": [KEY, HEADER, 0],
    "abort": [[0]],
    "remove": [KEY],
    "clear": [None],
    "stats": [],
    "bye": [],
}


def decode(frame: bytes, token=None):
    return protocol.check_request(protocol.open_frame(frame, token, LIMITS, reply=False), LIMITS)


def raw_request(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# --- unit ------------------------------------------------------------------------------


@pytest.mark.parametrize("url,token,allow,ok", [
    ("ipc:///tmp/x.sock", None, False, True),
    ("tcp://127.0.0.1:5555", None, False, False),  # any local user can reach a loopback port: a token is required
    ("tcp://[::1]:5555", None, False, False),
    ("tcp://localhost:5555", None, False, False),
    ("tcp://127.0.0.1:5555", b"t", False, True),
    ("tcp://[::1]:5555", b"t", False, True),
    ("tcp://localhost:5555", b"t", False, True),
    ("tcp://0.0.0.0:5555", None, False, False),
    ("tcp://*:5555", b"t", False, False),
    ("tcp://10.1.2.3:5555", b"t", False, False),
    ("tcp://10.1.2.3:5555", None, True, False),
    ("tcp://10.1.2.3:5555", b"t", True, True),
    ("tcp://127.0.0.1", None, False, False),
    ("http://127.0.0.1:80", None, False, False),
    ("ipc://", None, False, False),
])
def test_address_policy(url, token, allow, ok):
    if ok:
        assert protocol.check_url(url, token=token, allow_remote=allow) == url
    else:
        with pytest.raises(ConfigError):
            protocol.check_url(url, token=token, allow_remote=allow)


def test_every_valid_op_round_trips():
    for op, args in VALID.items():
        req = decode(protocol.pack_request(op, 7, CID, INST, args, None))
        assert (req.op, req.request_id, req.client_id, req.instance, req.args) == (op, 7, CID, INST, args)


@given(st.data())
def test_any_flipped_byte_breaks_the_tag(data):
    token = b"s3cret"
    frame = protocol.pack_request("masks", 1, CID, INST, [[KEY]], token)
    assert decode(frame, token).op == "masks"
    pos = data.draw(st.integers(0, len(frame) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(frame)
    bad[pos] ^= 1 << bit
    with pytest.raises(ProtocolError, match="authentication"):
        decode(bytes(bad), token)


def test_tags_bind_token_and_direction():
    token = b"s3cret"
    frame = protocol.pack_request("ping", 1, CID, INST, [], token)
    with pytest.raises(ProtocolError, match="authentication"):
        decode(frame, b"other")
    with pytest.raises(ProtocolError, match="authentication"):
        decode(frame[: -protocol.TAG_BYTES], token)  # untagged
    with pytest.raises(ProtocolError, match="short"):
        decode(b"\x90", token)
    reply = protocol.pack_reply(1, 0, [], token)
    with pytest.raises(ProtocolError, match="authentication"):
        decode(reply, token)  # a captured reply is not a request
    assert protocol.check_reply(protocol.open_frame(reply, token, LIMITS, reply=True)) == (1, 0, [])


@pytest.mark.parametrize("frame,reason", [
    (b"\xc4" + b"x" * (LIMITS.max_frame_bytes + 1), "exceeds"),
    (b"\x91" * 100_000 + b"\xc0", "undecodable|deeper"),  # msgpack's own stack limit
    (raw_request([[[[[[[[1]]]]]]]]), "deeper"),
    (raw_request([1, "masks", 1, CID, INST, [[msgpack.ExtType(1, b"x" * 16)]]]), "undecodable"),
    (raw_request([1, "ping", 1, CID, INST, [msgpack.Timestamp(1, 0)]]), "undecodable"),
    (raw_request({"op": "ping"}), "undecodable"),
    (raw_request([1, "masks", 1, CID, INST, [[b"k"] * (LIMITS.max_keys + 1)]]), "undecodable"),
    (raw_request([1, "masks", 1, CID, INST, [[b"short"]]]), "16 bytes"),
    (raw_request([1, "exec", 1, CID, INST, []]), "unknown op"),
    (raw_request([2, "ping", 1, CID, INST, []]), "version"),
    (raw_request([1, "ping", -1, CID, INST, []]), "request_id"),
    (raw_request([1, "reserve", 1, CID, INST, [1.5]]), "n must"),
    (raw_request([1, "reserve", 1, CID, INST, [True]]), "n must"),
    (raw_request([1, "commit", 1, CID, INST, [KEY, HEADER[:7], 0]]), "8 fields"),
    (raw_request([1, "commit", 1, CID, INST, [KEY, [*HEADER[:2], 9, 3, *HEADER[4:]], 0]]), "reversed"),
    (raw_request([1, "commit", 1, CID, INST, [KEY, [*HEADER[:5], ROWS[:-1], *HEADER[6:]], 0]]), "plane_rows"),
    (raw_request([1, "commit", 1, CID, INST, [KEY, [*HEADER[:5], [[0, 4]], *HEADER[6:]], 0]]), "plane_rows"),
    (raw_request([1, "commit", 1, CID, INST, [KEY, [*HEADER[:5], b"\0" * 8 * (LIMITS.max_planes + 1), *HEADER[6:]], 0]]), "plane_rows"),
    (raw_request([1, "ping", 1, CID, INST, []]) + b"\x00", "undecodable"),
    (raw_request([1, "ping", 1, CID, INST])[:-3], "undecodable"),
    (pickle.dumps({"op": "ping"}), "undecodable"),
    (b"", "undecodable"),
])
def test_malformed_frames_are_refused(frame, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(frame)


class Boom:
    """Unpickling this would create ``path``: the probe for code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


scalars = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=40)
structures = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=40)


def mutated_requests():
    """A valid request with one position (possibly nested) replaced by something random."""
    def mutate(op_value_path):
        (op, _), value, path = op_value_path
        obj = [1, op, 5, CID, INST, VALID[op]]
        obj = msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)  # deep copy
        target = obj
        for step in path[:-1]:
            if isinstance(target, list) and target:
                target = target[step % len(target)]
        if isinstance(target, list) and target:
            target[path[-1] % len(target)] = value
        return obj
    return st.tuples(st.sampled_from(sorted(VALID.items())), structures, st.lists(st.integers(0, 7), min_size=1, max_size=4)).map(mutate)


def check_decode_total(frame: bytes) -> None:
    """open + check either yields a request whose re-encoding decodes the same, or refuses."""
    try:
        req = decode(frame)
    except ProtocolError:
        return
    again = decode(protocol.pack_request(req.op, req.request_id, req.client_id, req.instance, req.args, None))
    assert again == req


@given(st.binary(max_size=300))
def test_fuzz_random_bytes(frame):
    check_decode_total(frame)


@given(structures)
def test_fuzz_random_structures(obj):
    check_decode_total(msgpack.packb(obj, use_bin_type=True))


@given(mutated_requests())
def test_fuzz_mutated_requests(obj):
    try:
        frame = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    check_decode_total(frame)


# --- live server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def live():
    """A server thread, a well-behaved client holding one known entry, and a raw socket."""
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock") as server:
        client = SharedPoolClient(server.url, PAGE, timeout_s=5.0, fingerprint=FP)
        (slot,) = client.reserve(1)
        client.slot_view(slot)[:] = 0x5A
        from kvconnect.chunks.chunk_format import ChunkHeader

        client.commit(KEY, ChunkHeader(fingerprint=FP, key=KEY, token_start=0, token_end=64, group_mask=3,
                                       plane_rows=((0, 4),), payload_bytes=PAGE), slot)
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.url)
        try:
            yield server, client, raw, d
        finally:
            raw.close()
            ctx.term()
            client.close()


def send_raw(raw: zmq.Socket, frames: list, wait_ms: int = 2000, token=None):
    """Send frames; the decoded reply (request_id, status, result), or None if none came."""
    raw.send_multipart(frames)
    if not raw.poll(wait_ms, zmq.POLLIN):
        return None
    return protocol.check_reply(protocol.open_frame(raw.recv(), token, LIMITS, reply=True))


def assert_still_serving(client: SharedPoolClient) -> None:
    assert client.connected
    assert client.masks([KEY, b"z" * 16]) == [3, None]
    (entry,) = client.acquire([KEY])
    assert bytes(client.entry_view(entry)[:8].numpy()) == b"\x5a" * 8
    client.release([entry])


@given(st.one_of(st.binary(max_size=200), structures.map(lambda o: msgpack.packb(o, use_bin_type=True)),
                 mutated_requests().map(lambda o: msgpack.packb(o, use_bin_type=True, unicode_errors="surrogatepass"))))
def test_live_fuzz_refused_and_others_still_served(live, frame):
    server, client, raw, _ = live
    reply = send_raw(raw, [frame])
    assert reply is not None
    try:
        decode(frame)
        valid = True
    except ProtocolError:
        valid = False
    if not valid:
        assert reply[:2] == (0, BAD_REQUEST)
    # a valid request from the raw socket's unknown client id is answered without side effects on others
    assert_still_serving(client)


def test_live_oversized_multipart_and_pickle(live):
    server, client, raw, d = live
    refused_before = client.server_stats()["refused_requests"]
    # within the transport bound but over the frame limit: refused with a reply
    assert send_raw(raw, [b"\xc4" + b"x" * (LIMITS.max_frame_bytes + 10)])[1] == BAD_REQUEST
    assert send_raw(raw, [b"a", b"b"])[1] == BAD_REQUEST  # two frames
    marker = os.path.join(d, "pwned")
    for payload in (pickle.dumps(Boom(marker)), raw_request([1, "masks", 1, CID, INST, [[pickle.dumps(Boom(marker))]]]),
                    raw_request([1, "ping", 1, CID, INST, [msgpack.ExtType(42, pickle.dumps(Boom(marker)))]])):
        assert send_raw(raw, [payload])[1] == BAD_REQUEST
    assert not os.path.exists(marker)
    assert client.server_stats()["refused_requests"] == refused_before + 5
    # beyond the transport bound: libzmq drops that peer, nobody else notices
    ctx = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(server.url)
    try:
        assert send_raw(big, [b"\x00" * (4 * LIMITS.max_frame_bytes)], wait_ms=500) is None
    finally:
        big.close()
        ctx.term()
    assert_still_serving(client)


def test_token_server_drops_unauthenticated_frames():
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", token="s3cret") as server:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.url)
        good = SharedPoolClient(server.url, PAGE, token="s3cret", timeout_s=5.0, fingerprint=FP)
        wrong = SharedPoolClient(server.url, PAGE, token="guess", timeout_s=0.3, fingerprint=FP)
        anonymous = SharedPoolClient(server.url, PAGE, timeout_s=0.3, fingerprint=FP)
        try:
            assert send_raw(raw, [protocol.pack_request("ping", 1, CID, None, [], None)], wait_ms=300) is None
            assert send_raw(raw, [protocol.pack_request("ping", 1, CID, None, [], b"guess")], wait_ms=300) is None
            assert send_raw(raw, [protocol.pack_request("ping", 1, CID, None, [], b"s3cret")], token=b"s3cret")[1] == protocol.UNKNOWN_CLIENT
            assert good.connected and len(good.reserve(2)) == 2
            for c in (wrong, anonymous):  # never an exception: misses, no slots, counted
                assert not c.connected
                assert c.masks([KEY]) == [None] and c.acquire([KEY]) == [None] and c.reserve(1) == []
                assert c.stats().extra["client"]["failed_hellos"] >= 1
        finally:
            for c in (good, wrong, anonymous):
                c.close()
            raw.close()
            ctx.term()
