"""Drive vLLM-Ascend 0.23.0.post1's own KV-cache code on a CPU machine (test harness only).

What runs is the engine's code, unchanged: its spec classes and the layers' own
``get_kv_cache_spec`` (``NPUModelRunner.get_kv_cache_spec`` for dense/MLA/V3.2, the DeepSeek V4
cache layers for V4), vLLM 0.23's grouping (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``) with ``vllm_ascend.patch.platform.patch_kv_cache_utils``
applied, and ``NPUModelRunner._allocate_kv_cache_tensors`` / ``_reshape_kv_cache_tensors`` on a
runner made with ``__new__``. ``RealCase.kv_caches`` is exactly what vLLM-Ascend hands to a
connector's ``register_kv_caches``; ``RealCase.kv_cache_config`` is the connector's
``kv_cache_config``.

Stand-ins (the product never sees them; documented, minimal; tests/support/npu_stand_ins.py):
- ``torch_npu``, ``acl``, ``torchvision`` (every submodule): modules whose attributes are
  placeholder classes that raise when called. Imports and annotations resolve; nothing NPU
  runs. ``torch_npu`` needs CANN's native libraries, which no package index has.
- ``torch.npu``: the same, with ``is_available() -> False`` (transformers probes it).
- ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` so torch does not load the installed torch_npu.
- ``vllm_ascend.utils._ascend_device_type`` set by hand (A2/A3/A5), and
  ``DSV4_BLOCK_SIZES`` recomputed by the engine's own ``get_dsv4_block_sizes()`` after that
  (the module computes it once at import, from the device type).
- vLLM's built-in spec/manager registry is filled before ``register_ascend_kv_cache_specs``
  (the registry only self-populates while empty; the engine fills both at start-up).
- Layer modules (vLLM's ``Attention``/``MLAAttention``, vLLM-Ascend's DeepSeek V4 cache layers)
  are made with ``__new__`` and carry the attributes their ``get_kv_cache_spec`` reads;
  runner attributes a built model would set (use_sparse, use_compress, attention groups,
  hf config numbers) are set by hand from the model's config values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from support import npu_stand_ins
from support.npu_stand_ins import bare_module, ns

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_ascend") is not None and importlib.util.find_spec("vllm") is not None


_READY = False


def setup() -> None:
    """Install the stand-ins and import vLLM-Ascend's pieces (idempotent)."""
    global _READY
    if _READY:
        return
    npu_stand_ins.install()
    import vllm_ascend.utils as ascend_utils

    ascend_utils._ascend_device_type = ascend_utils.AscendDeviceType.A3
    import vllm_ascend.ops  # noqa: F401  (before the attention backends: circular import otherwise)
    import vllm_ascend.patch.platform.patch_kv_cache_utils  # noqa: F401
    from vllm_ascend.core.kv_cache_interface import register_ascend_kv_cache_specs

    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(None)  # vLLM's own specs first, as the engine registers them
    register_ascend_kv_cache_specs()
    _READY = True


def set_device(kind: str) -> None:
    """A2 / A3 / A5, and DeepSeek V4's block-size table recomputed for it by the engine."""
    import vllm_ascend.utils as ascend_utils
    from vllm_ascend.models.layer.attention import layer as dsv4_layer

    ascend_utils._ascend_device_type = getattr(ascend_utils.AscendDeviceType, kind)
    dsv4_layer.DSV4_BLOCK_SIZES = dsv4_layer.get_dsv4_block_sizes()


@dataclass
class RealCase:
    name: str
    kv_cache_config: Any  # vLLM's KVCacheConfig
    kv_caches: dict  # what register_kv_caches receives
    specs: dict  # layer -> spec, as the engine produced them
    vllm_config: Any
    kernel_block_size: int  # tokens per kernel block of attention backends (vLLM block = k kernel blocks)
    device: str = "A3"

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache_config.num_blocks)

    @property
    def groups(self) -> list:
        return list(self.kv_cache_config.kv_cache_groups)


# -------------------------------------------------------------------------------------
# configuration objects (only what the engine's code reads)


def _vllm_config(*, block_size: int, hf: Any = None, model_type: str = "llama", num_blocks: int,
                 dcp: int = 1, forward_context: dict | None = None, cache_dtype: str = "auto") -> Any:
    import torch

    hf = hf or ns(model_type=model_type)
    hf.model_type = getattr(hf, "model_type", model_type)
    model_config = ns(hf_text_config=hf, hf_config=hf, max_model_len=8192, dtype=torch.bfloat16,
                       original_max_model_len=8192, use_mla=False, model_type=hf.model_type,
                       is_deepseek_mla=False)
    return ns(
        model_config=model_config,
        cache_config=ns(block_size=block_size, cache_dtype=cache_dtype, num_gpu_blocks_override=num_blocks,
                         enable_prefix_caching=True, kv_sharing_fast_prefill=False),
        parallel_config=ns(decode_context_parallel_size=dcp, prefill_context_parallel_size=1,
                            tensor_parallel_size=1, pipeline_parallel_size=1, cp_kv_cache_interleave_size=1),
        scheduler_config=ns(disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=2048),
        speculative_config=None,
        kv_transfer_config=ns(kv_connector="KVConnectConnector", kv_role="kv_both", is_kv_consumer=True,
                               is_kv_producer=True, kv_connector_extra_config={}),
        compilation_config=ns(static_forward_context=forward_context if forward_context is not None else {}),
        quant_config=None,
        additional_config={},
    )


def _runner(vllm_config, *, use_sparse=False, use_compress=False, attn_groups=(), attn_backend=None, **extra):
    import torch
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    from vllm_ascend.core.kv_cache_interface import _get_c8_k_cache_dtype, _get_c8_k_scale_cache_dtype

    runner = NPUModelRunner.__new__(NPUModelRunner)
    attrs = dict(
        vllm_config=vllm_config, model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
        compilation_config=vllm_config.compilation_config, device=torch.device("cpu"),
        use_sparse=use_sparse, use_compress=use_compress, runner_only_attn_layers=set(),
        shared_kv_cache_layers={}, attn_groups=[list(attn_groups)] if attn_groups else [],
        use_hybrid_blocks=len(attn_groups) > 1, hybrid_with_attn_and_mamba=False, attn_backend=attn_backend,
        block_size=vllm_config.cache_config.block_size, kv_cache_dtype=torch.bfloat16,
        sfa_dcp_replicated_indexer_size=1, c8_k_cache_dtype=_get_c8_k_cache_dtype(),
        c8_k_scale_cache_dtype=_get_c8_k_scale_cache_dtype(),
    )
    attrs.update(extra)
    for key, value in attrs.items():
        setattr(runner, key, value)
    return runner


def _attn_groups(kv_cache_config, backend_of) -> list:
    """One attention group per (KV-cache group, backend), as the runner builds them."""
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        groups.append(ns(backend=backend_of(g), kv_cache_spec=group.kv_cache_spec,
                          layer_names=list(group.layer_names), kv_cache_group_id=g))
    return groups


def _allocate(runner, kv_cache_config) -> dict:
    runner.kv_cache_config = kv_cache_config
    raw = runner._allocate_kv_cache_tensors(kv_cache_config)
    return runner._reshape_kv_cache_tensors(kv_cache_config, raw)


def _group(vllm_config, specs: dict, num_blocks: int):
    from vllm.v1.core import kv_cache_utils

    groups = kv_cache_utils.get_kv_cache_groups(vllm_config, specs)
    page = max(s.page_size_bytes for s in specs.values())
    config = kv_cache_utils.get_kv_cache_config_from_groups(vllm_config, groups, page * num_blocks * len(specs) * 4)
    return config


# -------------------------------------------------------------------------------------
# models


def gqa(*, block_size: int = 128, num_layers: int = 2, num_blocks: int = 12, window: int | None = None) -> RealCase:
    """Llama-like GQA (2 KV heads x 64, bf16); with ``window``: every other layer sliding (full+SWA hybrid)."""
    setup()
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend

    specs = {}
    for i in range(num_layers):
        name = f"model.layers.{i}.self_attn.attn"
        if window is not None and i % 2 == 0:
            specs[name] = SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                                            dtype=torch.bfloat16, sliding_window=window)
        else:
            specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    vc = _vllm_config(block_size=block_size, num_blocks=num_blocks)
    config = _group(vc, specs, num_blocks)
    groups = _attn_groups(config, lambda g: AscendAttentionBackend)
    runner = _runner(vc, attn_groups=groups)
    caches = _allocate(runner, config)
    kernel = AscendAttentionBackend.get_supported_kernel_block_sizes()[0] if runner.use_hybrid_blocks else block_size
    name = "gqa" if window is None else f"gqa-swa{window}-bs{block_size}"
    return RealCase(name, config, caches, specs, vc, kernel)




def deepseek_mla(*, variant: str = "v3", block_size: int = 128, num_blocks: int = 12, dcp: int = 1,
                 device: str = "A3") -> RealCase:
    """DeepSeek V3 MLA (variant v3) or V3.2 (v32: bf16 indexer; v32-c8: LI C8), two layers;
    for V3.2 layer 1 reuses layer 0's top-k (no indexer cache), as in the model."""
    setup()
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    set_device(device)  # LI C8 dtypes follow the device (A2/A3: int8 K + fp16 scale)
    sparse = variant != "v3"
    hf = ns(model_type="deepseek_v32" if sparse else "deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64,
             index_head_dim=128, index_n_heads=64, index_topk=2048)
    ctx: dict = {}
    vc = _vllm_config(block_size=block_size, hf=hf, num_blocks=num_blocks, dcp=dcp, forward_context=ctx)
    for i in range(2):
        name = f"model.layers.{i}.self_attn.attn"
        impl = ns(has_indexer=(i == 0), enable_sparse_sfa_c8=False, enable_sparse_li_c8=(variant == "v32-c8" and i == 0),
                   fa_quant_layer=False)
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        layer = bare_module(MLAAttention, impl=impl, kv_lora_rank=512, qk_rope_head_dim=64, head_size=512,
                        kv_sharing_target_layer_name=None, layer_name=name)
        object.__setattr__(layer, "get_kv_cache_spec", lambda _vc, _s=spec: _s)
        ctx[name] = layer
    runner = _runner(vc, use_sparse=sparse, sparse_head_dim=(512, 64, 128), kv_cache_dtype=torch.bfloat16,
                     sfa_dcp_replicated_indexer_size=dcp if sparse else 1)
    specs = runner.get_kv_cache_spec()
    config = _group(vc, specs, num_blocks)
    from vllm_ascend.attention.mla_v1 import AscendMLABackend
    from vllm_ascend.attention.sfa_v1 import AscendSFABackend

    backend = AscendSFABackend if sparse else AscendMLABackend
    runner.attn_groups = [_attn_groups(config, lambda g: backend)]
    runner.use_hybrid_blocks = False
    caches = _allocate(runner, config)
    return RealCase(f"deepseek-{variant}" + (f"-dcp{dcp}" if dcp > 1 else ""), config, caches, specs, vc, block_size,
                    device=device)


DSV4_LAYERS = (0, 4, 128, 4)  # compress ratio per layer: a C1 (SWA only) / C4 / C128 / C4 four-layer model


def deepseek_v4(*, device: str = "A3", block_size: int = 128, num_blocks: int = 10) -> RealCase:
    """DeepSeek V4 as vLLM-Ascend 0.23.0.post1 registers it (A2/A3: bf16 head 512, int8 indexer;
    A5: fp8 head 640, fp8 indexer with an fp32 scale and a third, overlapping view)."""
    setup()
    set_device(device)
    import torch
    from vllm_ascend.attention.dsa_v1 import AscendDSABackend
    from vllm_ascend.models import deepseek_v4 as m
    from vllm_ascend.models.layer.attention.layer import DSV4_BLOCK_SIZES, DSAAttention

    sizes = DSV4_BLOCK_SIZES[block_size][0]
    hf = ns(model_type="deepseek_v4", compress_ratios=list(DSV4_LAYERS), num_hidden_layers=len(DSV4_LAYERS),
             sliding_window=128, head_dim=512, index_head_dim=128)
    ctx: dict = {}
    vc = _vllm_config(block_size=block_size, hf=hf, num_blocks=num_blocks, forward_context=ctx)
    cache_cfg = vc.cache_config
    for i, ratio in enumerate(DSV4_LAYERS):
        p = f"model.layers.{i}.self_attn"
        ctx[f"{p}.swa_cache"] = bare_module(m.AscendDeepseekV4SWACache, head_dim=512, window_size=128, dtype=torch.bfloat16,
                                        block_size=sizes[1], cache_config=cache_cfg, prefix=f"{p}.swa_cache")
        if ratio <= 1:
            continue
        ctx[p] = bare_module(DSAAttention, compress_ratio=ratio, kv_cache_dtype="auto", head_size=512, prefix=p,
                         attn_backend=AscendDSABackend)
        state_block = sizes[2] if ratio == 4 else sizes[3]
        coff = 2 if ratio == 4 else 1
        ctx[f"{p}.compressor.state_cache"] = bare_module(
            m.AscendCompressorStateCache, state_dim=2 * coff * 512, dtype=torch.float32, compress_ratio=ratio,
            block_size=state_block, sliding_window=coff * ratio, prefix=f"{p}.compressor.state_cache")
        if ratio == 4:
            ctx[f"{p}.indexer.k_cache"] = bare_module(
                m.AscendDeepseekV4IndexerCache, head_dim=128,
                dtype=torch.float8_e4m3fn if device == "A5" else torch.int8, prefix=f"{p}.indexer.k_cache",
                cache_config=cache_cfg, compress_ratio=ratio)
            ctx[f"{p}.indexer.compressor.state_cache"] = bare_module(
                m.AscendCompressorStateCache, state_dim=2 * coff * 128, dtype=torch.float32, compress_ratio=ratio,
                block_size=state_block, sliding_window=coff * ratio, prefix=f"{p}.indexer.compressor.state_cache")
    specs = {name: layer.get_kv_cache_spec(vc) for name, layer in ctx.items()}
    specs = {k: v for k, v in specs.items() if v is not None}
    config = _group(vc, specs, num_blocks)
    runner = _runner(vc, use_compress=True, attn_backend=AscendDSABackend)
    runner.attn_groups = [_attn_groups(config, lambda g: AscendDSABackend)]
    runner.use_hybrid_blocks = False
    caches = _allocate(runner, config)
    return RealCase(f"deepseek-v4-{device}", config, caches, specs, vc, block_size, device=device)


def qwen35(*, num_blocks: int = 12, mamba_cache_mode: str = "align") -> RealCase:
    """The tiny Qwen3.5 of tests/support/tiny_models.py (``make_qwen35``) as vLLM-Ascend 0.23 lays it out:
    3 Gated DeltaNet layers (``MambaSpec``; shapes from vLLM's ``MambaStateShapeCalculator``:
    conv state of conv dim 2 x 2 x 64 + 4 x 64 = 512 over kernel 4 - 1, recurrent state
    (4, 64, 64); dtypes from ``gated_delta_net_state_dtype`` for a bf16 model with
    ``mamba_ssm_dtype`` float32, as Qwen3.5 configs set it) and 1 full-attention layer (1 KV
    head x 64, bf16). Block size 384 and the state page padded to the attention page (98,304
    bytes), as vLLM 0.23's ``_align_hybrid_block_size`` computes it for Ascend's 128-token
    kernel blocks."""
    setup()
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend

    kernel = AscendAttentionBackend.get_supported_kernel_block_sizes()[0]
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 2, 4, 64, 64, 4)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32")
    real = sum(int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes))
    token_bytes = 2 * 1 * 64 * 2
    block_size = kernel * -(-real // (kernel * token_bytes))
    specs = {}
    for i in range(3):
        specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
            block_size=block_size, shapes=tuple(shapes), dtypes=tuple(dtypes), page_size_padded=block_size * token_bytes,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode=mamba_cache_mode)
    specs["model.layers.3.self_attn.attn"] = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                                                               dtype=torch.bfloat16)
    vc = _vllm_config(block_size=block_size, num_blocks=num_blocks, model_type="qwen3_5_text")
    vc.cache_config.mamba_cache_mode = mamba_cache_mode
    config = _group(vc, specs, num_blocks)
    groups = _attn_groups(config, lambda g: AscendAttentionBackend)
    runner = _runner(vc, attn_groups=groups, hybrid_with_attn_and_mamba=True)
    caches = _allocate(runner, config)
    return RealCase("qwen35", config, caches, specs, vc, kernel)
