"""Helpers for the cache-server tests: servers in a thread or a process, bounded waits.

Every wait is bounded; every process started here has a timeout and is killed in the
caller's ``finally``. Socket paths live in short /tmp directories (a unix socket path
must fit in 107 bytes, pytest's tmp_path does not always).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterator, Optional

from kvconnect.server.admission import PeerPolicy
from kvconnect.server.protocol import Limits
from kvconnect.server.server import CacheServer

PAGE = 4096
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS_DIR)


@contextlib.contextmanager
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvc-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def server_thread(url: str, *, size_bytes: int = 2 << 20, lease_s: float = 1.0, token: Optional[str] = None,
                  limits: Limits = Limits(), eviction: str = "s3fifo", peers: PeerPolicy = PeerPolicy()) -> Iterator[CacheServer]:
    """A CacheServer serving from a thread of this process until the block exits."""
    server = CacheServer(url, size_bytes, page_bytes=PAGE, lease_s=lease_s, token=token, limits=limits,
                         eviction=eviction, peers=peers)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), kwargs={"max_seconds": 300}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS_DIR, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def start_server_process(url: str, log_path: str, *, size_mb: int = 16, lease_s: float = 1.0,
                         token: Optional[str] = None, timeout_s: float = 60.0) -> subprocess.Popen:
    """``kvconnect server`` in a child process; returns once it printed its ready line."""
    cmd = [sys.executable, "-m", "kvconnect.cli", "server", "--url", url, "--size-gb", str(size_mb / 1024),
           "--page-kb", str(PAGE // 1024), "--lease-s", str(lease_s)]
    env = clean_env(**({"KVCONNECT_SERVER_TOKEN": token} if token else {}))
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO)
    log.close()
    line = read_line(proc, timeout_s)
    if "ready" not in line:
        stop_process(proc)
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"server did not start: {line!r}\n{f.read()[-3000:]}")
    return proc


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of the child's stdout, or '' when it says nothing within ``timeout_s``."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().decode(errors="replace") if ready else ""


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> Optional[int]:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def run_worker(args: list[str], *, timeout_s: float = 90.0, **env: str) -> subprocess.CompletedProcess:
    """tests/server/engine_worker.py with ``args``, to completion (bounded)."""
    worker = os.path.join(TESTS_DIR, "server", "engine_worker.py")
    return subprocess.run([sys.executable, worker, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=clean_env(**env), cwd=REPO)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def kill(proc: subprocess.Popen) -> None:
    stop_process(proc, signal.SIGKILL)


SPARSE_WINDOWS = {"dsv4-flash", "dsv4-flash-packed"}  # too few blocks for dense windowed tables


def prompt(name: str, chunk: int, num_tokens: int, seed: int):
    """(case, tokens, source tables, chunk bounds): the same in every process for equal args."""
    import numpy as np

    from support import zoo

    case = zoo.build(name, max_tokens=num_tokens, seed=seed)
    rng = np.random.default_rng(seed)
    tokens = zoo.random_tokens(rng, num_tokens)
    bounds = zoo.chunk_bounds_ref(num_tokens, chunk, False)
    keep = zoo.window_keep(case, bounds) if name in SPARSE_WINDOWS else None
    return case, tokens, zoo.random_tables(case, num_tokens, rng, keep=keep), bounds


def restore_tables(case, name: str, num_tokens: int, boundary: int, seed: int) -> list:
    import numpy as np

    from support import zoo

    keep = zoo.restore_keep(case, boundary) if name in SPARSE_WINDOWS else None
    return zoo.random_tables(case, num_tokens, np.random.default_rng(seed + 1000), keep=keep)
