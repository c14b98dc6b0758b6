"""Real redis-server processes for tests: one node on a loopback port or unix socket, or a
three-node Redis Cluster. Nothing is persisted (no RDB, no AOF); every node binds 127.0.0.1.

    with RedisNode(tmp_path) as node:           # node.url, node.kill(), node.restart()
        ...
    with RedisClusterNodes(tmp_path) as c:      # c.url = "redis-cluster://127.0.0.1:p1,..."
        ...

``redis_available()`` says whether the binaries and the ``redis`` package are installed
(tests skip only when they are not; ``.ci/install_redis.sh`` installs both).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from support.service_process import START_TIMEOUT_S, ServiceProcess

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def redis_available() -> Optional[str]:
    """None when tests can run, else the reason to skip."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        return "redis-server/redis-cli not installed (run .ci/install_redis.sh)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis Python package is not installed (pip install redis)"
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (port + 10000, so <= 55535)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.randrange(20000, 55000)
        if _port_free(port) and (not cluster or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


def _ping(port: Optional[int] = None, unix_socket: Optional[str] = None, timeout_s: float = 0.5) -> bool:
    try:
        if unix_socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout_s)
            s.connect(unix_socket)
        else:
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        with s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisNode(ServiceProcess):
    """One redis-server on a free loopback port (and a unix socket), restartable on the same port."""

    name = "redis-server"

    def __init__(self, workdir: Path, *, port: Optional[int] = None, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(workdir, port or free_port(cluster="--cluster-enabled" in extra_args))
        self.unix_socket = str(self.workdir / f"redis-{self.port}.sock")
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_socket}?db=0"

    def argv(self) -> list[str]:
        return [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--unixsocket", self.unix_socket, "--unixsocketperm", "700",
            "--daemonize", "no", "--loglevel", "warning", "--logfile", str(self.log_path()),
            *self.extra_args,
        ]

    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # it writes its logfile

    def ready(self) -> bool:
        return _ping(self.port)

    def restart(self) -> "RedisNode":
        self.kill()
        return self.start()

    def cli(self, *args: str) -> str:
        out = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=30)
        return out.stdout



def _slot_ranges(node: RedisNode) -> list[tuple[str, str]]:
    """The slot ranges ``node`` serves, from its own line of ``cluster nodes``."""
    for line in node.cli("cluster", "nodes").splitlines():
        fields = line.split()
        if "myself" in fields[2]:
            return [tuple(r.split("-")) if "-" in r else (r, r) for r in fields[8:] if not r.startswith("[")]
    return []


class RedisClusterNodes:
    """Three cluster-enabled masters on loopback ports, joined with ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, num_nodes: int = 3, *, full_coverage: bool = True) -> None:
        """``full_coverage=False`` is how a cache runs: the shards that are up keep serving
        while one is down (the server default stops the whole cluster after node-timeout)."""
        self.nodes = [
            RedisNode(Path(workdir) / f"node{i}", extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf", "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "yes" if full_coverage else "no"))
            for i in range(num_nodes)
        ]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> "RedisClusterNodes":
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        self.wait_ok()
        return self

    def wait_ok(self) -> None:
        """Until every node reports ``cluster_state:ok`` (after a start or a node's restart)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def holder(self, redis_key: bytes) -> int:
        """Index of the node whose slots hold ``redis_key``."""
        slot = int(self.nodes[0].cli("cluster", "keyslot", redis_key.decode()))
        for i, node in enumerate(self.nodes):
            if any(int(lo) <= slot <= int(hi) for lo, hi in _slot_ranges(node)):
                return i
        raise LookupError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisClusterNodes":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
