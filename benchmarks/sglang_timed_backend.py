"""A measuring wrapper of kvconnect's SGLang backend (benchmarks only, never the product).

Load it as SGLang's dynamic backend (``"module_path": "sglang_timed_backend", "class_name":
"TimedKVConnectStorage"``, with ``benchmarks/`` on the engine's PYTHONPATH) and give the
extra config a ``"timing_log"`` path: one JSON line per event is appended there.

- ``call``: every backend call SGLang's threads make (name, thread, pages, seconds).
- ``stop``: each ``_stop_storage_threads`` of the cache controller that built this backend
  (``flush_cache`` reaches it through the cache's reset): the controller's queue sizes when
  it starts, its duration and outcome.
- ``sample``: every 0.2 s during that stop, the innermost frames of each storage thread
  still alive (what holds the thread) and the queue sizes.

The controller is found on the constructor's call stack (SGLang's attach builds the backend);
its ``_stop_storage_threads`` is wrapped on that one instance.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from kvconnect.integrations.sglang import KVConnectStorage

QUEUES = ("prefetch_queue", "prefetch_buffer", "prefetch_sync_queue", "backup_queue", "prefetch_hit_queue")
THREADS = ("prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread", "backup_thread")
CALLS = ("batch_exists", "batch_exists_v2", "batch_get_v1", "batch_set_v1", "batch_get_v2", "batch_set_v2",
         "batch_get", "batch_set", "clear")


class TimedKVConnectStorage(KVConnectStorage):
    def __init__(self, storage_config, kwargs=None) -> None:
        super().__init__(storage_config, kwargs)
        self._log_path = (storage_config.extra_config or {}).get("timing_log")
        self._log_lock = threading.Lock()
        self._t0 = time.monotonic()
        controller = _caller_controller()
        if controller is not None:
            _wrap_stop(controller, self._event)

    def on_host_pools_registered(self) -> None:
        super().on_host_pools_registered()
        if self._store is not None:  # bytes of one stored page (payload), per pool
            self._event(ev="pools", page_bytes={name: self._store.page_bytes(g) for name, g in self._groups.items()},
                        page_tokens=dict(self._host_page))

    def _event(self, **fields) -> None:
        if not self._log_path:
            return
        fields["t"] = round(time.monotonic() - self._t0, 4)
        with self._log_lock, open(self._log_path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def _timed(name):
    def call(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return getattr(KVConnectStorage, name)(self, *args, **kwargs)
        finally:
            pages = len(args[0]) if args and isinstance(args[0], list) else 0
            pools = {}
            if name in ("batch_set_v2", "batch_get_v2") and args:  # pages per pool in this call
                pools = {str(t.name): len(t.keys or []) for t in args[0]}
                pages = 0
            self._event(ev="call", name=name, thread=threading.current_thread().name, pages=pages, pools=pools,
                        s=round(time.monotonic() - start, 5))
    call.__name__ = name
    return call


for _name in CALLS:
    setattr(TimedKVConnectStorage, _name, _timed(_name))


def _caller_controller():
    frame = sys._getframe(2)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and hasattr(obj, "_stop_storage_threads"):
            return obj
        frame = frame.f_back
    return None


def _queues(controller) -> dict:
    return {q: getattr(controller, q).qsize() for q in QUEUES if hasattr(controller, q)}


def _stacks(controller) -> dict:
    frames = sys._current_frames()
    out = {}
    for name in THREADS:
        t = getattr(controller, name, None)
        if t is None or not t.is_alive():
            continue
        f, stack = frames.get(t.ident), []
        while f is not None and len(stack) < 40:
            stack.append(f"{f.f_code.co_name}:{f.f_lineno}")
            f = f.f_back
        out[name] = stack
    return out


def _wrap_stop(controller, event) -> None:
    original = controller._stop_storage_threads

    def stop():
        event(ev="stop_begin", queues=_queues(controller), alive=list(_stacks(controller)))
        done = threading.Event()

        def sample():
            while not done.wait(0.2):
                event(ev="sample", queues=_queues(controller), stacks=_stacks(controller))

        sampler = threading.Thread(target=sample, daemon=True, name="kvc-bench-sampler")
        sampler.start()
        start = time.monotonic()
        try:
            original()
            event(ev="stop_end", ok=True, s=round(time.monotonic() - start, 3))
        except Exception as e:
            event(ev="stop_end", ok=False, s=round(time.monotonic() - start, 3), error=str(e),
                  stacks=_stacks(controller))
            raise
        finally:
            done.set()

    controller._stop_storage_threads = stop
