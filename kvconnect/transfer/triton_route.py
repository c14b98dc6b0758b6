"""The Triton transfer route: host side of triton_kernels.py (one kernel source for GPUs, Ascend NPUs
through triton-ascend, and the CPU through Triton's interpreter).

    run(direction, layout, tables, buffer, tuning=None)   # returns when the bytes have landed

direction: ``"gather"`` (store: planes -> buffer) or ``"scatter"`` (load: buffer -> planes).
tables:    the same TransferTables the CPU and CUDA kernels take, validated by the caller
           (``tables.validate``, every slot) before anything reaches a kernel.
buffer:    1-D contiguous uint8: on the planes' device, or host memory.

Two ways between device and host:

- direct: one launch of ``segments_kernel`` over the whole batch (every plane of every group
  and chunk) reading or writing the buffer through an address the device can use: a buffer on
  the planes' device, pinned host memory on CUDA (unified addressing: the host address is the
  device address), and everything under the interpreter.
- staged: where the device cannot address the host buffer (an Ascend NPU; a pageable buffer on
  CUDA) or when ``TritonTuning(staged=True)`` asks for it, through a ring of device slots
  (``triton_staged``).

What launching needs (availability, tuning, launch shape, errors by stage) is ``triton_launch``.

Which device runs which: docs/gpu.md ("Triton route").
"""

from __future__ import annotations

import weakref
from typing import Optional

import numpy as np
import torch

from ..errors import TransferError
from ..layout.kv_layout import KVLayout
from . import triton_launch as launch
from .tables import TransferTables, plane_table
from .triton_launch import DEFAULT_TUNING, TritonRouteError, TritonTuning
from .triton_staged import run_staged

_INT32_MAX = (1 << 31) - 1


# ---------------------------------------------------------------------------------------
# device resources


_plane_tables: "weakref.WeakKeyDictionary[KVLayout, torch.Tensor]" = weakref.WeakKeyDictionary()  # each layout's plane table on its device


def _device_planes(layout: KVLayout) -> torch.Tensor:
    table = _plane_tables.get(layout)
    if table is None:
        table = torch.from_numpy(plane_table(layout).copy()).to(layout.device)
        _plane_tables[layout] = table
    return table


# ---------------------------------------------------------------------------------------
# the route


def _check(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor) -> None:
    table = plane_table(layout)
    used = np.unique(tables.segments[:, 0])
    if (table[used, 5] > _INT32_MAX).any() or (table[used, 3] > _INT32_MAX).any():
        raise TransferError("the Triton route needs planes of < 2**31 slots and rows of < 2**31 bytes")
    device = layout.device
    if buffer.device.type != "cpu" and (buffer.device.type, buffer.device.index or 0) != (device.type, device.index or 0):
        raise TransferError(f"buffer is on {buffer.device}, the planes on {device}")
    if device.type == "cpu" and not launch.interpreted():
        raise TransferError("Triton on cpu planes runs in its interpreter: set TRITON_INTERPRET=1 before "
                            "kvconnect.transfer.triton_kernels is first imported")


def _direct_reach(layout: KVLayout, buffer: torch.Tensor) -> bool:
    """Whether a kernel on the planes' device can address ``buffer`` directly."""
    device = layout.device
    if buffer.device.type != "cpu" or device.type == "cpu":
        return True
    return device.type == "cuda" and buffer.is_pinned()  # unified addressing: host address == device address


def run(direction: str, layout: KVLayout, tables: TransferTables, buffer: torch.Tensor,
        tuning: Optional[TritonTuning] = None) -> None:
    """Move the rows of validated ``tables``; returns once the bytes have landed."""
    if direction not in ("gather", "scatter"):
        raise TransferError(f"direction must be 'gather' or 'scatter', got {direction!r}")
    t = tuning or DEFAULT_TUNING
    if not len(tables.segments):
        return
    _check(layout, tables, buffer)
    reach = _direct_reach(layout, buffer)
    staged = (not reach) if t.staged is None else t.staged
    if not staged and not reach:
        raise TransferError(f"a {layout.device.type} kernel cannot address this {buffer.device} buffer "
                            "(pinned host memory is needed on CUDA); use the staged route")
    if staged and buffer.device.type != "cpu":
        staged = False  # a device buffer gains nothing from staging
    to_buffer = direction == "gather"
    mod = launch.device_module(layout.device)
    guard = mod.device(layout.device) if mod is not None and hasattr(mod, "device") else launch.NoGuard()
    with guard:
        if staged:
            run_staged(layout, tables, buffer, to_buffer, t, mod)
        else:
            _run_direct(layout, tables, buffer, to_buffer, t)
        if mod is not None:
            mod.current_stream().synchronize()


def _run_direct(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, to_buffer: bool, t: TritonTuning) -> None:
    device = layout.device
    items = launch.work_items(layout, tables, t.item_bytes)
    table = plane_table(layout)[np.unique(tables.segments[:, 0])]
    align = launch.launch_align(device, table[:, :4], buffer.data_ptr() + tables.segments[:, 3])
    segments, slots, items_dev = launch.upload(device, tables.segments, tables.slots, items)
    grid = (max(1, min(len(items), launch.num_programs(device, t))),)
    k = launch.kernels()
    launch.launch("launch", k.segments_kernel[grid], _device_planes(layout), segments, slots, items_dev, len(items),
            buffer.data_ptr(), TO_BUFFER=to_buffer, ALIGN=align, CHUNK=k.CHUNK_BYTES)


# ---------------------------------------------------------------------------------------
# warm-up


def warm_up(layout: KVLayout) -> None:
    """Compile and run every kernel variant the route launches for these planes, on a tiny private
    table (two 5-row blocks of a scratch plane on the planes' device; the engine's planes are never
    touched), both directions, direct and staged, and check the bytes. Raises TritonRouteError
    (stage: "warm-up compile", "warm-up launch" or "warm-up check")."""
    device = layout.device
    align = launch.launch_align(device, plane_table(layout)[:, :4], np.array([256], np.int64))
    rows, row_bytes = 10, 5 * align
    mod = launch.device_module(device)
    guard = mod.device(device) if mod is not None and hasattr(mod, "device") else launch.NoGuard()
    k = launch.kernels()
    with guard:
        src = (torch.arange(rows * row_bytes, dtype=torch.int64) % 251 + 1).to(torch.uint8).to(device)
        planes = torch.tensor([[src.data_ptr(), 5 * row_bytes, row_bytes, row_bytes, 5, rows]], dtype=torch.int64,
                              device=device)
        slots = np.array([7, 2, 9], np.int64)
        want = src.view(rows, row_bytes)[torch.from_numpy(slots).to(device)].reshape(-1)
        segments, slots_dev, items = launch.upload(device, np.array([[0, 3, 0, 0]], np.int64), slots,
                                             np.array([[0, 0, 3]], np.int64))
        flat = torch.zeros(want.numel(), dtype=torch.uint8, device=device)
        back = torch.zeros_like(src)
        ring = torch.zeros(want.numel(), dtype=torch.uint8, device=device)
        (ops,) = launch.upload(device, np.array([[src.data_ptr() + s * row_bytes, i * row_bytes, row_bytes]
                                           for i, s in enumerate(slots)], np.int64))
        try:
            k.segments_kernel[(1,)](planes, segments, slots_dev, items, 1, flat.data_ptr(), TO_BUFFER=True, ALIGN=align,
                                    CHUNK=k.CHUNK_BYTES)
            planes_back = planes.clone()
            planes_back[0, 0] = back.data_ptr()
            k.segments_kernel[(1,)](planes_back, segments, slots_dev, items, 1, flat.data_ptr(), TO_BUFFER=False,
                                    ALIGN=align, CHUNK=k.CHUNK_BYTES)
            k.ops_kernel[(1,)](ops, len(slots), ring.data_ptr(), TO_BUFFER=True, ALIGN=align, CHUNK=k.CHUNK_BYTES)
            k.ops_kernel[(1,)](ops, len(slots), ring.data_ptr(), TO_BUFFER=False, ALIGN=align, CHUNK=k.CHUNK_BYTES)
            if mod is not None:
                mod.current_stream().synchronize()
        except Exception as exc:  # noqa: BLE001 - whatever the compiler or the driver raises
            stage = "warm-up " + launch.stage_of(exc, "launch")
            raise TritonRouteError(stage, f"{type(exc).__name__}: {str(exc).strip()[:400]}") from exc
        moved = back.view(rows, row_bytes)[torch.from_numpy(slots).to(device)].reshape(-1)
        if not (torch.equal(flat, want) and torch.equal(ring, want) and torch.equal(moved, want)):
            raise TritonRouteError("warm-up check", "the kernels moved wrong bytes on a 3-row table")
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[torch.from_numpy(slots)] = False
        if back.view(rows, row_bytes)[untouched.to(device)].any():
            raise TritonRouteError("warm-up check", "a scatter wrote outside the rows it was given")
