"""Issue 31, the lookup channel: only the engine's own processes may probe what is cached or
clear it.

Real sockets and a real second user: the foreign peer is a subprocess that drops to uid
65534 (nobody) before it connects, so the worker's ``SO_PEERCRED`` check sees another uid.
It speaks the wire format with a bare DEALER (``LookupClient`` would itself drop the
replies of a server of another uid, which would hide whether the server answered).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile

import msgpack
import numpy as np
import pytest
import zmq

from kvconnect.errors import ConfigError
from kvconnect.integrations.vllm.lookup_channel import LookupClient, LookupServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as uid 65534 (nobody): setuid")

# The foreign peer: imports first (the new uid may not read the interpreter's caches), then
# drops to NOBODY, connects, sends a lookup and a clear, and prints what came back.
FOREIGN_PEER = r"""
import json, os, sys
import msgpack, zmq
address = sys.argv[1]
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
ctx = zmq.Context(); sock = ctx.socket(zmq.DEALER); sock.setsockopt(zmq.LINGER, 0); sock.connect(address)
got = {}
for rid, msg in ((1, {"op": "lookup", "tokens": bytes(8 * 64)}), (2, {"op": "clear", "gen": bytes(16)})):
    sock.send(msgpack.packb({**msg, "id": rid}))
    got[msg["op"]] = msgpack.unpackb(sock.recv(), raw=False) if sock.poll(1500) else "no reply"
sock.close(); ctx.term()
print(json.dumps({"uid": os.geteuid(), **got}))
"""

# A squatter: a ROUTER of another uid, bound first at a worker's address, that answers anyone
# with a hit for every token (a bare socket: a LookupServer would refuse our uid).
SQUATTER = r"""
import json, os, sys, threading
import msgpack, zmq
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER); sock.setsockopt(zmq.LINGER, 0); sock.bind(sys.argv[1])
os.chmod(sys.argv[1][len("ipc://"):], 0o666)
print(json.dumps({"ready": True}), flush=True)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    if sock.poll(100):
        identity, raw = sock.recv_multipart()
        msg = msgpack.unpackb(raw, raw=False)
        sock.send_multipart([identity, msgpack.packb({"id": msg["id"], "ok": True, "hit": len(msg.get("tokens", b"")) // 8})])
sock.close(); ctx.term()
"""


class Recorder:
    def __init__(self, hit: int) -> None:
        self.hit, self.lookups, self.cleared = hit, 0, 0

    def lookup(self, tokens, namespace=b"", generation=None, media=()):
        self.lookups += 1
        return self.hit

    def stats(self):
        return {"lookups": self.lookups}

    def clear(self, generation=None, retire=None):
        self.cleared += 1


@pytest.fixture
def open_dir():
    """A short /tmp directory every user may enter: only the socket's own mode is under test."""
    path = tempfile.mkdtemp(prefix="kvc-lookup-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_"))}
    e["PYTHONPATH"] = os.pathsep.join([REPO, e.get("PYTHONPATH", "")])
    return e


def foreign_peer(address: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FOREIGN_PEER, address, str(NOBODY)], capture_output=True, text=True,
                         timeout=120, env=env(), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- tcp: a token or nothing -------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, ""])
def test_a_tcp_channel_without_a_token_is_refused_at_start(token):
    address = f"tcp://127.0.0.1:{free_port()}"
    for start in (lambda: LookupServer(address, Recorder(64), token=token), lambda: LookupClient([address], token=token)):
        with pytest.raises(ConfigError, match="KVCONNECT_LOOKUP_TOKEN"):
            start()
    with socket.socket() as s:  # nothing was left bound
        s.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))


def test_a_tcp_channel_answers_only_frames_tagged_with_its_token():
    address = f"tcp://127.0.0.1:{free_port()}"
    handler = Recorder(192)
    server = LookupServer(address, handler, token="engine-secret")
    try:
        client = LookupClient([address], timeout_s=5.0, token="engine-secret")
        assert client.lookup(np.arange(200)) == 192
        assert client.clear(b"\x07" * 16) and handler.cleared == 1
        client.close()
        intruder = LookupClient([address], timeout_s=0.5, token="a-guess")
        assert intruder.lookup(np.arange(200)) == 0 and not intruder.clear()
        intruder.close()
        ctx = zmq.Context()  # a frame with no tag at all, as a token-less peer sends it
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(msgpack.packb({"id": 1, "op": "clear"}))
        assert not sock.poll(500)  # dropped unanswered: no oracle
        sock.close()
        ctx.term()
        assert (handler.lookups, handler.cleared) == (1, 1)
        assert server.num_refused == 3
    finally:
        server.close()


# --- ipc: the owner's uid only -----------------------------------------------------------------
def test_the_ipc_socket_is_born_owner_only_and_the_umask_is_restored(open_dir):
    old = os.umask(0o022)
    try:
        server = LookupServer(f"ipc://{open_dir}/w-0", Recorder(64))
        assert os.umask(0o022) == 0o022  # the bind's umask did not outlive it
    finally:
        os.umask(old)
    try:
        st = os.stat(f"{open_dir}/w-0")
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    finally:
        server.close()


@needs_root
def test_a_foreign_uid_gets_no_answer_and_cannot_clear(open_dir):
    address = f"ipc://{open_dir}/w-0"
    handler = Recorder(448)
    server = LookupServer(address, handler)
    try:
        # the file mode refuses the connection itself
        assert foreign_peer(address) == {"uid": NOBODY, "lookup": "no reply", "clear": "no reply"}
        assert server.num_refused == 0
        # a mode loosened by hand: the frames arrive, SO_PEERCRED names the uid, they are dropped
        os.chmod(address[len("ipc://"):], 0o666)
        assert foreign_peer(address) == {"uid": NOBODY, "lookup": "no reply", "clear": "no reply"}
        assert server.num_refused == 2
        assert (handler.lookups, handler.cleared) == (0, 0)
        client = LookupClient([address], timeout_s=5.0)  # the engine's own scheduler still is answered
        assert client.lookup(np.arange(500)) == 448 and client.clear()
        assert (handler.lookups, handler.cleared) == (1, 1)
        client.close()
    finally:
        server.close()


@needs_root
def test_the_scheduler_ignores_a_server_of_another_uid(open_dir):
    os.chmod(open_dir, 0o777)  # the squatter may create its socket here
    address = f"ipc://{open_dir}/w-0"
    squatter = subprocess.Popen([sys.executable, "-c", SQUATTER, address, str(NOBODY)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    try:
        assert json.loads(squatter.stdout.readline()) == {"ready": True}, squatter.stderr.read()[-3000:]
        client = LookupClient([address], timeout_s=1.0)
        assert client.lookup(np.arange(512)) == 0  # a miss, not the squatter's 512
        assert client.num_errors == 1
        client.close()
    finally:
        squatter.stdin.close()
        squatter.wait(timeout=60)


def test_a_socket_path_of_another_user_is_refused(open_dir):
    path = f"{open_dir}/w-0"
    with open(path, "w") as f:
        f.write("squat")
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    else:
        pytest.skip("needs root to give the file to another user")
    with pytest.raises(ConfigError, match=f"{path} exists and belongs to uid {NOBODY}"):
        LookupServer(f"ipc://{path}", Recorder(64))
    with open(path) as f:
        assert f.read() == "squat"  # left as found


def test_a_socket_a_live_engine_listens_on_is_refused_and_a_dead_ones_is_taken(open_dir):
    """Two engines (or two data-parallel ranks) given the same lookup_url: the second refuses to
    start, naming the address, instead of unlinking the first one's socket and taking its
    lookups. A file whose listener died is removed and bound again."""
    address = f"ipc://{open_dir}/w-0"
    first = LookupServer(address, Recorder(64))
    try:
        with pytest.raises(ConfigError, match="is in use: a live process of this uid listens on it"):
            LookupServer(address, Recorder(128))
        client = LookupClient([address], timeout_s=5.0)
        assert client.lookup(np.arange(500)) == 64  # still the first engine's
        client.close()
    finally:
        first.close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a listener that died: its file stays, nobody accepts
    stale.bind(f"{open_dir}/w-1")
    stale.close()
    assert os.path.exists(f"{open_dir}/w-1")
    second = LookupServer(f"ipc://{open_dir}/w-1", Recorder(256))
    try:
        client = LookupClient([f"ipc://{open_dir}/w-1"], timeout_s=5.0)
        assert client.lookup(np.arange(500)) == 256
        client.close()
    finally:
        second.close()
