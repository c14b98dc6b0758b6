"""kvconnect's vLLM / vLLM-Ascend connector: ``kvconnect.integrations.vllm.KVConnectConnector``.

    --kv-transfer-config '{"kv_connector": "KVConnectConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "kvconnect.integrations.vllm"}'

The connector class imports vLLM, so it is loaded on first access; ``translate``,
``lookup_channel``, ``scheduler`` and ``worker`` import without vLLM (see docs/vllm.md).
"""

__all__ = ["KVConnectConnector"]


def __getattr__(name: str):
    if name == "KVConnectConnector":
        from .connector import KVConnectConnector

        return KVConnectConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
