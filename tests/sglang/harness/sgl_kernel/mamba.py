"""TEST HARNESS stand-in for ``sgl_kernel.mamba`` (sgl_kernel's CPU build is not on PyPI): names only.

SGLang 0.5.23 binds the CPU GDN / KDA kernels (``causal_conv1d_fn_cpu``,
``causal_conv1d_update_cpu``, ``chunk_gated_delta_rule_cpu``) at import of
``layers/attention/linear/{gdn_backend,kda_backend}.py`` and ``kernels/gdn_triton.py``, which
its hybrid attention-backend wrapper imports for every Mamba-like model. The short-convolution
model the tests run (LFM2) never calls them: it runs SGLang's Triton ``causal_conv1d`` kernels
(``sglang/kernels/ops/mamba/causal_conv1d_triton.py``) in Triton's interpreter. Every name here
raises if it is ever called, so a test can never silently run a missing kernel.
"""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _raise(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.mamba.{name} is not available in the kvconnect test harness")

    _raise.__name__ = name
    return _raise
