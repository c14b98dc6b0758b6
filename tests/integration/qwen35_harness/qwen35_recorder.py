"""TEST HARNESS: a KV connector that only records what vLLM hands a connector.

Used by the Qwen3.5 tests (``qwen35_forward.py --connector recorder``) to measure, from
vLLM's real code rather than a reading of it, what a connector receives for a Gated
DeltaNet hybrid: the KV-cache groups and tensors (constructor, ``register_kv_caches``), and
per scheduler step ``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``
with the block tables of the requests named in it.

It moves no bytes. With ``claim_tokens`` = P in ``kv_connector_extra_config`` it claims P
external tokens for every prompt longer than P whose local hit is shorter, and records the
blocks vLLM allocates for them (``update_state_after_alloc``) -- the blocks a real
connector would have to fill for a resume at P. Such a run computes from unfilled state
blocks, so its outputs are not compared with anything.

Records go, one JSON object a line, to ``record_path`` from the extra config.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA,
)


def _spec_record(spec: Any) -> dict:
    out = {"type": type(spec).__name__}
    for name in ("block_size", "page_size_bytes", "real_page_size_bytes", "shapes", "dtypes",
                 "mamba_type", "mamba_cache_mode", "num_kv_heads", "head_size", "dtype",
                 "sliding_window", "page_size_padded", "num_speculative_blocks"):
        if hasattr(spec, name):
            try:
                value = getattr(spec, name)
            except Exception as exc:  # a property that does not apply to this spec
                value = f"<{type(exc).__name__}>"
            out[name] = json.loads(json.dumps(value, default=str))
    return out


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._path = extra["record_path"]
        self._claim_tokens = int(extra.get("claim_tokens", 0))
        self._role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._step = 0
        self._block_size = vllm_config.cache_config.block_size
        self._write("init", role=self._role_name, block_size=self._block_size,
                    mamba_cache_mode=str(getattr(vllm_config.cache_config, "mamba_cache_mode", None)),
                    groups=self._groups(kv_cache_config))

    def _write(self, kind: str, **fields: Any) -> None:
        with open(self._path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")

    @staticmethod
    def _groups(kv_cache_config: Any) -> Optional[dict]:
        if kv_cache_config is None:
            return None
        return {
            "num_blocks": kv_cache_config.num_blocks,
            "groups": [{"layers": list(g.layer_names), "spec": _spec_record(g.kv_cache_spec)}
                       for g in kv_cache_config.kv_cache_groups],
            "tensors": [{"size_bytes": t.size, "layers": list(t.layers), "layer_stride_bytes": t.layer_stride,
                         "block_stride_bytes": t.block_stride, "offset_bytes": t.offset}
                        for t in kv_cache_config.kv_cache_tensors],
            "prefix_cache_retention_interval": getattr(kv_cache_config, "prefix_cache_retention_interval", None),
            "hash_block_size": getattr(kv_cache_config, "hash_block_size", None),
        }

    # worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = {}
        for name, t in kv_caches.items():
            items = t if isinstance(t, (list, tuple)) else [t]
            tensors[name] = [{"shape": list(x.shape), "stride": list(x.stride()), "dtype": str(x.dtype),
                              "storage_offset": x.storage_offset(), "data_ptr": x.data_ptr(),
                              "storage_bytes": x.untyped_storage().nbytes()} for x in items]
        self._write("register_kv_caches", tensors=tensors)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        claim = 0
        if self._claim_tokens and request.num_prompt_tokens > self._claim_tokens > num_computed_tokens:
            claim = self._claim_tokens - num_computed_tokens
        self._write("match", step=self._step, req=request.request_id, prompt_tokens=request.num_prompt_tokens,
                    local_computed_tokens=num_computed_tokens, claimed_tokens=claim)
        return claim, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._write("alloc", step=self._step, req=request.request_id, num_external_tokens=num_external_tokens,
                    block_ids=[list(g) for g in blocks.get_block_ids()])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = {} if state is None else state.boundary_state_offloads
        scheduled = dict(scheduler_output.num_scheduled_tokens)
        tables = {}
        if state is not None:
            for req_id in sorted(set(offloads) | set(scheduled)):
                ids = state.get_block_ids(req_id)
                tables[req_id] = None if ids is None else [list(g) for g in ids]
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        self._write("step", step=self._step, scheduled_tokens=scheduled, new_req_computed_tokens=computed,
                    boundary_state_offloads={k: [list(e) for e in v] for k, v in offloads.items()},
                    block_tables=tables)
        self._step += 1
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        self._write("finished", step=self._step, req=request.request_id, num_computed_tokens=request.num_computed_tokens,
                    block_ids=[list(g) for g in block_ids])
        return False, None
