"""TEST HARNESS (not the product): CPU stand-ins that let SGLang 0.5.23 run on a machine
without a GPU, applied on interpreter start (this directory is on PYTHONPATH, so the spawned
scheduler process gets them too). See docs/sglang.md, "Testing on CPU".

1. ``torch.ops.sgl_kernel.{rmsnorm_cpu, fused_add_rmsnorm_cpu, silu_and_mul_cpu,
   init_cpu_threads_env}`` in pure torch (sgl_kernel's CPU build is not on PyPI).
2. HiCache host pools pin memory through CUDA's host register: ``pin_memory`` is forced
   off in ``HostKVCache.__init__`` and in ``MambaPoolHost.__init__`` (its own constructor).
3. ``pool_host/mha.py`` imports the ``transfer_kv_*`` copies only on CUDA/HIP/XPU: the
   index-copy stand-ins from ``sgl_kernel.kvcacheio`` are injected into it.
4. ``torch.cpu.Stream`` lacks ``synchronize`` (used by ``l2_transfer.py``): a no-op.
5. Not a CPU gap but a shared-machine one: SGLang sizes host pools against free RAM minus a
   10 GiB reserve for the rest of the host (``pool_host/base.py``); on the shared 24 GB test
   VM free RAM is often below that, so the harness lowers the reserve to 512 MiB (the test
   pools are a few MiB).
6. Hybrid Mamba-like models: SGLang's attention backend wrapper imports its GDN / KDA backends
   for every such model, and those bind CPU kernels at import (``sgl_kernel.mamba.*``,
   ``torch.ops.sgl_kernel.fused_gdn_gating_cpu``, ``fused_sigmoid_gating_delta_rule_update_cpu``).
   LFM2 (tests/sglang/test_sglang_mamba.py) calls none of them: its short convolution runs
   SGLang's own Triton ``causal_conv1d`` kernels in Triton's interpreter (``TRITON_INTERPRET=1``,
   set by that test). Qwen3.5's Gated DeltaNet calls them (8.).
7. ``pool_host/mamba.py`` (the host pool of SGLang's Mamba states) imports the same
   ``transfer_kv_*`` copies as ``pool_host/mha.py`` only on CUDA/HIP: the same stand-ins
   are injected into it (with ``io_backend="direct"`` its per-layer and all-layer copies are
   exactly these three calls, with page size 1: one state slot per index).
8. Qwen3.5 (``Qwen3_5ForCausalLM``, tests/sglang/test_sglang_gdn.py): the sgl_kernel CPU ops its
   model file and GDN backend reach on CPU, with the schemas of
   ``sgl-kernel/csrc/cpu/torch_extension_cpu.cpp``, in plain torch with transformers' Qwen3.5
   math: ``fused_qk_gemma_rmsnorm_cpu`` / ``fused_qk_gemma_rmsnorm_with_gate_cpu`` (per-head
   ``x / rms(x) * (1 + w)`` of q and k; the gated variant first splits SGLang's per-head
   [query | gate] rows), ``fused_sigmoid_mul_cpu`` (attention output ``*= sigmoid(gate)``, in
   place), ``fused_qkvzba_split_reshape_cat_contiguous_cpu`` (Qwen3.5's contiguous
   [q | k | v | z], [b | a] split, as SGLang's own ``fix_query_key_value_ordering``),
   ``fused_rmsnorm_gated_cpu`` (the GDN output norm: ``w * x / rms(x) * silu(z)``),
   ``fused_gdn_gating_cpu`` and ``fused_sigmoid_gating_delta_rule_update_cpu`` (decode), the
   last two and the conv / chunk kernels in ``sgl_kernel/mamba.py`` (transformers' own
   ``causal_conv1d_update``, ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``
   over the states in SGLang's pool, in place at each request's slot). Not stood in:
   ``fused_input_proj_cpu`` (reached only with Intel AMX bf16 weights) and speculative decoding.
9. SGLang's gated RMSNorm (``kernels/ops/attention/fla/layernorm_gated.py``) takes its CPU branch
   (``fused_rmsnorm_gated_cpu``) only where ``cpu_has_amx_support()``; elsewhere it runs a Triton
   kernel that asks CUDA for its SM count. Its module flag ``_use_cpu`` is set, so SGLang's own
   CPU branch runs with the stand-in of 8.

Only active when ``KVCONNECT_SGLANG_CPU_HARNESS=1`` so that it never touches another process.
"""

import os

if os.environ.get("KVCONNECT_SGLANG_CPU_HARNESS") == "1":
    import importlib
    import importlib.abc
    import importlib.machinery
    import sys

    import torch

    def _register_ops():
        lib = torch.library.Library("sgl_kernel", "DEF")
        lib.define("rmsnorm_cpu(Tensor input, Tensor weight, float eps) -> Tensor")
        lib.define("fused_add_rmsnorm_cpu(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()")
        lib.define("silu_and_mul_cpu(Tensor input) -> Tensor")
        lib.define("init_cpu_threads_env(int[] cpu_ids) -> str")

        def _rms(x, w, eps):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

        def fused_add(x, residual, w, eps):
            residual.add_(x)
            x.copy_(_rms(residual, w, eps))

        def silu_and_mul(x):
            d = x.shape[-1] // 2
            return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

        lib.impl("rmsnorm_cpu", _rms, "CompositeExplicitAutograd")
        lib.impl("fused_add_rmsnorm_cpu", fused_add, "CompositeExplicitAutograd")
        lib.impl("silu_and_mul_cpu", silu_and_mul, "CompositeExplicitAutograd")
        lib.impl("init_cpu_threads_env", lambda ids: "", "CompositeExplicitAutograd")
        _register_qwen35_ops(lib)
        return lib

    def _register_qwen35_ops(lib):
        """8. Qwen3.5's CPU ops (schemas as sgl-kernel/csrc/cpu/torch_extension_cpu.cpp defines them)."""

        def gemma_rms(x, w, eps, head_dim):  # transformers' Qwen3_5RMSNorm per head: x / rms(x) * (1 + w), in fp32
            xf = x.reshape(-1, head_dim).float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)

        def qk_norm(q, k, q_weight, k_weight, eps, head_dim):
            return gemma_rms(q, q_weight, eps, head_dim), gemma_rms(k, k_weight, eps, head_dim)

        def qk_norm_with_gate(q_gate, k, q_weight, k_weight, eps, head_dim, num_head):
            # q_gate [T, heads * 2 * head_dim]: per head its query then its gate (SGLang's forward_prepare_native)
            q, gate = q_gate.view(q_gate.shape[0], num_head, 2 * head_dim).chunk(2, dim=-1)
            return gemma_rms(q, q_weight, eps, head_dim), gemma_rms(k, k_weight, eps, head_dim), gate.contiguous()

        def sigmoid_mul(x, gate):  # attention output gate: x *= sigmoid(gate)
            x.mul_(torch.sigmoid(gate.reshape(x.shape)))

        def qkvzba_split(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
            # Qwen3.5's contiguous layout [all q | all k | all v | all z], [all b | all a] (SGLang's
            # fix_query_key_value_ordering; its Triton twin fused_qkvzba_split_reshape_cat_contiguous)
            k_dim, v_dim = num_heads_qk * head_qk, num_heads_v * head_v
            q, k, v, z = mixed_qkvz.split([k_dim, k_dim, v_dim, v_dim], dim=-1)
            b, a = mixed_ba.split([num_heads_v, num_heads_v], dim=-1)
            return (torch.cat((q, k, v), dim=-1), z.reshape(z.shape[0], num_heads_v, head_v).contiguous(),
                    b.contiguous(), a.contiguous())

        def rmsnorm_gated(x, weight, z, eps):
            # transformers' Qwen3_5RMSNormGated (norm before the gate): weight * x / rms(x), then * silu(z) in fp32
            xf = x.float()
            y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            return (y * torch.nn.functional.silu(z.float())).to(x.dtype)

        def gdn_gating(A_log, a, b, dt_bias):
            return importlib.import_module("sgl_kernel.mamba").fused_gdn_gating(A_log, a, b, dt_bias)

        def gdn_decode(*args):
            return importlib.import_module("sgl_kernel.mamba").fused_sigmoid_gating_delta_rule_update(*args)

        for schema, impl in (
            ("fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
             " -> (Tensor, Tensor)", qk_norm),
            ("fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps,"
             " int head_dim, int num_head) -> (Tensor, Tensor, Tensor)", qk_norm_with_gate),
            ("fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()", sigmoid_mul),
            ("fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk,"
             " int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)", qkvzba_split),
            ("fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor", rmsnorm_gated),
            ("fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)", gdn_gating),
            ("fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v,"
             " Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens,"
             " bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor",
             gdn_decode),
        ):
            lib.define(schema)
            lib.impl(schema.split("(", 1)[0], impl, "CompositeExplicitAutograd")

    _LIB = _register_ops()
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None

    def _patch(module):
        name = module.__name__
        if name == "sglang.srt.mem_cache.pool_host.base":
            original = module.HostKVCache.__init__

            def __init__(self, *args, **kwargs):
                if "pin_memory" in kwargs:
                    kwargs["pin_memory"] = False
                original(self, *args, **kwargs)
                self.pin_memory = False

            module.HostKVCache.__init__ = __init__
            module.HICACHE_HOST_MEMORY_RESERVE_BYTES = 512 << 20
        elif name in ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mamba"):
            kvcacheio = importlib.import_module("sgl_kernel.kvcacheio")
            if name.endswith(".mamba"):  # MambaPoolHost has its own __init__ (no HostKVCache.__init__): 2. again
                original_mamba = module.MambaPoolHost.__init__

                def mamba_init(self, *args, **kwargs):
                    kwargs["pin_memory"] = False
                    original_mamba(self, *args, **kwargs)

                module.MambaPoolHost.__init__ = mamba_init

            for op in ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"):
                setattr(module, op, getattr(kvcacheio, op))

        elif name == "sglang.kernels.ops.attention.fla.layernorm_gated":
            # 9.: SGLang's own CPU branch of the gated RMSNorm (torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu)
            module._use_cpu = True

    class _Finder(importlib.abc.MetaPathFinder):
        targets = ("sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.pool_host.mha",
                   "sglang.srt.mem_cache.pool_host.mamba", "sglang.kernels.ops.attention.fla.layernorm_gated")

        def find_spec(self, fullname, path, target=None):
            if fullname not in self.targets:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            original_exec = loader.exec_module

            def exec_module(module):
                original_exec(module)
                _patch(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
