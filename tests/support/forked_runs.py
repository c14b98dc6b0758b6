"""TEST HARNESS: engine runs forked from a zygote that imported the engine once (support/zygote.py).

``run_script(script, args, env=..., cwd=..., timeout_s=...)`` behaves as
``subprocess.run([sys.executable, script, *args], capture_output=True, env=env, cwd=cwd,
timeout=timeout_s)`` with stdout and stderr together in ``stdout``, but the run is a fork of a
process that already imported the modules named in ``preload`` (vLLM and torch: ~12 s of every
tiny-model run on the 2-core CI machine). One zygote serves every run with the same interpreter,
``PYTHONPATH`` and preload list, for the whole test session; a run that times out has its whole
session (the engine's worker processes too) killed and the caller gets ``TimeoutExpired``, as
``subprocess.run`` raises it.

``start_module(module, args, env=..., cwd=..., log=...)`` is the same for a long-running
``python -m module ...`` (``vllm serve`` as the P/D, DP and metrics tests start it): it returns a
Popen-like ``ForkedProcess`` (``pid``, ``poll``, ``wait``, ``returncode``; its own session, its
stdout and stderr in ``log``), and several may run at once from one zygote. The zygote reaps its
children and reports each exit code (a signal ``-S``) over its pipe.

``KVCONNECT_TEST_FORK_RUNS=0`` in the environment turns it off: every run is then a plain
subprocess (how to check that a failure does not come from the shared import).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
VLLM_PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
                "vllm.v1.worker.cpu_worker")
# what ``python -m vllm.entrypoints.openai.api_server`` imports (the module itself is left to the run)
VLLM_SERVE_PRELOAD = (*VLLM_PRELOAD, "vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.launchers.api_server.routers",
                      "vllm.entrypoints.launchers.render.entry", "vllm.v1.engine.async_llm", "vllm.v1.engine.core_client",
                      "uvicorn", "fastapi", "uvloop")

_zygotes: dict[tuple, "_Zygote"] = {}


class ForkedProcess:
    """A child of a zygote, handled as a ``subprocess.Popen``: ``pid`` (also its session's id),
    ``poll()``, ``wait(timeout)`` (``subprocess.TimeoutExpired``), ``returncode`` (a signal
    ``-S``), ``send_signal``/``terminate``/``kill`` (to its whole session). The zygote reaps it
    and reports its exit code; a pid could in principle be reused between that reap and the
    caller's next ``poll()``, as for any process signalled by pid."""

    def __init__(self, zygote: "_Zygote", pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    def __init__(self, env: dict, preload: Sequence[str]) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kvconnect-zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE), *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        self._pending = b""  # bytes read past the last reply's newline
        self._exits: dict[int, int] = {}  # pid -> exit code, reported but not yet asked for
        self._lock = threading.Lock()
        if self._read(timeout_s=300.0, what="the zygote's imports") is None:
            raise RuntimeError(f"the test zygote did not finish its imports in 300 s; its log: "
                               f"{Path(self.log.name).read_text()[-4000:]}")

    def _read(self, timeout_s: Optional[float], what: str) -> Optional[dict]:
        """The zygote's next reply, or None after ``timeout_s`` (None: no bound)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return None
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"the test zygote exited during {what} (rc {self.proc.poll()}); its log: "
                                   f"{Path(self.log.name).read_text()[-4000:]}")
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def start(self, argv: list[str], env: dict, cwd: str, log: str, module: Optional[str] = None) -> ForkedProcess:
        """Fork ``python script *args`` (``argv``), or ``python -m module *argv``, its output to ``log``."""
        request = {"argv": argv, "env": env, "cwd": cwd, "log": log}
        if module is not None:
            request["module"] = module
        with self._lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + 60.0
            while True:
                reply = self._read(timeout_s=max(0.0, deadline - time.monotonic()), what="a fork")
                if reply is None:
                    raise RuntimeError("the test zygote did not fork within 60 s")
                if "pid" in reply:
                    break
                self._exits[reply["exit"]] = reply["rc"]
        args = [sys.executable, *(["-m", module] if module is not None else []), *argv]
        return ForkedProcess(self, reply["pid"], args)

    def exit_code(self, pid: int, timeout_s: Optional[float]) -> Optional[int]:
        """Child ``pid``'s exit code once the zygote reported it, else None after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while pid not in self._exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                reply = self._read(timeout_s=left, what=f"child {pid}")
                if reply is None:
                    return None
                self._exits[reply["exit"]] = reply["rc"]
            return self._exits.pop(pid)

    def run(self, argv: list[str], env: dict, cwd: str, timeout_s: float) -> subprocess.CompletedProcess:
        with tempfile.NamedTemporaryFile(prefix="kvconnect-run-", suffix=".log", dir=cwd, delete=False) as f:
            log = f.name
        try:
            child = self.start(argv, env, cwd, log)
            try:
                rc = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=60.0)  # its rc: reaped
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout_s, output=Path(log).read_text(errors="replace"))
            return subprocess.CompletedProcess([sys.executable, *argv], rc,
                                               stdout=Path(log).read_text(errors="replace"), stderr="")
        finally:
            os.unlink(log)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)


def _zygote(env: dict, preload: Sequence[str]) -> _Zygote:
    key = (sys.executable, env.get("PYTHONPATH", ""), tuple(preload))
    if key not in _zygotes:
        _zygotes[key] = _Zygote(dict(env), preload)
    return _zygotes[key]


def run_script(script: str, args: Sequence[str], *, env: dict, cwd: str, timeout_s: float,
               preload: Sequence[str] = VLLM_PRELOAD) -> subprocess.CompletedProcess:
    """``python script *args`` in ``cwd`` with ``env``, forked from a zygote (see the module's text)."""
    argv = [str(script), *map(str, args)]
    if env.get("KVCONNECT_TEST_FORK_RUNS", "1") == "0":
        return subprocess.run([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s, env=env, cwd=cwd)
    return _zygote(env, preload).run(argv, dict(env), str(cwd), timeout_s)


def start_module(module: str, args: Sequence[str], *, env: dict, cwd: str, log: str,
                 preload: Sequence[str] = VLLM_SERVE_PRELOAD):
    """``python -m module *args`` in its own session, in ``cwd`` with ``env``, its stdout and
    stderr to the file ``log``, running until it exits: a ``ForkedProcess`` forked from a zygote,
    or a plain ``subprocess.Popen`` with ``KVCONNECT_TEST_FORK_RUNS=0`` (see the module's text)."""
    args = [*map(str, args)]
    if env.get("KVCONNECT_TEST_FORK_RUNS", "1") == "0":
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, start_new_session=True)
    return _zygote(env, preload).start(args, dict(env), str(cwd), str(log), module=module)


@atexit.register
def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()
    _zygotes.clear()
