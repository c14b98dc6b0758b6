"""A peer of the node cache server that the tests start as another user (or as this one).

    python foreign_peer.py URL --uid 65534 [--token T] forge KEY_HEX...   # the issue-31 attack
    python foreign_peer.py URL --uid 65534 hold N                         # N sessions at once
    python foreign_peer.py URL --uid 65534 serve                          # a server squatting URL

Imports happen before privileges drop (the new uid may not read the interpreter's caches);
the connection is made after, so the server's SO_PEERCRED sees the new uid. Prints one JSON
object: what each step got (a status, or "no reply").

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
    ap.add_argument("--token", default=None)
    ap.add_argument("op", choices=["forge", "hold", "serve"])
    ap.add_argument("args", nargs="*")
    a = ap.parse_args()
    if a.uid is not None:
        os.setgroups([])
        os.setgid(a.uid)
        os.setuid(a.uid)
    if a.op == "serve":
        serve(a.url, a.token)
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


def serve(url: str, token) -> None:
    """Serve ``url`` (as the new uid) until stdin closes."""
    import sys
    import threading

    from kvconnect.server.server import CacheServer

    server = CacheServer(url, 1 << 20, page_bytes=4096, token=token)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    print(json.dumps({"uid": os.geteuid(), "ready": server.url}), flush=True)
    sys.stdin.read()
    stop.set()
    thread.join(timeout=10)
    server.close()


if __name__ == "__main__":
    main()
