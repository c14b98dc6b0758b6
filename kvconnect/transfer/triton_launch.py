"""Launching the Triton transfer kernels: where they run, how wide, and what a failure means.

The pieces both ways of the Triton route share (``triton_route``: direct; ``triton_staged``:
through a device ring): whether a device can run the kernels (``available``; the CPU only under
Triton's interpreter, an NPU only with triton-ascend's backend), the kernels themselves (loaded on
first use, ``kernels``), the launch shape (``TritonTuning``, ``num_programs``, ``work_items``,
``launch_align``), one host-to-device upload of the launch tables, and failures as
``TritonRouteError`` naming their stage (compile, launch, check) so the dispatcher can give the
route up for the torch path.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import TransferError
from ..layout.kv_layout import KVLayout
from .tables import TransferTables, plane_table

NPU_BACKENDS = ("ascend", "cann")  # triton-ascend's backend name (older, newer releases)
MAX_GRID = 65535  # triton-ascend's launcher refuses more programs (unless TRITON_ALL_BLOCKS_PARALLEL=1)


class TritonRouteError(RuntimeError):
    """A kernel of the route failed to compile, launch or move the right bytes (``stage`` says which)."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason


def stage_of(exc: BaseException, default: str) -> str:
    """'compile' for Triton's and the backend's compiler errors (subprocess of a compiler stage included)."""
    import subprocess

    name = type(exc).__module__ + "." + type(exc).__name__
    if isinstance(exc, subprocess.CalledProcessError) or name.startswith("triton.compiler") or "Compil" in name:
        return "compile"
    return default


def launch(stage: str, fn, *args, **kwargs) -> None:
    """Run a kernel launch; any failure but bad input becomes a TritonRouteError naming its stage."""
    try:
        fn(*args, **kwargs)
    except (TransferError, TritonRouteError):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the compiler or the driver raises
        raise TritonRouteError(stage_of(exc, stage), f"{type(exc).__name__}: {str(exc).strip()[:400]}") from exc


@dataclass(frozen=True, kw_only=True)
class TritonTuning:
    """Launch shape and staging of the Triton route.

    staged: None = direct where the device can address the buffer, else staged; True / False
        force one (False fails where the buffer is out of the device's reach).
    item_bytes: rows per work item = max(1, item_bytes // row_bytes) (load balance of the grid).
    num_programs: persistent grid size; None = 4 per SM on CUDA, the vector cores on an NPU,
        4 under the interpreter.
    staging_slots, first_piece_bytes, max_piece_bytes, merge_gap_bytes, max_op_bytes: the staged
        route's ring and plan, with the meaning of cuda.KernelTuning's fields of the same names.
    """

    staged: Optional[bool] = None
    item_bytes: int = 64 << 10
    num_programs: Optional[int] = None
    staging_slots: int = 2
    first_piece_bytes: int = 1 << 20
    max_piece_bytes: int = 8 << 20
    merge_gap_bytes: int = 64 << 10
    max_op_bytes: int = 32768

    def __post_init__(self) -> None:
        if self.item_bytes < 1 or self.item_bytes > (1 << 30):
            raise TransferError("item_bytes must be in [1, 2**30]")
        if self.num_programs is not None and not 1 <= self.num_programs <= 65535:
            raise TransferError("num_programs must be in [1, 65535]")
        if not 2 <= self.staging_slots <= 16:
            raise TransferError("staging_slots must be in [2, 16]")
        if self.max_op_bytes < 16 or self.max_op_bytes > (1 << 30):
            raise TransferError("max_op_bytes must be in [16, 2**30]")


DEFAULT_TUNING = TritonTuning()


# ---------------------------------------------------------------------------------------
# availability


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """True when Triton's interpreter runs the kernels (TRITON_INTERPRET=1 when they were loaded)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().segments_kernel, InterpretedFunction)


def available(device_type: str) -> bool:
    """Whether the Triton route can serve planes on this device type."""
    if not triton_importable():
        return False
    if device_type == "cpu":  # only Triton's interpreter runs on the CPU
        return interpreted()
    if device_type == "cuda":
        return torch.cuda.is_available()
    if device_type == "npu":  # an NPU present, and triton-ascend's backend (under one of these names)
        if not npu_present():
            return False
        try:
            from triton.backends import backends
        except ImportError:
            return False
        return any(name in backends for name in NPU_BACKENDS)
    return False


def npu_present() -> bool:
    """Whether torch_npu is loaded and sees at least one NPU."""
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except Exception:  # noqa: BLE001 - a half-installed torch_npu: no NPU for us
        return False


def kernels():
    from . import triton_kernels  # imported on first use: TRITON_INTERPRET is read at import

    return triton_kernels


# ---------------------------------------------------------------------------------------
# launch shape


def upload(device: torch.device, *arrays: np.ndarray) -> list:
    """int64 arrays -> device tensors, in one host-to-device copy."""
    flat = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    packed = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, np.int64)).to(device)
    out, at = [], 0
    for a, f in zip(arrays, flat):
        out.append(packed[at : at + f.size].view(a.shape))
        at += f.size
    return out


def device_module(device: torch.device):
    return None if device.type == "cpu" else getattr(torch, device.type, None)


def num_programs(device: torch.device, tuning: TritonTuning) -> int:
    return min(MAX_GRID, wanted_programs(device, tuning))


def wanted_programs(device: torch.device, tuning: TritonTuning) -> int:
    if tuning.num_programs is not None:
        return tuning.num_programs
    if device.type == "cpu":
        return 4
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    try:  # triton-ascend: {"num_aicore": .., "num_vectorcore": ..}
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props.get("num_vectorcore") or props.get("num_aicore") or 48)
    except Exception:  # noqa: BLE001 - a property query must not fail the copy
        return 48


def unit_log2(align: np.ndarray) -> np.ndarray:
    """log2 of the widest unit in {1, 2, 4, 8, 16} bytes dividing every ``align`` value."""
    low = np.minimum(align & -align, 16)
    low[align == 0] = 16
    return np.log2(low).astype(np.int64)


class NoGuard:
    """The device guard of a device type without one (the CPU)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def work_items(layout: KVLayout, tables: TransferTables, item_bytes: int) -> np.ndarray:
    """[I, 3] int64: segment, first_row, num_rows (see triton_kernels.py)."""
    seg = tables.segments
    table = plane_table(layout)
    planes, num_rows = seg[:, 0], seg[:, 1]
    row_bytes = table[planes, 3]
    per_item = np.maximum(1, item_bytes // row_bytes)
    count = -(-num_rows // per_item)
    owner = np.repeat(np.arange(len(seg), dtype=np.int64), count)
    k = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    first = k * per_item[owner]
    n = np.minimum(per_item[owner], num_rows[owner] - first)
    return np.stack([owner, first, n], axis=1)


def launch_align(device: torch.device, *values: np.ndarray) -> int:
    """The ALIGN a launch states to the compiler: the widest power of two up to 16 dividing every
    address, stride and length it touches; 1 on an NPU (DMA is byte-granular: nothing to gain,
    and one compiled variant per kernel and direction)."""
    if device.type == "npu":
        return 1
    every = np.bitwise_or.reduce(np.concatenate([np.asarray(v, np.int64).reshape(-1) for v in values]))
    return int(1 << int(unit_log2(np.array([every], np.int64))[0]))
