"""Drive vLLM-Ascend 0.13.0rc3's own DeepSeek V4 KV-cache code on a CPU machine (test harness only).

vLLM-Ascend 0.13.0rc3 is its releases/v0.13.0 branch at the DeepSeek V4 commit (bbe9bc0d90).
What runs is that release's code, unchanged (venv from .ci/install_ascend013.sh):
- the specs: ``NPUModelRunner.get_kv_cache_spec`` over ``DSAAttention`` layers (layers 0, 1 and
  MTP get none; then even layers ``Compress4AttentionSpec``, odd ``Compress128AttentionSpec``);
- the grouping: vLLM 0.13's ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` as
  ``vllm_ascend.patch.platform.patch_kv_cache_utils`` replaces them (``USE_MULTI_BLOCK_POOL=1``,
  as the release's DeepSeek V4 guide sets);
- the tensors: ``NPUModelRunner._allocate_kv_cache_tensors`` / ``_reshape_kv_cache_tensors``
  (what ``register_kv_caches`` receives) and ``NPUModelRunner.initialize_kv_state`` (its
  ``kv_states``), on a runner made with ``__new__``;
- the block ids: ``KVCacheCoordinatorWithMultiPool`` (``patch_kv_cache_coordinator``: one
  ``MultiBlockPool`` pool of ``num_blocks // compress_ratio`` per group) and its
  ``CompressAttentionManager``;
- the addressing: ``get_compressed_pos_and_indices`` and ``BlockTable.compute_slot_mapping``
  (vllm_ascend/worker/block_table.py), as ``NPUModelRunner._prepare_inputs`` calls them.

Stand-ins (the product never sees them): ``torch_npu``, ``acl``, ``torchvision`` and
``torch.npu`` from tests/support/npu_stand_ins.py (placeholders that raise when called);
``vllm_ascend.utils._ascend_device_type`` set to A3 (A5's specs cannot be built by this
release: ``get_kv_cache_spec`` passes ``nope_dytpe``/``rope_dytpe``/``scale_dytpe``, which
``Compress4AttentionSpec`` does not take); layer modules made with ``__new__``; runner
attributes a built model sets (``use_compress``, attention groups, hf config numbers) set by
hand from DeepSeek V4's config values. The cache WRITE is ``write_rows``: what the release's
``torch_npu.npu_scatter_nd_update_(cache.view(-1, D), slot_mapping.unsqueeze(-1), rows)``
does (attention/dsa_v1.py), as a CPU index assignment.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ["USE_MULTI_BLOCK_POOL"] = "1"  # the release's DeepSeek V4 guide: export USE_MULTI_BLOCK_POOL=1

from support import npu_stand_ins  # noqa: E402
from support.npu_stand_ins import bare_module, ns  # noqa: E402

RELEASE = "0.13.0rc3"
NUM_LAYERS = 6  # layers 0, 1: no spec (SWA only); 2, 4: C4; 3, 5: C128
BLOCK_SIZE = 128  # the release's DeepSeek V4 guide: --block-size 128
HEAD_DIM, ROPE_DIM, INDEX_HEAD_DIM = 512, 64, 128
MAX_NUM_REQS = 4
MAX_MODEL_LEN = 65536

_READY = False


def available() -> bool:
    from importlib import metadata

    try:
        return metadata.version("vllm_ascend") == RELEASE
    except metadata.PackageNotFoundError:
        return False


def setup() -> None:
    """Stand-ins, then the release's modules and its DeepSeek V4 patches (idempotent)."""
    global _READY
    if _READY:
        return
    npu_stand_ins.install()
    import vllm_ascend.utils as ascend_utils

    ascend_utils._ascend_device_type = ascend_utils.AscendDeviceType.A3
    import vllm_ascend.ops  # noqa: F401  (before the attention backends, as the platform imports them)
    import vllm_ascend.patch.platform.patch_kv_cache_coordinator  # noqa: F401
    import vllm_ascend.patch.platform.patch_kv_cache_utils  # noqa: F401

    _READY = True


@dataclass
class Case:
    """What vLLM-Ascend 0.13 hands a connector, and the engine objects that allocate and address it."""

    kv_cache_config: Any  # vLLM's KVCacheConfig
    kv_caches: dict  # register_kv_caches(kv_caches, ...)
    kv_states: dict  # ... kv_states)
    specs: dict
    vllm_config: Any

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache_config.num_blocks)

    @property
    def groups(self) -> list:
        return list(self.kv_cache_config.kv_cache_groups)

    def coordinator(self):
        """The release's block allocator for this config (a fresh one: all blocks free)."""
        from vllm.v1.core import kv_cache_coordinator

        return kv_cache_coordinator.get_kv_cache_coordinator(
            self.kv_cache_config, max_model_len=MAX_MODEL_LEN, use_eagle=False, enable_caching=False,
            enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1, hash_block_size=BLOCK_SIZE)

    def block_table(self, group: int):
        """The runner's BlockTable of one KV-cache group (one request row)."""
        import torch
        from vllm_ascend.worker.block_table import BlockTable

        spec = self.groups[group].kv_cache_spec
        return BlockTable(block_size=spec.block_size, max_num_reqs=1,
                          max_num_blocks_per_req=-(-MAX_MODEL_LEN // BLOCK_SIZE), max_num_batched_tokens=MAX_MODEL_LEN,
                          pin_memory=False, device=torch.device("cpu"), kernel_sizes=[BLOCK_SIZE],
                          kv_cache_group=self.groups[group])

    def slots(self, group: int, block_ids: list[int], start: int, end: int) -> "Any":
        """Slots the release writes tokens [start, end) of one request to, in a group: its
        ``get_compressed_pos_and_indices`` (C4 positions are list 0, C128 list 1) and
        ``BlockTable.compute_slot_mapping``."""
        import numpy as np
        from vllm_ascend.utils import get_compressed_pos_and_indices

        positions, req_indices, counts = get_compressed_pos_and_indices(
            np.array([start]), np.array([end - start]), np.arange(1), True)
        ratio = self.groups[group].kv_cache_spec.compress_ratio
        which = {4: 0, 128: 1}[ratio]
        table = self.block_table(group)
        table.add_row(block_ids, 0)
        n = int(counts[which].sum())
        table.compute_slot_mapping(req_indices[which], positions[which])
        return table.slot_mapping.np[:n].astype(np.int64).copy()


def write_rows(cache, slots, rows) -> None:
    """``torch_npu.npu_scatter_nd_update_(cache.view(-1, D), slots.unsqueeze(-1), rows)``."""
    import torch

    flat = cache.view(-1, rows.shape[-1])
    flat[torch.as_tensor(slots, dtype=torch.long)] = rows


def read_rows(cache, slots, width: int):
    import torch

    return cache.view(-1, width)[torch.as_tensor(slots, dtype=torch.long)].clone()


def _vllm_config(ctx: dict, hf: Any) -> Any:
    import torch

    model_config = ns(hf_text_config=hf, hf_config=hf, max_model_len=MAX_MODEL_LEN, dtype=torch.bfloat16,
                       use_mla=True, model_type="deepseek_v4")
    return ns(
        model_config=model_config,
        cache_config=ns(block_size=BLOCK_SIZE, cache_dtype="auto", num_gpu_blocks_override=None,
                         enable_prefix_caching=False),
        parallel_config=ns(decode_context_parallel_size=1, prefill_context_parallel_size=1, tensor_parallel_size=1,
                            pipeline_parallel_size=1, cp_kv_cache_interleave_size=1),
        scheduler_config=ns(disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=8192),
        speculative_config=None,
        kv_transfer_config=ns(kv_connector="KVConnectConnector", kv_role="kv_both", is_kv_consumer=True,
                               is_kv_producer=True, kv_connector_extra_config={}),
        compilation_config=ns(static_forward_context=ctx),
        quant_config=None, additional_config={},
    )


@functools.lru_cache(maxsize=2)
def deepseek_v4(*, num_blocks_memory: int = 1024, device: str = "A3") -> Case:
    """DeepSeek V4 as vLLM-Ascend 0.13.0rc3 registers it on A2/A3 (bf16 head 512, int8 indexer); built
    once per size (tests re-randomise its memory and take fresh allocators from ``Case.coordinator``)."""
    setup()
    import torch
    import vllm_ascend.utils as ascend_utils
    from vllm.v1.core import kv_cache_utils
    from vllm_ascend.attention.dsa_v1 import AscendDSABackend
    from vllm_ascend.models.layer.attention.layer import DSAAttention
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    ratios = [1, 1] + [4 if i % 2 == 0 else 128 for i in range(2, NUM_LAYERS)]  # layers 0, 1: C1 (SWA only)
    hf = ns(model_type="deepseek_v4", compress_ratios=ratios, num_hidden_layers=NUM_LAYERS, head_dim=HEAD_DIM,
             rope_head_dim=ROPE_DIM, index_head_dim=INDEX_HEAD_DIM, sliding_window=128)
    ctx: dict = {}
    for i in range(NUM_LAYERS):
        name = f"model.layers.{i}.self_attn.attn"
        ctx[name] = bare_module(DSAAttention, layer_name=name, kv_sharing_target_layer_name=None)
    vc = _vllm_config(ctx, hf)
    runner = NPUModelRunner.__new__(NPUModelRunner)
    for key, value in dict(
        vllm_config=vc, model_config=vc.model_config, cache_config=vc.cache_config,
        compilation_config=vc.compilation_config, device=torch.device("cpu"), use_compress=True, use_sparse=True,
        runner_only_attn_layers=set(), shared_kv_cache_layers={}, attn_backend=AscendDSABackend,
        block_size=BLOCK_SIZE, kv_cache_dtype=torch.bfloat16, max_num_reqs=MAX_NUM_REQS, state_block_multiple=3,
        kv_states=[], speculative_config=None,
    ).items():
        setattr(runner, key, value)
    ascend_utils._ascend_device_type = getattr(ascend_utils.AscendDeviceType, device)
    try:
        specs = runner.get_kv_cache_spec()
    finally:
        ascend_utils._ascend_device_type = ascend_utils.AscendDeviceType.A3
    groups = kv_cache_utils.get_kv_cache_groups(vc, specs)
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    config = kv_cache_utils.get_kv_cache_config_from_groups(vc, groups, per_block * num_blocks_memory)
    runner.attn_groups = [[ns(backend=AscendDSABackend, kv_cache_spec=g.kv_cache_spec, layer_names=list(g.layer_names),
                               kv_cache_group_id=i)] for i, g in enumerate(config.kv_cache_groups)]
    runner.kv_cache_config = config
    raw = runner._allocate_kv_cache_tensors(config)
    caches = runner._reshape_kv_cache_tensors(config, raw)
    states = runner.initialize_kv_state()
    return Case(config, caches, states, specs, vc)
