"""The CUDA transfer path: one kernel launch per batch, paged device planes <-> pinned host buffer.

    run(direction, layout, tables, buffer, stream=None)               # returns when the bytes landed
    event = run_async(direction, layout, tables, buffer, stream=None)  # returns once queued

direction: ``"gather"`` (store: planes -> buffer) or ``"scatter"`` (load: buffer -> planes).
layout:    a KVLayout whose planes are ``cuda`` tensors (one device).
tables:    TransferTables (plane, num_rows, slot_offset, buffer_offset segments + slots).
buffer:    1-D contiguous uint8 tensor: pinned CPU memory (the engine's pool, read or written
           zero-copy through its mapped device address) or memory on the planes' device.
stream:    None = torch's current stream on the planes' device (so the copy is ordered after
           the kernels that wrote the KV), a ``torch.cuda.Stream``, or a raw ``cudaStream_t`` as int
           (``torch.cuda.current_stream().cuda_stream``).

``run_async`` returns a ``torch.cuda.Event`` recorded on ``stream`` after the copy; the caller
keeps ``buffer`` and the KV tensors alive and untouched until it completes. The descriptor
tables are copied before the call returns, so they may be reused at once.

Every index is validated on the host before the launch (TransferError, nothing moved). A
failing CUDA call raises ``kvconnect._cuda_kernels.CudaError`` (a RuntimeError) naming it.

Example::

    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    run("gather", layout, tables, buffer)                       # store
    ev = run_async("scatter", layout, tables, buffer, stream=s)  # load on a side stream
    torch.cuda.current_stream().wait_event(ev)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..errors import TransferError
from ..layout.kv_layout import KVLayout
from .kernels import cuda_kernels
from .tables import TransferTables, plane_table

StreamLike = Union[None, int, "torch.cuda.Stream"]

__all__ = ["KernelTuning", "available", "run", "run_async", "route_tuning", "DEFAULT_TUNING"]


@dataclass(frozen=True, kw_only=True)
class KernelTuning:
    """Launch shape of the copy kernel (defaults measured on an H100; see docs/gpu.md).

    threads_per_block: multiple of 32 up to 512; each warp copies whole ops.
    blocks_per_sm: persistent grid = SMs x this, capped by the number of ops.
    max_op_bytes: runs of adjacent rows longer than this are split (power of two >= 16).
    unroll: 16-byte loads in flight per lane (2 or 4).
    copy_op_table: copy the op table to device memory before the launch (else the kernel reads it
        zero-copy from mapped pinned memory, one op ahead of its copy).
    merge_rows: merge rows whose paged addresses are adjacent into one op (False = one op per row).
    use_dma: move each run with the copy engines (cudaMemcpyBatchAsync) instead of the kernel;
        for measurements, needs a non-default stream.
    staged: the staged route for a pinned buffer (csrc/staged_plan.h): per piece of the batch, the
        kernel gathers into a slot of a small device ring and the copy engines move the slot in
        large copies on a side stream (a load: the reverse), overlapped piece by piece. Costs
        staging_slots x max_piece_bytes of device memory per concurrent call (4 at most per
        device). A device buffer takes the direct kernel. Not yet measured on a GPU (docs/gpu.md).
    staging_slots: slots in the ring (>= 2).
    first_piece_bytes, max_piece_bytes: pieces double from the first size up to the largest
        (multiples of 16): a store's first piece is small, so the link starts early; a load's
        last one, so the scatter after the last copy is short.
    merge_gap_bytes: a load copies across gaps of up to this many unused buffer bytes in one copy.
    """

    threads_per_block: int = 512
    blocks_per_sm: int = 2
    max_op_bytes: int = 32768
    unroll: int = 4
    copy_op_table: bool = False
    merge_rows: bool = True
    use_dma: bool = False
    staged: bool = False
    staging_slots: int = 2
    first_piece_bytes: int = 1 << 20
    max_piece_bytes: int = 8 << 20
    merge_gap_bytes: int = 64 << 10


DEFAULT_TUNING = KernelTuning()
_ROUTES = {"kernel": None, "staged": KernelTuning(staged=True)}


def route_tuning(route: str) -> Optional[KernelTuning]:
    """The tuning of a configured CUDA route (``Config.cuda_transfer``); None is the default kernel."""
    if route not in _ROUTES:
        raise TransferError(f"unknown CUDA transfer route {route!r} (one of {', '.join(_ROUTES)})")
    return _ROUTES[route]


def available() -> bool:
    """True when the extension is built and a CUDA device is visible to it."""
    kernels = cuda_kernels()
    return kernels is not None and kernels.device_count() > 0


def _device_index(layout: KVLayout) -> int:
    device = layout.device
    if device.type != "cuda":
        raise TransferError(f"the CUDA kernel needs cuda planes, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _check_buffer(buffer: torch.Tensor, device_index: int) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TransferError(f"buffer must be a 1-D uint8 tensor, got {getattr(buffer, 'dtype', type(buffer))}")
    if not buffer.is_contiguous():
        raise TransferError("buffer must be contiguous")
    if buffer.device.type == "cuda" and buffer.device.index != device_index:
        raise TransferError(f"buffer is on {buffer.device}, the planes on cuda:{device_index}")
    if buffer.device.type not in ("cpu", "cuda"):
        raise TransferError(f"the CUDA kernel needs a pinned CPU or a cuda buffer, got {buffer.device}")


_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a few us cheaper than a Stream object


def _stream_handle(stream: StreamLike, device_index: int, need_object: bool) -> tuple[int, Optional["torch.cuda.Stream"]]:
    if stream is None:
        if not need_object and _raw_current_stream is not None:
            return _raw_current_stream(device_index), None
        s = torch.cuda.current_stream(device_index)
        return s.cuda_stream, s
    if isinstance(stream, int):
        return stream, torch.cuda.ExternalStream(stream, device=torch.device("cuda", device_index))
    if isinstance(stream, torch.cuda.Stream):
        return stream.cuda_stream, stream
    raise TransferError(f"stream must be None, an int cudaStream_t or a torch.cuda.Stream, got {type(stream).__name__}")


def _launch(direction: str, layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, stream: StreamLike,
            synchronize: bool, tuning: Optional[KernelTuning]) -> tuple[int, "torch.cuda.Stream"]:
    kernels = cuda_kernels()
    if kernels is None:
        raise TransferError("kvconnect._cuda_kernels is not built (install with nvcc on PATH or KVCONNECT_BUILD_CUDA=1)")
    if direction not in ("gather", "scatter"):
        raise TransferError(f"direction must be 'gather' or 'scatter', got {direction!r}")
    device_index = _device_index(layout)
    _check_buffer(buffer, device_index)
    handle, stream_obj = _stream_handle(stream, device_index, need_object=not synchronize)
    t = tuning or DEFAULT_TUNING
    fn = kernels.gather if direction == "gather" else kernels.scatter
    try:
        num_ops = fn(plane_table(layout), tables.segments, tables.slots, buffer.data_ptr(), buffer.numel(), device_index,
                     handle, synchronize, t.threads_per_block, t.blocks_per_sm, t.max_op_bytes, t.unroll,
                     t.copy_op_table, t.merge_rows, t.use_dma, t.staged, t.staging_slots, t.first_piece_bytes,
                     t.max_piece_bytes, t.merge_gap_bytes)
    except (IndexError, ValueError) as exc:  # validation: raised before anything was queued
        raise TransferError(str(exc)) from exc
    return num_ops, stream_obj


def run(direction: str, layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, stream: StreamLike = None,
        *, tuning: Optional[KernelTuning] = None) -> int:
    """Move the rows of ``tables`` and wait until they have landed; returns the number of copy ops."""
    num_ops, _ = _launch(direction, layout, tables, buffer, stream, True, tuning)
    return num_ops


def run_async(direction: str, layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, stream: StreamLike = None,
              *, tuning: Optional[KernelTuning] = None) -> "torch.cuda.Event":
    """Queue the copy on ``stream`` (GIL released while it is planned) and return an event recorded after it."""
    _, stream_obj = _launch(direction, layout, tables, buffer, stream, False, tuning)
    event = torch.cuda.Event()
    event.record(stream_obj)
    return event
