"""Control kernels of the compile check: what a good and a bad lowering look like."""

import triton
import triton.language as tl


@triton.jit
def vector_add(x, y, o, n, B: tl.constexpr):
    """Masked contiguous blocks: clipped DMA copies, no scalar access."""
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    tl.store(o + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)


@triton.jit
def lane_gather(src, idx, dst, B: tl.constexpr):
    """A per-lane gathered address: lowered to a scalar loop (one global load per lane)."""
    lanes = tl.arange(0, B)
    tl.store(dst + lanes, tl.load(src + tl.load(idx + lanes)))


@triton.jit
def tensor_cast(addr_ptr, dst, B: tl.constexpr):
    """An int64 tensor cast to pointers (the old kernels' construct): triton-adapter-opt crashes."""
    lanes = tl.arange(0, B)
    addrs = tl.load(addr_ptr + lanes)
    tl.store(dst + lanes, tl.load(addrs.to(tl.pointer_type(tl.uint8))))
