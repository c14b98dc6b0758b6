"""Issue 31 item 1: the node cache server answers only peers it can authenticate, bounds
each peer's sessions, and a forged pool entry is a miss, never wrong bytes.

Run against a real server (a thread of this process), real sockets, and a real second user:
``foreign_peer.py`` drops to uid 65534 (nobody) before it connects, so the server's
``SO_PEERCRED`` sees another uid. The attack each test replays is the issue's: acquire the
victim's headers, remove its chunks, reserve the freed pages and commit the headers on
pages holding another prompt's bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import subprocess
import sys

import pytest
import zmq

from support import server_rig
from kvconnect.chunks.chunk_format import ChunkHeader
from kvconnect.cli import main as cli_main
from kvconnect.errors import ConfigError, StorageError
from kvconnect.server import admission, protocol
from kvconnect.server.admission import PeerPolicy, parse_peer_address
from kvconnect.server.channel import Channel, UntrustedServer
from kvconnect.server.client import SharedPoolClient
from kvconnect.server.server import CacheServer
from kvconnect.server.protocol import Limits
from kvconnect.server.shm import SHM_DIR, Segment
from support.server_rig import PAGE, server_thread, socket_dir

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as uid 65534 (nobody): setuid")

NOBODY = 65534
FP = b"F" * 16
VICTIMS = [bytes([0xA0 + i]) * 16 for i in range(2)]
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "foreign_peer.py")


def run_peer(url: str, *args: str, uid: int | None = NOBODY, gid: int | None = None, token: str | None = None) -> dict:
    cmd = [sys.executable, PEER, url, *(["--uid", str(uid)] if uid is not None else []), *(["--gid", str(gid)] if gid is not None else []),
           *(["--token", token] if token else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=server_rig.clean_env(), cwd=server_rig.REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def store_victims(client: SharedPoolClient) -> None:
    """Two prompts' chunks: VICTIMS[i] holds bytes i + 1."""
    for i, k in enumerate(VICTIMS):
        (slot,) = client.reserve(1)
        client.slot_view(slot)[:PAGE] = i + 1
        header = ChunkHeader(fingerprint=FP, key=k, token_start=0, token_end=64, group_mask=1, plane_rows=((0, 4),), payload_bytes=PAGE)
        assert client.commit(k, header, slot).live


def read_victims(client: SharedPoolClient) -> list:
    """The first and last byte of each victim as served, None for a miss."""
    entries = client.acquire(VICTIMS)
    try:
        return [None if e is None else (int(client.entry_view(e)[0]), int(client.entry_view(e)[-1])) for e in entries]
    finally:
        client.release(entries)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_dir(path: str) -> None:
    os.chmod(path, 0o755)  # the directory is not what this test is about: only the socket's own mode is


# --- tcp: a token, loopback or not -------------------------------------------------------------


def test_tcp_listener_refuses_to_start_without_a_token(capsys):
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match="token"):
        CacheServer(url, 1 << 20)
    with pytest.raises(ConfigError, match="token"):
        SharedPoolClient(url, PAGE)
    assert cli_main(["server", "--url", url, "--size-gb", "0.01"]) == 2
    assert "token" in capsys.readouterr().err


@needs_root
def test_tcp_peer_without_the_token_gets_no_answer():
    with server_thread(f"tcp://127.0.0.1:{free_port()}", token="s3cret") as server:
        victim = SharedPoolClient(server.url, PAGE, token="s3cret", timeout_s=5.0, fingerprint=FP)
        try:
            store_victims(victim)
            got = run_peer(server.url, "forge", *[k.hex() for k in VICTIMS])
            assert got == {"uid": NOBODY, "hello": "no reply"}
            assert read_victims(victim) == [(1, 1), (2, 2)]
            assert victim.server_stats()["refused_requests"] >= 1
        finally:
            victim.close()


# --- ipc: the kernel names the peer ------------------------------------------------------------


@needs_root
def test_ipc_peer_of_another_uid_is_refused_even_through_a_loose_socket_mode():
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock") as server:
        path = f"{d}/kvc.sock"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(server.segment.path).st_mode) == 0o600
        victim = SharedPoolClient(server.url, PAGE, timeout_s=5.0, fingerprint=FP)
        try:
            store_victims(victim)
            open_dir(d)
            os.chmod(path, 0o666)  # a mode loosened by hand: SO_PEERCRED still names the peer
            got = run_peer(server.url, "forge", *[k.hex() for k in VICTIMS])
            assert got == {"uid": NOBODY, "hello": "no reply"}
            assert read_victims(victim) == [(1, 1), (2, 2)]
            assert victim.server_stats()["refused_peers"] >= 1
        finally:
            victim.close()


@needs_root
def test_allowed_group_is_admitted_but_its_sessions_are_bounded():
    peers = PeerPolicy(allow_gid=NOBODY, max_sessions_per_peer=8)
    # a lease no held session can outlive on a loaded machine: the peer opens its 20 sessions one
    # by one and sends no heartbeat, so a 1 s lease let early sessions lapse before the last hello
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", peers=peers, lease_s=600.0) as server:
        open_dir(d)
        for path in (f"{d}/kvc.sock", server.segment.path):
            st = os.stat(path)
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY)
        got = run_peer(server.url, "hold", "20")
        assert got["sessions"] == 8 and "limit" in got["refusal"]
        engine = SharedPoolClient(server.url, PAGE, timeout_s=5.0, fingerprint=FP)  # the server's own uid still gets in
        try:
            assert engine.connected
            stats = engine.server_stats()
            assert stats["num_clients"] == 9 and stats["refused_sessions"] == 12
        finally:
            engine.close()


# --- issue 39 item 0: a squatter on the socket path -------------------------------------------
# Another user binds the free path (before the server's first start, or while it restarts),
# opens it to everyone, stores the victim's keys with its own bytes and right checksums, and
# unlinks the path once the engine is connected, so that the real server binds it again while
# the squatter keeps answering on the engine's open connection. 0xEE is the squatter's byte.


@contextlib.contextmanager
def squatter(url: str):
    cmd = [sys.executable, PEER, url, "--uid", str(NOBODY), "squat", str(os.geteuid()), FP.hex(), *[k.hex() for k in VICTIMS]]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=server_rig.clean_env(), cwd=server_rig.REPO)
    try:
        line = server_rig.read_line(proc, 60)
        assert json.loads(line) == {"uid": NOBODY, "ready": url}, line
        yield proc
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()


def unlink_path(proc: subprocess.Popen) -> None:
    proc.stdin.write(b"unlink\n")
    proc.stdin.flush()
    assert json.loads(server_rig.read_line(proc, 30)) == {"unlinked": True}


def served_while_squatted(client: SharedPoolClient, seen: list) -> list:
    got = read_victims(client)
    seen.append(got)
    return got


def refused_squatter(caplog) -> bool:
    return any("another user may have bound the path" in r.getMessage() and f"uid {NOBODY}" in r.getMessage()
               for r in caplog.records if r.levelno >= logging.WARNING)


def outlive_the_unlinked_squatter(client: SharedPoolClient, squat: subprocess.Popen, seen: list) -> None:
    """The squatter unlinks the path: hellos go on (answered by nobody or, before the fix,
    by the squatter over the still-open connection) and load nothing."""
    unlink_path(squat)
    hellos = client.counters["failed_hellos"]
    assert server_rig.wait_until(lambda: client.connected or client.counters["failed_hellos"] >= hellos + 2, 60)
    assert served_while_squatted(client, seen) == [None, None]


def back_on_the_real_server(client: SharedPoolClient, url: str, seen: list) -> None:
    with server_thread(url):
        assert server_rig.wait_until(lambda: client.connected, 60)
        assert served_while_squatted(client, seen) == [None, None]  # a fresh server holds nothing yet
        store_victims(client)
        assert served_while_squatted(client, seen) == [(1, 1), (2, 2)]


@needs_root
def test_engine_refuses_a_squatter_bound_before_the_server_first_starts(caplog):
    seen: list = []
    with socket_dir() as d:
        os.chmod(d, 0o1777)  # like /tmp
        url = f"ipc://{d}/kvc.sock"
        with caplog.at_level(logging.WARNING, logger="kvconnect"), squatter(url) as squat:
            client = SharedPoolClient(url, PAGE, timeout_s=1.0, fingerprint=FP)
            try:
                assert not client.connected and served_while_squatted(client, seen) == [None, None]
                assert client.counters["untrusted_servers"] >= 1 and client.counters["connects"] == 0
                assert refused_squatter(caplog)
                outlive_the_unlinked_squatter(client, squat, seen)
                assert client.counters["connects"] == 0
                back_on_the_real_server(client, url, seen)
            finally:
                client.close()
    assert not any(got == (0xEE, 0xEE) for reads in seen for got in reads), seen  # 0 of the squatter's bytes loaded


@needs_root
def test_engine_refuses_a_squatter_bound_while_the_server_restarts(caplog):
    seen: list = []
    with socket_dir() as d:
        os.chmod(d, 0o1777)
        url = f"ipc://{d}/kvc.sock"
        client = SharedPoolClient(url, PAGE, timeout_s=1.0, fingerprint=FP)
        try:
            with server_thread(url):
                assert server_rig.wait_until(lambda: client.connected, 60)
                store_victims(client)
                assert served_while_squatted(client, seen) == [(1, 1), (2, 2)]
            # stopped (its socket and segment unlinked); the squatter binds the path before it is back
            with caplog.at_level(logging.WARNING, logger="kvconnect"), squatter(url) as squat:
                # the engine's sockets reconnect to whoever listens at the path: its replies are refused
                assert server_rig.wait_until(lambda: client.counters["untrusted_servers"] >= 1, 60)
                assert not client.connected and served_while_squatted(client, seen) == [None, None]
                assert refused_squatter(caplog)
                connects = client.counters["connects"]
                outlive_the_unlinked_squatter(client, squat, seen)
                assert client.counters["connects"] == connects
                back_on_the_real_server(client, url, seen)
        finally:
            client.close()
    assert not any(got == (0xEE, 0xEE) for reads in seen for got in reads), seen


def test_reply_of_an_untrusted_uid_is_refused_before_it_is_decoded():
    """The uid the kernel names for the reply's connection decides, not the socket file: a
    trusted set without the server's uid refuses even this process's own server."""
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock") as server:
        ctx = zmq.Context()
        try:
            own = Channel(ctx, server.url, token=None, limits=Limits(), timeout_s=5.0, trusted_uids=frozenset({os.geteuid()}))
            status, _ = own.request("hello", [os.getpid(), None, PAGE], b"c" * 16, None)
            assert status == protocol.OK and own.peer_uid == os.geteuid()
            other = Channel(ctx, server.url, token=None, limits=Limits(), timeout_s=5.0, trusted_uids=frozenset({NOBODY}))
            with pytest.raises(UntrustedServer, match=f"runs as uid {os.geteuid()}"):
                other.request("hello", [os.getpid(), None, PAGE], b"d" * 16, None)
            for channel in (own, other):
                channel.close()
        finally:
            ctx.term()


@needs_root
def test_member_removed_from_the_allowed_group_gets_no_new_session(monkeypatch):
    """Issue 39 item 3: nobody runs with gid 4242 (not the group) and is admitted as a member of
    nogroup (65534) in the group database; once the database no longer lists it, its next hello
    is refused. The database edit (``gpasswd -d``) is stood in for by the lookup kvconnect makes,
    so that the test leaves /etc/group alone."""
    real = os.getgrouplist
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", peers=PeerPolicy(allow_gid=NOBODY), lease_s=600.0) as server:
        open_dir(d)
        os.chmod(f"{d}/kvc.sock", 0o666)  # gid 4242 could not open the 0660 socket: the file mode is not what is tested
        assert NOBODY in real("nobody", NOBODY)
        assert run_peer(server.url, "hold", "2", gid=4242) == {"uid": NOBODY, "sessions": 2, "refusal": None}
        monkeypatch.setattr(admission.os, "getgrouplist", lambda name, gid: [g for g in real(name, gid) if g != NOBODY])
        got = run_peer(server.url, "hold", "1", gid=4242)
        assert got["sessions"] == 0 and "no longer a member" in got["refusal"]
        assert run_peer(server.url, "hold", "1", gid=NOBODY)["sessions"] == 1  # the group in its own credentials still is


@needs_root
def test_segment_of_another_user_is_not_mapped():
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock") as server:
        os.chown(server.segment.path, NOBODY, -1)
        with pytest.raises(StorageError, match="belongs to uid 65534"):
            Segment.attach(server.segment.info, owner_uid=os.geteuid())


# --- the pool path verifies checksums --------------------------------------------------------


def test_forged_entry_is_a_counted_miss_never_wrong_bytes():
    """An admitted peer (here this uid) that cannot write the bytes re-publishes headers on
    pages holding another prompt's bytes: the reader's checksum turns that into misses."""
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock") as server:
        victim = SharedPoolClient(server.url, PAGE, timeout_s=5.0, fingerprint=FP)
        try:
            store_victims(victim)
            assert read_victims(victim) == [(1, 1), (2, 2)]
            got = run_peer(server.url, "forge", *[k.hex() for k in VICTIMS], uid=None)
            assert got["committed"] == 2 and got["removed"] == [[True], [True]]
            assert read_victims(victim) == [None, None]
            assert victim.counters["bad_checksums"] == 2
            assert victim.masks(VICTIMS) == [None, None]  # removed: the engine stores them again
            store_victims(victim)
            assert read_victims(victim) == [(1, 1), (2, 2)]
        finally:
            victim.close()


def test_peer_address_parsing():
    assert parse_peer_address("localhost:1000:1001:42") == (1000, 1001)
    assert parse_peer_address("") is None and parse_peer_address(None) is None
    assert parse_peer_address("localhost") is None and parse_peer_address("a:b:c:d") is None
    with pytest.raises(ConfigError):
        PeerPolicy(max_sessions_per_peer=0)
