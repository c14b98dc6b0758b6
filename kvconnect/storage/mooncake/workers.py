"""Bounded waits on calls that may stall inside Mooncake: a few daemon threads, stopped at close.

    workers = Workers("kvconnect-mooncake-lookup", size=4)
    status, result = workers.run(fn, timeout_s)   # fn(slot) on a worker thread
    workers.stop()                                 # idle threads end now, busy ones after their call

A lookup or a read runs on the engine's step path and must return within its bound even when
the master or a segment holder stalls; the call itself cannot be interrupted, so it runs here and the caller stops
waiting. Each thread owns one slot (0..size-1), e.g. its scratch buffer. When every thread
is busy a new call is refused at once instead of queueing behind stalled ones. ``stop``
ends the threads (a closed tier must not keep threads, or through them its buffers).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional


class Workers:
    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._jobs: "collections.deque[Callable[[int], None]]" = collections.deque()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._size = size
        self._stopped = False

    def run(self, fn: Callable[[int], object], timeout_s: Optional[float]) -> tuple[str, object]:
        """("done", result); ("busy", None) when every thread is taken or the workers are
        stopped (``fn`` not started); ("timeout", None) when ``fn`` runs past ``timeout_s``
        (it finishes on its thread; None: wait for it). An exception of ``fn`` is raised here."""
        box: dict = {}
        done = threading.Event()

        def job(slot: int) -> None:
            try:
                box["result"] = fn(slot)
            except Exception as exc:  # reported to the caller, never lost
                box["error"] = exc
            finally:
                done.set()

        with self._cond:
            if self._stopped:
                return "busy", None
            if self._idle == 0:
                if len(self._threads) >= self._size:
                    return "busy", None
                thread = threading.Thread(target=self._run, args=(len(self._threads),),
                                          name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                self._idle += 1
                thread.start()
            self._idle -= 1
            self._jobs.append(job)
            self._cond.notify()
        if not done.wait(timeout_s):
            return "timeout", None
        if "error" in box:
            raise box["error"]
        return "done", box.get("result")

    def _run(self, slot: int) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopped:
                    self._cond.wait()
                if not self._jobs:  # stopped and nothing left to run
                    return
                job = self._jobs.popleft()
            try:
                job(slot)
            finally:
                del job  # the job's closure holds its caller's objects: drop it before waiting again
                with self._cond:
                    self._idle += 1

    def stop(self, timeout_s: float = 0.0) -> bool:
        """End every thread once its current call returns; wait up to ``timeout_s``. True when
        all have ended."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout_s)
        return not any(t.is_alive() for t in threads)

    @property
    def alive(self) -> int:
        with self._cond:
            return sum(t.is_alive() for t in self._threads)
