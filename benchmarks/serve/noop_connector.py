"""A KV connector that does nothing: the fair baseline for a connector under vLLM CPU.

vLLM's CPU backend reserves cores differently when any connector is configured, so a
connector is compared both with vLLM without one (same ``VLLM_CPU_NUM_OF_RESERVED_CPU``) and
with this one (same reservation logic, zero work). Loaded by benchmarks/vllm_serve.py as
``kv_connector_module_path=noop_connector`` with this directory on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
