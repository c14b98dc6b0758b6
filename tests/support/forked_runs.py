"""TEST HARNESS: engine runs forked from a zygote that imported the engine once (support/zygote.py).

``run_script(script, args, env=..., cwd=..., timeout_s=...)`` behaves as
``subprocess.run([sys.executable, script, *args], capture_output=True, env=env, cwd=cwd,
timeout=timeout_s)`` with stdout and stderr together in ``stdout``, but the run is a fork of a
process that already imported the modules named in ``preload`` (vLLM and torch: ~12 s of every
tiny-model run on the 2-core CI machine). One zygote serves every run with the same interpreter,
``PYTHONPATH`` and preload list, for the whole test session; a run that times out has its whole
session (the engine's worker processes too) killed and the caller gets ``TimeoutExpired``, as
``subprocess.run`` raises it.

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
import time
from pathlib import Path
from typing import Optional, Sequence

ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
VLLM_PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
                "vllm.v1.worker.cpu_worker")

_zygotes: dict[tuple, "_Zygote"] = {}


class _Zygote:
    def __init__(self, env: dict, preload: Sequence[str]) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kvconnect-zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE), *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        self._pending = b""  # bytes read past the last reply's newline
        if self._read(timeout_s=300.0, what="the zygote's imports") is None:
            raise RuntimeError(f"the test zygote did not finish its imports in 300 s; its log: "
                               f"{Path(self.log.name).read_text()[-4000:]}")

    def _read(self, timeout_s: float, what: str) -> Optional[dict]:
        """The zygote's next reply, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"the test zygote exited during {what} (rc {self.proc.poll()}); its log: "
                                   f"{Path(self.log.name).read_text()[-4000:]}")
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def run(self, argv: list[str], env: dict, cwd: str, timeout_s: float) -> subprocess.CompletedProcess:
        with tempfile.NamedTemporaryFile(prefix="kvconnect-run-", suffix=".log", dir=cwd, delete=False) as f:
            log = f.name
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}) + "\n").encode())
            self.proc.stdin.flush()
            started = time.monotonic()
            started_reply = self._read(timeout_s=60.0, what="a fork")
            if started_reply is None:
                raise RuntimeError("the test zygote did not fork within 60 s")
            pid = started_reply["pid"]
            reply = self._read(timeout_s=max(1.0, timeout_s - (time.monotonic() - started)), what=f"run {argv}")
            if reply is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._read(timeout_s=60.0, what="a killed run")  # its rc: the zygote is free again
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout_s, output=Path(log).read_text(errors="replace"))
            return subprocess.CompletedProcess([sys.executable, *argv], reply["rc"],
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


def run_script(script: str, args: Sequence[str], *, env: dict, cwd: str, timeout_s: float,
               preload: Sequence[str] = VLLM_PRELOAD) -> subprocess.CompletedProcess:
    """``python script *args`` in ``cwd`` with ``env``, forked from a zygote (see the module's text)."""
    argv = [str(script), *map(str, args)]
    if env.get("KVCONNECT_TEST_FORK_RUNS", "1") == "0":
        return subprocess.run([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s, env=env, cwd=cwd)
    key = (sys.executable, env.get("PYTHONPATH", ""), tuple(preload))
    if key not in _zygotes:
        _zygotes[key] = _Zygote(dict(env), preload)
    return _zygotes[key].run(argv, dict(env), str(cwd), timeout_s)


@atexit.register
def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()
    _zygotes.clear()
