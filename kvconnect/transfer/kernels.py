"""The compiled transfer kernels (csrc/), each loaded once on first use; None when not built
(no compiler at install, or no nvcc for CUDA): the torch implementation serves instead."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional


@functools.cache
def cpu_kernels() -> Optional[ModuleType]:
    """The compiled CPU kernel (csrc/), or None when it is not built: the torch implementation serves."""
    try:
        from .. import _cpu_kernels
    except ImportError:
        return None
    return _cpu_kernels


@functools.cache
def cuda_kernels() -> Optional[ModuleType]:
    """The compiled CUDA kernel, or None when it is not built (no nvcc at install)."""
    try:
        from .. import _cuda_kernels
    except ImportError:
        return None
    return _cuda_kernels
