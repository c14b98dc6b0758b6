"""Triton kernels of the transfer contract (csrc/transfer_desc.h); host side: triton_route.py.

One source for every device Triton targets: CUDA (and ROCm, XPU) GPUs, Ascend NPUs through
triton-ascend, and the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, which the
tests use; it must be set before this module is imported). Every address is a plain int64
(plane bases from the plane table, the buffer's device address) cast with
``.to(tl.pointer_type(...))``, so one launch reaches planes in any number of allocations.

``segments_kernel`` moves the rows of the descriptor tables themselves: the host cuts each
segment into *items* (a run of whole rows, at most a few tens of KB; ``items`` [I, 4] int64:
segment, first_row, num_rows, unit_log2) and a persistent grid of programs takes items
``pid, pid + num_programs, ...``. Within an item the rows' bytes are one flat index space in
units of ``2**unit_log2`` bytes (the widest power of two, up to 16, dividing every address
and stride of the segment), so a 1-byte row and a 40 KB row run the same code: lane ``i`` of a
block of units finds its row (``i // row_units``), loads that row's slot, and copies one unit.
16-byte units are four uint32 per lane with their alignment stated to the compiler (one
128-bit load and store per lane in the CUDA and ROCm builds: tests/test_transfer_triton.py
compiles both for sm_90 and gfx942 and checks their assembly).

``ops_kernel`` moves the staged route's ops (csrc/staged_plan.h, through the CPU module):
``ops`` [O, 4] int64: paged address, offset in the ring slot, bytes, unit_log2; each op is
one contiguous run on both sides.

``TO_BUFFER`` (constexpr) picks the direction: paged -> flat (gather) or flat -> paged.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_BYTES = 4096  # bytes a program moves per step (lanes = BLOCK_BYTES / unit)


@triton.jit
def _copy(paged, flat, mask, T: tl.constexpr, TO_BUFFER: tl.constexpr):
    """Copy one unit of type T per lane between int64 byte addresses ``paged`` and ``flat``."""
    p = paged.to(tl.pointer_type(T))
    f = flat.to(tl.pointer_type(T))
    if TO_BUFFER:
        tl.store(f, tl.load(p, mask=mask), mask=mask)
    else:
        tl.store(p, tl.load(f, mask=mask), mask=mask)


@triton.jit
def _copy16(paged, flat, mask, TO_BUFFER: tl.constexpr):
    """16 bytes per lane as four uint32 side by side; the 16-byte alignment (checked on the host)
    is stated to the compiler, which then emits one 128-bit load and store per lane."""
    quad = tl.arange(0, 4)[None, :]
    p = tl.max_contiguous(tl.multiple_of(paged.to(tl.pointer_type(tl.uint32))[:, None] + quad, [16, 16]), [1, 4])
    f = tl.max_contiguous(tl.multiple_of(flat.to(tl.pointer_type(tl.uint32))[:, None] + quad, [16, 16]), [1, 4])
    m = mask[:, None]
    if TO_BUFFER:
        tl.store(f, tl.load(p, mask=m), mask=m)
    else:
        tl.store(p, tl.load(f, mask=m), mask=m)


@triton.jit
def _unit(paged, flat, mask, UNIT: tl.constexpr, TO_BUFFER: tl.constexpr):
    if UNIT == 16:
        _copy16(paged, flat, mask, TO_BUFFER)
    elif UNIT == 8:
        _copy(paged, flat, mask, tl.uint64, TO_BUFFER)
    elif UNIT == 4:
        _copy(paged, flat, mask, tl.uint32, TO_BUFFER)
    elif UNIT == 2:
        _copy(paged, flat, mask, tl.uint16, TO_BUFFER)
    else:
        _copy(paged, flat, mask, tl.uint8, TO_BUFFER)


@triton.jit
def _rows(slot_ptr, num_rows, flat0, base, block_stride, row_stride, row_bytes, rows_per_block,
          UNIT: tl.constexpr, TO_BUFFER: tl.constexpr, BLOCK: tl.constexpr):
    """Rows slot_ptr[0 .. num_rows) of one plane <-> the tight bytes at flat0, UNIT bytes per lane."""
    row_units = (row_bytes // UNIT).to(tl.int32)
    total = num_rows.to(tl.int32) * row_units
    rpb = rows_per_block.to(tl.int32)
    for start in range(0, total, BLOCK):
        local = start + tl.arange(0, BLOCK)
        mask = local < total
        row = local // row_units
        col = local - row * row_units
        slot = tl.load(slot_ptr + row, mask=mask, other=0).to(tl.int32)  # < 2**31: checked on the host
        block = slot // rpb
        in_block = slot - block * rpb
        paged = base + block.to(tl.int64) * block_stride + in_block.to(tl.int64) * row_stride + col.to(tl.int64) * UNIT
        flat = flat0 + local.to(tl.int64) * UNIT
        _unit(paged, flat, mask, UNIT, TO_BUFFER)


@triton.jit
def segments_kernel(planes_ptr, segments_ptr, slots_ptr, items_ptr, num_items, buffer_addr,
                    TO_BUFFER: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for item in range(pid, num_items, num_programs):
        it = items_ptr + item * 4
        seg = segments_ptr + tl.load(it) * 4
        first_row = tl.load(it + 1)
        num_rows = tl.load(it + 2)
        unit_log2 = tl.load(it + 3)
        pl = planes_ptr + tl.load(seg) * 6
        base = tl.load(pl)
        block_stride = tl.load(pl + 1)
        row_stride = tl.load(pl + 2)
        row_bytes = tl.load(pl + 3)
        rows_per_block = tl.load(pl + 4)
        slot_ptr = slots_ptr + tl.load(seg + 2) + first_row
        flat0 = buffer_addr + tl.load(seg + 3) + first_row * row_bytes
        if unit_log2 == 4:
            _rows(slot_ptr, num_rows, flat0, base, block_stride, row_stride, row_bytes, rows_per_block,
                  16, TO_BUFFER, BLOCK_BYTES // 16)
        elif unit_log2 == 3:
            _rows(slot_ptr, num_rows, flat0, base, block_stride, row_stride, row_bytes, rows_per_block,
                  8, TO_BUFFER, BLOCK_BYTES // 8)
        elif unit_log2 == 2:
            _rows(slot_ptr, num_rows, flat0, base, block_stride, row_stride, row_bytes, rows_per_block,
                  4, TO_BUFFER, BLOCK_BYTES // 4)
        elif unit_log2 == 1:
            _rows(slot_ptr, num_rows, flat0, base, block_stride, row_stride, row_bytes, rows_per_block,
                  2, TO_BUFFER, BLOCK_BYTES // 2)
        else:
            _rows(slot_ptr, num_rows, flat0, base, block_stride, row_stride, row_bytes, rows_per_block,
                  1, TO_BUFFER, BLOCK_BYTES)


@triton.jit
def _run(paged0, flat0, nbytes, UNIT: tl.constexpr, TO_BUFFER: tl.constexpr, BLOCK: tl.constexpr):
    """One contiguous run of nbytes (a multiple of UNIT) between paged0 and flat0."""
    total = (nbytes // UNIT).to(tl.int32)
    for start in range(0, total, BLOCK):
        local = start + tl.arange(0, BLOCK)
        offset = local.to(tl.int64) * UNIT
        _unit(paged0 + offset, flat0 + offset, local < total, UNIT, TO_BUFFER)


@triton.jit
def ops_kernel(ops_ptr, num_ops, ring_addr, TO_BUFFER: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for op in range(pid, num_ops, num_programs):
        o = ops_ptr + op * 4
        paged = tl.load(o)
        flat = ring_addr + tl.load(o + 1)
        nbytes = tl.load(o + 2)
        unit_log2 = tl.load(o + 3)
        if unit_log2 == 4:
            _run(paged, flat, nbytes, 16, TO_BUFFER, BLOCK_BYTES // 16)
        elif unit_log2 == 3:
            _run(paged, flat, nbytes, 8, TO_BUFFER, BLOCK_BYTES // 8)
        elif unit_log2 == 2:
            _run(paged, flat, nbytes, 4, TO_BUFFER, BLOCK_BYTES // 4)
        elif unit_log2 == 1:
            _run(paged, flat, nbytes, 2, TO_BUFFER, BLOCK_BYTES // 2)
        else:
            _run(paged, flat, nbytes, 1, TO_BUFFER, BLOCK_BYTES)
