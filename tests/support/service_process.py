"""A real server process a test starts, stalls, kills and stops: the one lifecycle that
``MooncakeMaster`` (mooncake_master.py) and ``RedisNode`` (redis_server.py) share.

A subclass says how to start (``argv``, where the process logs) and when it is up
(``ready``); this class waits for that, shows the log's tail when it never comes, and stops
the process on every path (a paused one is resumed first: it cannot exit on SIGTERM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

START_TIMEOUT_S = 20.0


class ServiceProcess:
    name = "service"  # in the error when it does not start

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir = Path(workdir)
        self.port = port
        self.proc: Optional[subprocess.Popen] = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def log_path(self) -> Path:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def spawn(self) -> subprocess.Popen:
        """Start the process; the default sends its output to ``log_path``."""
        with open(self.log_path(), "ab") as log:
            return subprocess.Popen(self.argv(), stdout=log, stderr=log)

    def start(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = self.spawn()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log_path().read_text(errors="replace")[-2000:] if self.log_path().exists() else ""
                self.stop()
                raise RuntimeError(f"{self.name} on port {self.port} did not start:\n{text}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL: the service vanishes mid-operation (no flush, sockets reset)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the service accepts connections but never answers (a stalled service)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused process cannot exit on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
