"""vLLM sleep mode (vLLM >= 0.33): kvconnect never touches KV memory while vLLM has released it.

vLLM 0.33's order (``EngineCore.sleep`` / ``Worker.sleep`` / ``wake_up`` / ``discard``):
pause the scheduler (abort or drain requests; level >= 1 clears vLLM's prefix cache), then
in each worker ``connector.unregister_kv_caches()`` and only then release the KV memory; on
wake-up the memory is mapped back at the same virtual addresses, then
``connector.restore_kv_caches()``, then scheduling resumes. ``discard(["kv_cache"])`` also
calls ``unregister_kv_caches`` first. Both hooks must be idempotent.

kvconnect's saves run on its own thread after the step that planned them (worker.py), so
vLLM's "transfers are already drained" does not cover them: ``unregister`` lands every
pending save before it returns, and until ``restore`` the gate is closed: a load is
reported failed without a byte written (vLLM recomputes), a save is skipped (a future miss).
Lookups keep answering (they read kvconnect's own memory only), and the chunks stored
before sleeping stay valid: sleeping changes no weights. A weight update while asleep is
followed by the caller's ``reset_prefix_cache(reset_connector=True)``, which the engine's
reset (new key generation) handles.

``supports_sleep_mode`` is True: kvconnect holds no registration of KV memory (no RDMA or
IPC handle, no pinned device pointer kept between calls); it addresses vLLM's tensors, whose
virtual addresses sleep mode keeps, only inside a transfer, and transfers stop at the gate.
"""

from __future__ import annotations

import threading


class KVMemoryGate:
    """Open while vLLM's KV memory is mapped; thread-safe; suspend/resume are idempotent."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.suspensions = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def suspend(self) -> bool:
        """Close the gate; True when it was open (the caller then drains its transfers)."""
        if not self._open.is_set():
            return False
        self._open.clear()
        self.suspensions += 1
        return True

    def resume(self) -> None:
        self._open.set()
