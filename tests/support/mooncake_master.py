"""A real ``mooncake_master`` for tests, on a free loopback port (RPC and metrics both on 127.0.0.1).

    with MooncakeMaster(tmp_path) as master:     # master.url = "mooncakestore://127.0.0.1:P"
        ...
        master.kill()                            # SIGKILL: every key is lost, clients get -900
        master.start()                           # again on the same port

``mooncake_available()`` says whether the master binary and ``mooncake.store`` are installed
(tests skip only when they are not; ``.ci/install_mooncake.sh`` installs both).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from support.redis_server import free_port
from support.service_process import START_TIMEOUT_S, ServiceProcess

def _beside_interpreter(name: str) -> Optional[str]:
    """``name`` from this interpreter's scripts directory (where pip put it: a venv's or a version manager's bin,
    never on PATH by itself), else from PATH."""
    path = Path(sysconfig.get_path("scripts")) / name
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    return shutil.which(name)


MASTER = _beside_interpreter("mooncake_master")
# what every Mooncake client a test starts needs: loopback only, quiet logs, and each RPC to a
# stalled master answered (-901) within 2 s rather than Mooncake's 30 s (the product sets this
# from remote_timeout_s; the tests fix it, since one process holds tiers of several timeouts)
CLIENT_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING", "GLOG_minloglevel": "2",
              "MC_RPC_TIMEOUT_MS": "2000"}


def mooncake_available() -> Optional[str]:
    """None when tests can run, else the reason to skip."""
    if MASTER is None:
        return "mooncake_master not installed (run .ci/install_mooncake.sh)"
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"mooncake.store does not import (run .ci/install_mooncake.sh): {probe.stderr.strip()[-300:]}"
    return None


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster(ServiceProcess):
    name = "mooncake_master"

    def __init__(self, workdir: Path, *, port: Optional[int] = None) -> None:
        super().__init__(workdir, port or free_port())
        self.metrics_port = free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"mooncakestore://{self.address}"

    def argv(self) -> list[str]:
        return [MASTER, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", "--logtostderr"]

    def log_path(self) -> Path:
        return self.workdir / f"master-{self.port}.log"

    def ready(self) -> bool:
        return _listening(self.port)


def client_env(**extra: str) -> dict:
    """The environment for a child process that is a Mooncake client (loopback, quiet)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_", "MOONCAKE_"))}
    env.update(CLIENT_ENV)
    env.update(extra)
    return env


class NodeHolder:
    """``kvconnect server --mooncake-segment-gb`` on an ipc socket, started and stopped by a test.

    Waits until the server logs that it holds its segment (mounted with the master), then
    keeps draining its output on a thread (a full pipe would stall the server).
    """

    def __init__(self, master: MooncakeMaster, workdir: Path, segment_gb: float, *,
                 python: str = sys.executable, repo: Optional[Path] = None) -> None:
        import threading

        repo = repo or Path(__file__).resolve().parents[2]
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [python, "-m", "kvconnect.cli", "server", "--url", f"ipc://{workdir}/node.sock", "--size-gb", "0.01",
             "--mooncake-segment-gb", str(segment_gb)],
            env=client_env(LMCACHE_REMOTE_URL=master.url, PYTHONPATH=str(repo)), cwd=str(repo),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if "holding a" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(START_TIMEOUT_S * 3) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("kvconnect server did not mount its Mooncake segment:\n" + "".join(self.lines[-40:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
