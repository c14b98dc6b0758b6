"""A peer of the node cache server that the tests start as another user (or as this one).

    python foreign_peer.py URL --uid 65534 [--token T] forge KEY_HEX...   # the issue-31 attack
    python foreign_peer.py URL --uid 65534 hold N                         # N sessions at once
    python foreign_peer.py URL --uid 65534 squat VICTIM_UID FP_HEX KEY_HEX... # the issue-39 squatter

Imports happen before privileges drop (the new uid may not read the interpreter's caches);
the connection is made after, so the server's SO_PEERCRED sees the new uid. Prints one JSON
object: what each step got (a status, or "no reply").

squat: bind URL as a server of the new uid that admits VICTIM_UID, open the socket file and
the segment to everyone, and store each KEY (fingerprint FP) with bytes 0xEE and a checksum
it computed itself; then on each stdin line ``unlink``, unlink the socket path (the open
connections stay) so that the real server can bind it again. Prints ``{"uid", "ready"}``,
then ``{"unlinked": true}`` per line; exits at stdin's end without touching the path again.

forge: acquire the victims' entries (learning their headers and pages), release them, remove
them, reserve the freed pages and commit each victim's header on *another* victim's former
page: a victim reading its key then gets the other prompt's bytes unless something checks.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets

import zmq

from kvconnect.errors import StorageError
from kvconnect.server import protocol
from kvconnect.server.channel import Channel
from kvconnect.server.protocol import Limits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--uid", type=int, default=None)
    ap.add_argument("--gid", type=int, default=None, help="the group to run as (default: the uid)")
    ap.add_argument("--token", default=None)
    ap.add_argument("op", choices=["forge", "hold", "squat"])
    ap.add_argument("args", nargs="*")
    a = ap.parse_args()
    if a.uid is not None:
        os.setgroups([])
        os.setgid(a.uid if a.gid is None else a.gid)
        os.setuid(a.uid)
    if a.op == "squat":
        squat(a.url, int(a.args[0]), bytes.fromhex(a.args[1]), [bytes.fromhex(k) for k in a.args[2:]])
        return
    ctx = zmq.Context()
    channel = Channel(ctx, a.url, token=protocol.token_bytes(a.token), limits=Limits(), timeout_s=1.0)
    out: dict = {"uid": os.geteuid()}
    try:
        if a.op == "forge":
            out.update(forge(channel, [bytes.fromhex(k) for k in a.args]))
        else:
            out.update(hold(channel, int(a.args[0])))
    finally:
        channel.close()
        ctx.term()
    print(json.dumps(out))


def ask(channel: Channel, op: str, args: list, client_id: bytes, instance) -> tuple:
    try:
        return channel.request(op, args, client_id, instance)
    except StorageError:
        return "no reply", None


def forge(channel: Channel, keys: list[bytes]) -> dict:
    cid = secrets.token_bytes(16)
    status, result = ask(channel, "hello", [os.getpid(), None, 4096], cid, None)
    if status != protocol.OK:
        return {"hello": status}
    instance = result[0]
    status, result = ask(channel, "acquire", [keys], cid, instance)
    if status != protocol.OK:
        return {"hello": 0, "acquire": status}
    items = result[0]
    pages = [item[1] for item in items]
    headers = [item[2] for item in items]
    ask(channel, "release", [[item[0] for item in items]], cid, instance)
    removed = [ask(channel, "remove", [k], cid, instance)[1] for k in keys]
    status, result = ask(channel, "reserve", [len(keys)], cid, instance)
    slots = result[0] if status == protocol.OK else []
    committed = 0
    for i, k in enumerate(keys):  # victim i's header on victim i+1's former page
        page = pages[(i + 1) % len(keys)]
        if page in slots:
            status, _ = ask(channel, "commit", [k, headers[i], page], cid, instance)
            committed += status == protocol.OK
    return {"hello": 0, "acquire": 0, "removed": removed, "reserved": slots, "committed": committed}


def hold(channel: Channel, n: int) -> dict:
    ok, refusal = 0, None
    for _ in range(n):
        status, result = ask(channel, "hello", [os.getpid(), None, 4096], secrets.token_bytes(16), None)
        if status == protocol.OK:
            ok += 1
        else:
            refusal = status if result is None else str(result)
    return {"sessions": ok, "refusal": refusal}


def squat(url: str, victim_uid: int, fingerprint: bytes, keys: list[bytes]) -> None:
    import sys
    import threading

    from kvconnect.chunks.chunk_format import ChunkHeader
    from kvconnect.server.admission import PeerPolicy
    from kvconnect.server.client import SharedPoolClient
    from kvconnect.server.server import CacheServer

    page = 4096
    server = CacheServer(url, 1 << 20, page_bytes=page, peers=PeerPolicy(allow_uids=frozenset({victim_uid})))
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    path = protocol.ipc_path(url)
    os.chmod(path, 0o777)
    os.chmod(server.segment.path, 0o666)
    own = SharedPoolClient(url, page, timeout_s=5.0, fingerprint=fingerprint)  # its own uid's server: trusted
    for k in keys:  # what the victim would load: the attacker's bytes, their checksum right
        (slot,) = own.reserve(1)
        own.slot_view(slot)[:page] = 0xEE
        header = ChunkHeader(fingerprint=fingerprint, key=k, token_start=0, token_end=64, group_mask=1,
                             plane_rows=((0, 4),), payload_bytes=page)
        assert own.commit(k, header, slot).live
    own.close()
    print(json.dumps({"uid": os.geteuid(), "ready": url}), flush=True)
    for line in sys.stdin:
        if line.strip() == "unlink":
            os.unlink(path)
            print(json.dumps({"unlinked": True}), flush=True)
    stop.set()
    thread.join(timeout=10)
    os._exit(0)  # not server.close(): the path may be the real server's again


if __name__ == "__main__":
    main()
