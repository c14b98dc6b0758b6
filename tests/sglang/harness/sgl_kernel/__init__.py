"""TEST HARNESS stand-in for sgl_kernel's CPU build, which is not on PyPI.

Only names are provided here; the ops a tiny Llama on ``attention_backend="torch_native"``
runs are registered in pure torch by ``sitecustomize`` (``torch.ops.sgl_kernel.*``), the
HiCache index copies live in ``sgl_kernel.kvcacheio`` and Qwen3.5's Gated DeltaNet kernels in
``sgl_kernel.mamba``. Any other name is a stub that raises if it is ever called, so a test can
never silently run a missing kernel.
"""


def _stub(name):
    def _raise(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} is not available in the kvconnect test harness")

    _raise.__name__ = name
    return _raise


def __getattr__(name):
    if name.startswith("__") or name == "kvcacheio":
        raise AttributeError(name)
    return _stub(name)
