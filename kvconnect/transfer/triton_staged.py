"""The staged Triton route: rows to a host buffer (and back) through a ring of device slots.

Used where the device cannot address the host buffer (an Ascend NPU; a pageable buffer on CUDA)
or when ``TritonTuning(staged=True)`` asks for it. The host plan is the CUDA staged route's own
(csrc/staged_plan.h through ``kvconnect._cpu_kernels.staged_plan``): pieces growing from
``first_piece_bytes`` to ``max_piece_bytes``, each op cut at piece edges, each piece's copies as
large extents. Piece k goes through slot ``k % staging_slots`` of a device ring
(``staging_slots x max_piece_bytes``, never sized by the batch): a store runs ``ops_kernel``
(rows -> slot) on the current stream and the slot's copies (slot -> buffer) on a side stream,
the kernel of piece k + 1 overlapping the copies of piece k; a load is the reverse. Per-slot
events order the reuse of a slot, as in csrc/cuda_transfer.cu.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import TransferError
from ..layout.kv_layout import KVLayout
from . import triton_launch as launch
from .kernels import cpu_kernels
from .staging import device_resources
from .tables import TransferTables, plane_table
from .triton_launch import TritonTuning


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


def run_staged(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, to_buffer: bool, t: TritonTuning,
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
        execute(plan, ring, slot_bytes, buffer, to_buffer, t, device, mod)
    finally:
        if mod is not None:
            mod.current_stream().synchronize()  # the ring is free again only once its copies are done
        resources.release_ring(device, ring)


def execute(plan: dict, ring: torch.Tensor, slot_bytes: int, buffer: torch.Tensor, to_buffer: bool, t: TritonTuning,
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
    align = launch.launch_align(device, ops[:, 0], ring.data_ptr() + ring_off, ops[:, 2]) if len(ops) else 1
    (op_dev,) = launch.upload(device, op_table)
    kernels = launch.kernels()
    kernel, chunk = kernels.ops_kernel, kernels.CHUNK_BYTES
    programs = launch.num_programs(device, t)

    def gather_or_scatter(k: int) -> None:
        n = int(ends[k] - begins[k])
        if n:
            launch.launch("launch", kernel[(min(n, programs),)], op_dev[begins[k] :], n, ring.data_ptr(), TO_BUFFER=to_buffer,
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
