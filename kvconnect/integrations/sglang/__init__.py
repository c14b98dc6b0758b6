"""kvconnect as SGLang's HiCache L3 storage backend: ``kvconnect.integrations.sglang.KVConnectStorage``.

    --enable-hierarchical-cache --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "kvconnect",
        "module_path": "kvconnect.integrations.sglang", "class_name": "KVConnectStorage"}'

The backend class imports SGLang, so it is loaded on first access; ``host_pools`` (SGLang
host pools as kvconnect planes) imports without it. See docs/sglang.md.
"""

__all__ = ["KVConnectStorage"]


def __getattr__(name: str):
    if name == "KVConnectStorage":
        from .storage import KVConnectStorage

        return KVConnectStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
