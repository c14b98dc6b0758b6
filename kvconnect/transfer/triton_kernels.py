"""Triton kernels of the transfer contract (csrc/transfer_desc.h); host side: triton_route.py.

One source for every device Triton targets: CUDA (and ROCm, XPU) GPUs, Ascend NPUs through
triton-ascend, and the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, which the
tests use; it must be set before this module is imported).

The shape is the one Ascend's compiler (triton-ascend's ``triton-adapter-opt`` and
``bishengir-compile``) lowers to DMA, and a GPU compiler to wide loads:

- every address is a *scalar*: an int64 byte address (a plane's base plus the row's offset, the
  buffer's address plus the segment's offset) cast once to a ``uint8`` pointer; the lanes add
  ``tl.arange`` offsets to it. Casting an int64 *tensor* to pointers crashes triton-adapter-opt
  (``--triton-to-unstructure``), and a per-lane gathered address is lowered to a scalar loop.
- rows go one at a time (a scalar loop: one slot load, one address), and each row's bytes are
  copied in contiguous blocks: ``CHUNK_BYTES`` blocks while a whole one fits, then the
  remainder as power-of-two blocks (2048, 1024, ..., 1 bytes; each taken when its bit is set in
  the remainder). Each block is one DMA on an NPU (global memory -> unified buffer -> global
  memory) and one vector load/store per lane on a GPU.
- no mask anywhere: every lane's address lies inside the row, op or buffer bytes it copies, by
  construction, so nothing outside the planes and the buffer is ever dereferenced (a masked-off
  lane of a gathered load still dereferences its address on an NPU).
- ``ALIGN`` (constexpr, 1..16): a power of two dividing every address and length of the launch
  (checked on the host). It is stated to the compiler (``tl.multiple_of``), so a GPU build moves
  16-byte-aligned rows with 128-bit loads and stores; blocks narrower than ALIGN cannot occur
  and are not compiled. DMA is byte-granular, so the NPU route launches ALIGN=1.

``segments_kernel`` moves the rows of the descriptor tables themselves: the host cuts each
segment into *items* (a run of whole rows, at most a few tens of KB; ``items`` [I, 3] int64:
segment, first_row, num_rows) and a persistent grid of programs takes items
``pid, pid + num_programs, ...``.

``ops_kernel`` moves the staged route's ops (csrc/staged_plan.h, through the CPU module):
``ops`` [O, 3] int64: paged address, offset in the ring slot, bytes; each op is one contiguous
run on both sides.

``TO_BUFFER`` (constexpr) picks the direction: paged -> flat (gather) or flat -> paged.
"""

from __future__ import annotations

import triton
import triton.language as tl

_I64 = "*i64"
SIGNATURES = {  # each kernel's argument types, for an ahead-of-time compile (tests/ascend_compile)
    "segments_kernel": {"planes_ptr": _I64, "segments_ptr": _I64, "slots_ptr": _I64, "items_ptr": _I64, "num_items": "i32",
                        "buffer_addr": "i64", "TO_BUFFER": "constexpr", "ALIGN": "constexpr", "CHUNK": "constexpr"},
    "ops_kernel": {"ops_ptr": _I64, "num_ops": "i32", "ring_addr": "i64", "TO_BUFFER": "constexpr", "ALIGN": "constexpr",
                   "CHUNK": "constexpr"},
}
NPU_ALIGNS = (1,)  # the ALIGN values the NPU route launches (triton_route.launch_align)

CHUNK_BYTES = 4096  # bytes of the widest block: one DMA on an NPU, >= 16 bytes a lane in a GPU program of 256 threads


@triton.jit
def _block(paged, flat, at, N: tl.constexpr, ALIGN: tl.constexpr, TO_BUFFER: tl.constexpr):
    """Copy the N contiguous bytes at byte offset ``at`` (a multiple of ALIGN) of ``paged`` and ``flat``."""
    offs = at + tl.arange(0, N)
    p = paged + offs
    f = flat + offs
    if ALIGN > 1:
        p = tl.max_contiguous(tl.multiple_of(p, ALIGN), N)
        f = tl.max_contiguous(tl.multiple_of(f, ALIGN), N)
    if TO_BUFFER:
        tl.store(f, tl.load(p))
    else:
        tl.store(p, tl.load(f))


@triton.jit
def _tail(paged, flat, at, rem, N: tl.constexpr, ALIGN: tl.constexpr, TO_BUFFER: tl.constexpr):
    """The N-byte block of the remainder when its bit is set in ``rem``; returns the next offset."""
    if N >= ALIGN:  # a remainder is a multiple of ALIGN: narrower blocks never run
        if (rem & N) != 0:
            _block(paged, flat, at, N, ALIGN, TO_BUFFER)
            at += N
    return at


@triton.jit
def _span(paged_addr, flat_addr, nbytes, ALIGN: tl.constexpr, TO_BUFFER: tl.constexpr, CHUNK: tl.constexpr):
    """Copy ``nbytes`` between the int64 byte addresses ``paged_addr`` and ``flat_addr``."""
    tl.static_assert(CHUNK == 4096, "the tail blocks below cover a remainder of CHUNK_BYTES = 4096")
    paged = paged_addr.to(tl.pointer_type(tl.uint8))
    flat = flat_addr.to(tl.pointer_type(tl.uint8))
    n = nbytes.to(tl.int32)  # < 2**31: checked on the host
    whole = n - n % CHUNK
    for at in range(0, whole, CHUNK):
        _block(paged, flat, at, CHUNK, ALIGN, TO_BUFFER)
    rem = n - whole
    at = whole
    # CHUNK is 4096 (CHUNK_BYTES; the host passes nothing else): the remainder is below 4096
    at = _tail(paged, flat, at, rem, 2048, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 1024, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 512, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 256, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 128, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 64, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 32, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 16, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 8, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 4, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 2, ALIGN, TO_BUFFER)
    at = _tail(paged, flat, at, rem, 1, ALIGN, TO_BUFFER)


@triton.jit
def segments_kernel(planes_ptr, segments_ptr, slots_ptr, items_ptr, num_items, buffer_addr,
                    TO_BUFFER: tl.constexpr, ALIGN: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for item in range(pid, num_items, num_programs):
        it = items_ptr + item * 3
        seg = segments_ptr + tl.load(it) * 4
        first_row = tl.load(it + 1)
        num_rows = tl.load(it + 2)
        pl = planes_ptr + tl.load(seg) * 6
        base = tl.load(pl)
        block_stride = tl.load(pl + 1)
        row_stride = tl.load(pl + 2)
        row_bytes = tl.load(pl + 3)
        rows_per_block = tl.load(pl + 4)
        slot_ptr = slots_ptr + tl.load(seg + 2) + first_row
        flat0 = buffer_addr + tl.load(seg + 3) + first_row * row_bytes
        for r in range(0, num_rows):
            slot = tl.load(slot_ptr + r)  # inside [0, num_slots): checked on the host
            block = slot // rows_per_block
            paged = base + block * block_stride + (slot - block * rows_per_block) * row_stride
            _span(paged, flat0 + r * row_bytes, row_bytes, ALIGN, TO_BUFFER, CHUNK)


@triton.jit
def ops_kernel(ops_ptr, num_ops, ring_addr, TO_BUFFER: tl.constexpr, ALIGN: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for op in range(pid, num_ops, num_programs):
        o = ops_ptr + op * 3
        _span(tl.load(o), ring_addr + tl.load(o + 1), tl.load(o + 2), ALIGN, TO_BUFFER, CHUNK)
