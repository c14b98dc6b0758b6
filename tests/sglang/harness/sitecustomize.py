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
6. Hybrid Mamba-like models (tests/sglang/test_sglang_mamba.py, LFM2): SGLang's attention
   backend wrapper imports its GDN / KDA backends for every such model, and those bind CPU
   kernels at import (``sgl_kernel.mamba.*``, ``torch.ops.sgl_kernel.fused_gdn_gating_cpu``,
   ``fused_sigmoid_gating_delta_rule_update_cpu``): names only, each raising if called
   (``sgl_kernel/mamba.py``; the ops below). LFM2's short convolution runs SGLang's own Triton
   ``causal_conv1d`` kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set by the test).
7. ``pool_host/mamba.py`` (the host pool of SGLang's Mamba states) imports the same
   ``transfer_kv_*`` copies as ``pool_host/mha.py`` only on CUDA/HIP: the same stand-ins
   are injected into it (with ``io_backend="direct"`` its per-layer and all-layer copies are
   exactly these three calls, with page size 1: one state slot per index).

Only active when ``KVCONNECT_SGLANG_CPU_HARNESS=1`` so that it never touches another process.
"""

import os

if os.environ.get("KVCONNECT_SGLANG_CPU_HARNESS") == "1":
    import importlib
    import importlib.abc
    import importlib.machinery
    import sys

    import torch

    _NAME_ONLY_OPS = ("fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu")

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
        # names only (6.): bound at import by SGLang's GDN backend, never run by the tests' models
        for name in _NAME_ONLY_OPS:
            lib.define(f"{name}(Tensor[] args) -> Tensor")

            def _raise(args, name=name):
                raise RuntimeError(f"torch.ops.sgl_kernel.{name} is not available in the kvconnect test harness")

            lib.impl(name, _raise, "CompositeExplicitAutograd")
        return lib

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

    class _Finder(importlib.abc.MetaPathFinder):
        targets = ("sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.pool_host.mha",
                   "sglang.srt.mem_cache.pool_host.mamba")

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
