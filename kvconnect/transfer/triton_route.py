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
  CUDA) or when ``TritonTuning(staged=True)`` asks for it. The host plan is the CUDA staged
  route's own (csrc/staged_plan.h through ``kvconnect._cpu_kernels.staged_plan``): pieces
  growing from ``first_piece_bytes`` to ``max_piece_bytes``, each op cut at piece edges, each
  piece's copies as large extents. Piece k goes through slot ``k % staging_slots`` of a device
  ring (``staging_slots x max_piece_bytes``, never sized by the batch): a store runs
  ``ops_kernel`` (rows -> slot) on the current stream and the slot's copies (slot -> buffer) on
  a side stream, the kernel of piece k + 1 overlapping the copies of piece k; a load is the
  reverse. Per-slot events order the reuse of a slot, as in csrc/cuda_transfer.cu.

Which device runs which: docs/gpu.md ("Triton route").
"""

from __future__ import annotations

import importlib.util
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import TransferError
from ..layout.kv_layout import KVLayout
from .kernels import cpu_kernels
from .staging import device_resources
from .tables import TransferTables, plane_table

__all__ = ["TritonTuning", "TritonRouteError", "available", "interpreted", "run", "warm_up", "DEFAULT_TUNING"]

_NPU_BACKENDS = ("ascend", "cann")  # triton-ascend's backend name (older, newer releases)
_INT32_MAX = (1 << 31) - 1
MAX_GRID = 65535  # triton-ascend's launcher refuses more programs (unless TRITON_ALL_BLOCKS_PARALLEL=1)


class TritonRouteError(RuntimeError):
    """A kernel of the route failed to compile, launch or move the right bytes (``stage`` says which)."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason


def _stage_of(exc: BaseException, default: str) -> str:
    """'compile' for Triton's and the backend's compiler errors (subprocess of a compiler stage included)."""
    import subprocess

    name = type(exc).__module__ + "." + type(exc).__name__
    if isinstance(exc, subprocess.CalledProcessError) or name.startswith("triton.compiler") or "Compil" in name:
        return "compile"
    return default


def _launch(stage: str, fn, *args, **kwargs) -> None:
    """Run a kernel launch; any failure but bad input becomes a TritonRouteError naming its stage."""
    try:
        fn(*args, **kwargs)
    except (TransferError, TritonRouteError):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the compiler or the driver raises
        raise TritonRouteError(_stage_of(exc, stage), f"{type(exc).__name__}: {str(exc).strip()[:400]}") from exc


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


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """True when Triton's interpreter runs the kernels (TRITON_INTERPRET=1 when they were loaded)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().segments_kernel, InterpretedFunction)


def available(device_type: str) -> bool:
    """Whether the Triton route can serve planes on this device type."""
    if not _triton_importable():
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
        return any(name in backends for name in _NPU_BACKENDS)
    return False


def npu_present() -> bool:
    """Whether torch_npu is loaded and sees at least one NPU."""
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except Exception:  # noqa: BLE001 - a half-installed torch_npu: no NPU for us
        return False


def _kernels():
    from . import triton_kernels  # imported on first use: TRITON_INTERPRET is read at import

    return triton_kernels


# ---------------------------------------------------------------------------------------
# device resources


_plane_tables: "weakref.WeakKeyDictionary[KVLayout, torch.Tensor]" = weakref.WeakKeyDictionary()  # each layout's plane table on its device


def _device_planes(layout: KVLayout) -> torch.Tensor:
    table = _plane_tables.get(layout)
    if table is None:
        table = torch.from_numpy(plane_table(layout).copy()).to(layout.device)
        _plane_tables[layout] = table
    return table


def _upload(device: torch.device, *arrays: np.ndarray) -> list:
    """int64 arrays -> device tensors, in one host-to-device copy."""
    flat = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    packed = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, np.int64)).to(device)
    out, at = [], 0
    for a, f in zip(arrays, flat):
        out.append(packed[at : at + f.size].view(a.shape))
        at += f.size
    return out


def _device_module(device: torch.device):
    return None if device.type == "cpu" else getattr(torch, device.type, None)


def _num_programs(device: torch.device, tuning: TritonTuning) -> int:
    return min(MAX_GRID, _wanted_programs(device, tuning))


def _wanted_programs(device: torch.device, tuning: TritonTuning) -> int:
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


def _unit_log2(align: np.ndarray) -> np.ndarray:
    """log2 of the widest unit in {1, 2, 4, 8, 16} bytes dividing every ``align`` value."""
    low = np.minimum(align & -align, 16)
    low[align == 0] = 16
    return np.log2(low).astype(np.int64)


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
    if device.type == "cpu" and not interpreted():
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
    mod = _device_module(layout.device)
    guard = mod.device(layout.device) if mod is not None and hasattr(mod, "device") else _NoGuard()
    with guard:
        if staged:
            _run_staged(layout, tables, buffer, to_buffer, t, mod)
        else:
            _run_direct(layout, tables, buffer, to_buffer, t)
        if mod is not None:
            mod.current_stream().synchronize()


class _NoGuard:
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
    return int(1 << int(_unit_log2(np.array([every], np.int64))[0]))


def _run_direct(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, to_buffer: bool, t: TritonTuning) -> None:
    device = layout.device
    items = work_items(layout, tables, t.item_bytes)
    table = plane_table(layout)[np.unique(tables.segments[:, 0])]
    align = launch_align(device, table[:, :4], buffer.data_ptr() + tables.segments[:, 3])
    segments, slots, items_dev = _upload(device, tables.segments, tables.slots, items)
    grid = (max(1, min(len(items), _num_programs(device, t))),)
    k = _kernels()
    _launch("launch", k.segments_kernel[grid], _device_planes(layout), segments, slots, items_dev, len(items),
            buffer.data_ptr(), TO_BUFFER=to_buffer, ALIGN=align, CHUNK=k.CHUNK_BYTES)


def staged_plan(layout: KVLayout, tables: TransferTables, buffer_bytes: int, to_buffer: bool, t: TritonTuning) -> dict:
    """The CUDA staged route's plan of these tables (csrc/staged_plan.h), as its executor gets it."""
    kernels = cpu_kernels()  # the staged planner lives there
    if kernels is None:
        raise TransferError("the staged Triton route plans with kvconnect._cpu_kernels, which is not built")
    try:
        return kernels.staged_plan(plane_table(layout), tables.segments, tables.slots, buffer_bytes, to_buffer,
                                        t.max_op_bytes, t.first_piece_bytes, t.max_piece_bytes, t.merge_gap_bytes)
    except (IndexError, ValueError) as exc:
        raise TransferError(str(exc)) from exc


def _run_staged(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, to_buffer: bool, t: TritonTuning,
                mod) -> None:
    device = layout.device
    plan = staged_plan(layout, tables, buffer.numel(), to_buffer, t)
    piece_bytes = plan["piece_bytes"]
    if not len(piece_bytes):
        return
    slots = t.staging_slots
    slot_bytes = int(-(-int(piece_bytes.max()) // 256) * 256)
    resources = device_resources()
    ring = resources.acquire_ring(device, slots * slot_bytes)
    try:
        _execute(plan, ring, slot_bytes, buffer, to_buffer, t, device, mod)
    finally:
        if mod is not None:
            mod.current_stream().synchronize()  # the ring is free again only once its copies are done
        resources.release_ring(device, ring)


def _execute(plan: dict, ring: torch.Tensor, slot_bytes: int, buffer: torch.Tensor, to_buffer: bool, t: TritonTuning,
             device: torch.device, mod) -> None:
    """Queue the plan piece by piece (see the module docstring); ``mod`` None: no streams (the interpreter)."""
    ops, ends = plan["ops"], plan["ops_at_done"]
    copies, copy_begin = plan["copies"], plan["copy_begin"]
    num_pieces = len(plan["piece_bytes"])
    K = t.staging_slots
    begins = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    piece_of_op = np.repeat(np.arange(num_pieces, dtype=np.int64), ends - begins)
    ring_off = ops[:, 1] + (piece_of_op % K) * slot_bytes
    op_table = np.stack([ops[:, 0], ring_off, ops[:, 2]], axis=1) if len(ops) else np.zeros((0, 3), np.int64)
    align = launch_align(device, ops[:, 0], ring.data_ptr() + ring_off, ops[:, 2]) if len(ops) else 1
    (op_dev,) = _upload(device, op_table)
    kernels = _kernels()
    kernel, chunk = kernels.ops_kernel, kernels.CHUNK_BYTES
    programs = _num_programs(device, t)

    def gather_or_scatter(k: int) -> None:
        n = int(ends[k] - begins[k])
        if n:
            _launch("launch", kernel[(min(n, programs),)], op_dev[begins[k] :], n, ring.data_ptr(), TO_BUFFER=to_buffer,
                    ALIGN=align, CHUNK=chunk)

    def copy(k: int) -> None:
        base = (k % K) * slot_bytes
        for staging, flat, nbytes in copies[copy_begin[k] : copy_begin[k + 1]].tolist():
            dev = ring[base + staging : base + staging + nbytes]
            host = buffer[flat : flat + nbytes]
            (host if to_buffer else dev).copy_(dev if to_buffer else host, non_blocking=True)

    if mod is None:  # one queue: the pieces run in order
        for k in range(num_pieces):
            if to_buffer:
                gather_or_scatter(k)
                copy(k)
            else:
                copy(k)
                gather_or_scatter(k)
        return
    compute = mod.current_stream()
    side = device_resources().copy_stream(device, mod)
    start = mod.Event()
    start.record(compute)
    side.wait_event(start)  # copies come after the work queued before this call
    filled = [mod.Event() for _ in range(K)]
    drained = [mod.Event() for _ in range(K)]
    for k in range(num_pieces):
        slot = k % K
        if to_buffer:
            if k >= K:
                compute.wait_event(drained[slot])
            gather_or_scatter(k)
            filled[slot].record(compute)
            side.wait_event(filled[slot])
            with mod.stream(side):
                copy(k)
            drained[slot].record(side)
        else:
            if k >= K:
                side.wait_event(drained[slot])
            with mod.stream(side):
                copy(k)
            filled[slot].record(side)
            compute.wait_event(filled[slot])
            gather_or_scatter(k)
            drained[slot].record(compute)
    done = mod.Event()
    done.record(side)
    compute.wait_event(done)


# ---------------------------------------------------------------------------------------
# warm-up


def warm_up(layout: KVLayout) -> None:
    """Compile and run every kernel variant the route launches for these planes, on a tiny private
    table (two 5-row blocks of a scratch plane on the planes' device; the engine's planes are never
    touched), both directions, direct and staged, and check the bytes. Raises TritonRouteError
    (stage: "warm-up compile", "warm-up launch" or "warm-up check")."""
    device = layout.device
    align = launch_align(device, plane_table(layout)[:, :4], np.array([256], np.int64))
    rows, row_bytes = 10, 5 * align
    mod = _device_module(device)
    guard = mod.device(device) if mod is not None and hasattr(mod, "device") else _NoGuard()
    k = _kernels()
    with guard:
        src = (torch.arange(rows * row_bytes, dtype=torch.int64) % 251 + 1).to(torch.uint8).to(device)
        planes = torch.tensor([[src.data_ptr(), 5 * row_bytes, row_bytes, row_bytes, 5, rows]], dtype=torch.int64,
                              device=device)
        slots = np.array([7, 2, 9], np.int64)
        want = src.view(rows, row_bytes)[torch.from_numpy(slots).to(device)].reshape(-1)
        segments, slots_dev, items = _upload(device, np.array([[0, 3, 0, 0]], np.int64), slots,
                                             np.array([[0, 0, 3]], np.int64))
        flat = torch.zeros(want.numel(), dtype=torch.uint8, device=device)
        back = torch.zeros_like(src)
        ring = torch.zeros(want.numel(), dtype=torch.uint8, device=device)
        (ops,) = _upload(device, np.array([[src.data_ptr() + s * row_bytes, i * row_bytes, row_bytes]
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
            stage = "warm-up " + _stage_of(exc, "launch")
            raise TritonRouteError(stage, f"{type(exc).__name__}: {str(exc).strip()[:400]}") from exc
        moved = back.view(rows, row_bytes)[torch.from_numpy(slots).to(device)].reshape(-1)
        if not (torch.equal(flat, want) and torch.equal(ring, want) and torch.equal(moved, want)):
            raise TritonRouteError("warm-up check", "the kernels moved wrong bytes on a 3-row table")
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[torch.from_numpy(slots)] = False
        if back.view(rows, row_bytes)[untouched.to(device)].any():
            raise TritonRouteError("warm-up check", "a scatter wrote outside the rows it was given")
