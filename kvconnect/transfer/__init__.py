"""Move rows between an engine's paged KV planes and flat chunk buffers.

    gather(layout, tables, buffer)   # paged planes -> buffer  (store)
    scatter(layout, tables, buffer)  # buffer -> paged planes  (retrieve)

``buffer`` is a 1-D uint8 tensor (a CPU pool, pinned when the KV lives on an accelerator).
Dispatch (``backend=None``): the compiled CPU kernel for ``cpu`` planes, the compiled CUDA
kernel for ``cuda`` planes when it is built, the Triton route (triton_route.py) for Ascend
``npu`` planes when an NPU is present and Triton for the NPU (triton-ascend) is importable (its kernels
compiled and checked by ``prepare`` when the engine is created; any compile or launch failure: one
WARNING and the torch path for the rest of the process), the torch implementation
for anything else (logged once where a kernel was wanted). ``backend`` forces one of
``"cpu"``, ``"cuda"``, ``"triton"``, ``"torch"``; ``route_backend`` maps the configured
``KVCONNECT_TRANSFER_ROUTE`` to it. Every call is validated here before a pointer crosses
(the same TransferError whatever the backend); both calls return when the bytes have landed.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from ..errors import TransferError
from ..layout.kv_layout import KVLayout
from . import torch_impl, triton_route
from .tables import SEGMENT_COLS, SegmentBuilder, TransferTables, plane_table

try:
    from .. import _cpu_kernels
except ImportError:  # not built: the torch implementation serves
    _cpu_kernels = None

try:
    from .. import _cuda_kernels
except ImportError:
    _cuda_kernels = None

__all__ = ["gather", "scatter", "backend_for", "prepare", "triton_failure", "route_backend", "SegmentBuilder", "TransferTables", "plane_table",
           "validate", "BACKENDS", "ROUTES"]

logger = logging.getLogger(__name__)

BACKENDS = ("cpu", "cuda", "triton", "torch")
ROUTES = ("auto", "compiled", "triton", "torch")  # Config.transfer_route (KVCONNECT_TRANSFER_ROUTE)
_logged_fallback: set = set()
_triton_failed: dict = {}  # device type -> "stage: reason" of the Triton route's first failure there
_triton_warm: set = set()  # device types whose kernels were compiled and checked (prepare)


def route_backend(layout: KVLayout, route: str) -> Optional[str]:
    """The backend a configured route forces for these planes (None: ``backend_for``'s choice)."""
    if route not in ROUTES:
        raise TransferError(f"unknown transfer route {route!r} (one of {', '.join(ROUTES)})")
    if route == "auto":
        return None
    if route == "compiled":
        device = layout.device.type
        if device not in ("cpu", "cuda"):
            raise TransferError(f"no compiled transfer kernel for {device} planes (KVCONNECT_TRANSFER_ROUTE=compiled)")
        return device
    return route


def _fallback(device: str, why: str) -> str:
    if device not in _logged_fallback:
        _logged_fallback.add(device)
        logger.warning("kvconnect: %s planes take the torch transfer path (%s)", device, why)
    return "torch"


def triton_failure(device_type: str) -> Optional[str]:
    """Why the Triton route was given up on this device type in this process (None: it was not)."""
    return _triton_failed.get(device_type)


def _give_up_triton(device_type: str, exc: "triton_route.TritonRouteError") -> None:
    """One WARNING, then the torch path for every later transfer on this device type."""
    if device_type not in _triton_failed:
        _triton_failed[device_type] = str(exc)
        logger.warning("kvconnect: the Triton transfer route failed on %s planes at the %s stage (%s); the torch "
                       "path serves them for the rest of this process", device_type, exc.stage, exc.reason)


def prepare(layout: KVLayout, requested: Optional[str] = None) -> str:
    """``backend_for``, and where that is the Triton route on a device (not the interpreter), its kernels
    compiled and checked now (``triton_route.warm_up``) rather than on the first store. A failure there
    is logged once and the torch path takes over; returns the backend transfers will take."""
    chosen = backend_for(layout, requested)
    device = layout.device.type
    if chosen != "triton":
        return chosen
    if device in _triton_failed:
        return "torch"
    if device not in _triton_warm:
        try:
            triton_route.warm_up(layout)
        except triton_route.TritonRouteError as exc:
            _give_up_triton(device, exc)
            return "torch"
        _triton_warm.add(device)
    return chosen


def backend_for(layout: KVLayout, requested: Optional[str] = None) -> str:
    if requested is not None:
        if requested not in BACKENDS:
            raise TransferError(f"unknown transfer backend {requested!r}")
        if requested == "cpu" and (_cpu_kernels is None or layout.device.type != "cpu"):
            raise TransferError("the compiled CPU kernel needs cpu planes and a built kvconnect._cpu_kernels")
        if requested == "cuda" and (_cuda_kernels is None or layout.device.type != "cuda"):
            raise TransferError("the compiled CUDA kernel needs cuda planes and a built kvconnect._cuda_kernels")
        if requested == "triton" and not triton_route.available(layout.device.type):
            raise TransferError(f"the Triton route needs Triton for {layout.device.type} "
                                "(triton on CUDA, triton-ascend on an NPU, TRITON_INTERPRET=1 on cpu planes)")
        return requested
    device = layout.device.type
    if device == "cpu" and _cpu_kernels is not None:
        return "cpu"
    if device == "cuda" and _cuda_kernels is not None:
        return "cuda"  # the compiled kernel until the Triton route measures faster on a GPU (docs/gpu.md)
    if device == "npu":
        if device in _triton_failed:
            return "torch"  # logged when it failed
        if triton_route.available("npu"):
            return "triton"
        return _fallback(device, "no NPU is visible to torch_npu, or Triton for the NPU (triton-ascend) is not importable")
    if device in ("cpu", "cuda"):
        return _fallback(device, f"kvconnect._{device}_kernels is not built")
    return "torch"


def validate(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, *, exact_slots: bool) -> None:
    """Raise TransferError unless every index of the transfer lies inside its plane and the buffer."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TransferError(f"buffer must be a 1-D uint8 tensor, got {getattr(buffer, 'dtype', type(buffer))}")
    if not buffer.is_contiguous():
        raise TransferError("buffer must be contiguous")
    seg, slots = tables.segments, tables.slots
    if seg.dtype != np.int64 or seg.ndim != 2 or seg.shape[1] != SEGMENT_COLS or slots.dtype != np.int64 or slots.ndim != 1:
        raise TransferError("segments must be int64 [S, 4] and slots int64 [N]")
    if not len(seg):
        return
    planes, num_rows, slot_off, buf_off = seg.T
    if planes.min() < 0 or planes.max() >= len(layout.planes):
        raise TransferError(f"segment plane index out of [0, {len(layout.planes)})")
    if num_rows.min() < 0 or slot_off.min() < 0 or (slot_off + num_rows).max() > len(slots):
        raise TransferError("segment slot range outside the slot table")
    table = plane_table(layout)
    ends = buf_off + num_rows * table[planes, 3]
    if buf_off.min() < 0 or ends.max() > buffer.numel():
        raise TransferError(f"segment bytes outside the {buffer.numel()}-byte buffer")
    if exact_slots:  # the compiled kernels re-check every slot on the host in C++
        seg_of_row = np.repeat(np.arange(len(seg)), num_rows)
        first_row = np.cumsum(num_rows) - num_rows
        idx = np.repeat(slot_off - first_row, num_rows) + np.arange(len(seg_of_row))
        row_slots = slots[idx]
        limit = table[planes[seg_of_row], 5]
        bad = (row_slots < 0) | (row_slots >= limit)
        if bad.any():
            i = int(np.argmax(bad))
            raise TransferError(f"slot {int(row_slots[i])} out of [0, {int(limit[i])}) for plane {layout.planes[planes[seg_of_row[i]]].name}")


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


def _run(direction: str, layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, backend: Optional[str], num_threads: int,
         cuda_tuning, triton_tuning) -> None:
    chosen = backend_for(layout, backend)
    if chosen != "cuda":  # the CUDA wrapper checks the buffer, its C++ side every index (O(slots + segments))
        validate(layout, tables, buffer, exact_slots=chosen in ("torch", "triton"))
    if not len(tables.segments):
        return
    if chosen == "cpu":
        if buffer.device.type != "cpu":
            raise TransferError("the CPU kernel needs a CPU buffer")
        fn = _cpu_kernels.gather if direction == "gather" else _cpu_kernels.scatter
        try:
            fn(plane_table(layout), tables.segments, tables.slots, buffer.data_ptr(), buffer.numel(), num_threads)
        except (IndexError, ValueError) as exc:
            raise TransferError(str(exc)) from exc
    elif chosen == "cuda":
        from . import cuda as cuda_backend

        cuda_backend.run(direction, layout, tables, buffer, tuning=cuda_tuning)
    elif chosen == "triton" and layout.device.type not in _triton_failed:
        try:
            triton_route.run(direction, layout, tables, buffer, tuning=triton_tuning)
        except triton_route.TritonRouteError as exc:  # never a failed transfer: the torch path redoes all of it
            _give_up_triton(layout.device.type, exc)
            (torch_impl.gather if direction == "gather" else torch_impl.scatter)(layout, tables, buffer)
            _sync(layout.device)
    else:
        (torch_impl.gather if direction == "gather" else torch_impl.scatter)(layout, tables, buffer)
        _sync(layout.device)


def gather(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, *, backend: Optional[str] = None, num_threads: int = 1,
           cuda_tuning=None, triton_tuning=None) -> None:
    """Copy the rows named by ``tables`` from the paged planes into ``buffer``.

    ``num_threads`` is for the CPU kernel, ``cuda_tuning`` (a ``cuda.KernelTuning``) for the CUDA one,
    ``triton_tuning`` (a ``triton_route.TritonTuning``) for the Triton route."""
    _run("gather", layout, tables, buffer, backend, num_threads, cuda_tuning, triton_tuning)


def scatter(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, *, backend: Optional[str] = None, num_threads: int = 1,
            cuda_tuning=None, triton_tuning=None) -> None:
    """Copy rows from ``buffer`` into the paged planes at the slots named by ``tables``."""
    _run("scatter", layout, tables, buffer, backend, num_threads, cuda_tuning, triton_tuning)
