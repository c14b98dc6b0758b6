"""The forward scripts' hook on kvconnect's vLLM connector (dsv4_forward.py, qwen35_forward.py).

Runs inside the script's own process (vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): wraps
``KVConnectConnector.register_kv_caches`` and ``KVConnectWorker._load_one`` so a recorder sees
the registered caches and every per-request restore, and may overwrite the restored blocks
before the forward reads them. The product is not changed; only that process's classes are.
"""

from __future__ import annotations

from typing import Any, Callable


def record_loads(loads: list, on_register: Callable[[Any, dict], None], randomize: Callable[[Any, int], Any]) -> None:
    """Appends {"hit", "loaded", "randomized"} to ``loads`` for every restore; ``on_register(connector,
    kv_caches)`` sees the caches first; ``randomize(block_ids, landed_tokens)`` runs after each load."""
    from kvconnect.integrations.vllm.connector import KVConnectConnector
    from kvconnect.integrations.vllm.worker import KVConnectWorker

    register, load_one = KVConnectConnector.register_kv_caches, KVConnectWorker._load_one

    def register_kv_caches(connector, kv_caches, *args):
        on_register(connector, kv_caches)
        return register(connector, kv_caches, *args)

    def _load_one(worker, job):
        landed = load_one(worker, job)
        loads.append({"hit": int(job.end_tokens), "loaded": int(landed - job.present_tokens),
                      "randomized": randomize(job.block_ids, int(landed))})
        return landed

    KVConnectConnector.register_kv_caches = register_kv_caches
    KVConnectWorker._load_one = _load_one
