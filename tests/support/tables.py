"""Transfer descriptor tables for the transfer tests: random ones over a zoo layout, and malformed ones.

Shared by test_transfer_cpu, test_staged_plan and test_transfer_triton.
"""

from __future__ import annotations

import numpy as np

from kvconnect.transfer.tables import SegmentBuilder, TransferTables

# the zoo caches the CPU transfer tests run over
NAMES = ["llama-flash", "llama-hnd-flashinfer", "dsv3-mla-ascend", "dsv32-ascend", "dsv4-flash", "dsv4-flash-packed",
         "vllm-cpu", "state-hybrid"]


def random_tables(layout, rng, *, unique_slots: bool, num_segments: int = 24, max_rows: int = 40):
    """Random segments over random planes; runs of consecutive slots (which the CPU kernel
    merges into one copy, across block edges too) mixed with scattered ones."""
    builder = SegmentBuilder()
    offset = 0
    taken: dict = {}
    for _ in range(num_segments):
        p = int(rng.integers(len(layout.planes)))
        plane = layout.planes[p]
        n = int(rng.integers(1, min(max_rows, plane.num_slots) + 1))
        free = np.setdiff1d(np.arange(plane.num_slots), list(taken.get(p, ()))) if unique_slots else np.arange(plane.num_slots)
        if len(free) < n:
            continue
        if rng.random() < 0.5:  # a run of consecutive slots
            start = int(rng.integers(0, plane.num_slots - n + 1))
            slots = np.arange(start, start + n)
            if unique_slots and set(slots.tolist()) & taken.get(p, set()):
                continue
        else:
            slots = rng.choice(free, n, replace=False)
        taken.setdefault(p, set()).update(slots.tolist())
        slot_off = builder.add_slots(slots.astype(np.int64))
        offset += int(rng.integers(0, 3)) * 7  # gaps between segments stay untouched
        builder.add_segments(np.array([p]), np.array([n]), np.array([slot_off]), np.array([offset]))
        offset += n * plane.row_bytes
    return builder.build(), offset


def one_segment(plane=0, num_rows=4, slot_offset=0, buffer_offset=0, slots=(0, 1, 2, 3)):
    return TransferTables(
        np.array([[plane, num_rows, slot_offset, buffer_offset]], dtype=np.int64), np.array(slots, dtype=np.int64)
    )


def bad_tables(layout):
    num_slots = layout.planes[0].num_slots
    row_bytes = layout.planes[0].row_bytes
    good = one_segment()
    return {
        "slot past the plane": one_segment(slots=(0, 1, 2, num_slots)),
        "negative slot": one_segment(slots=(0, -1, 2, 3)),
        "plane index": one_segment(plane=len(layout.planes)),
        "negative plane": one_segment(plane=-1),
        "buffer overflow": one_segment(buffer_offset=64 * row_bytes - 3 * row_bytes),
        "negative buffer offset": one_segment(buffer_offset=-1),
        "slot table overrun": one_segment(slot_offset=1),
        "negative rows": one_segment(num_rows=-1),
        "segments dtype": TransferTables(good.segments.astype(np.int32), good.slots),
        "segments shape": TransferTables(good.segments[:, :3].copy(), good.slots),
        "slots dtype": TransferTables(good.segments, good.slots.astype(np.float64)),
        "slots 2-D": TransferTables(good.segments, good.slots.reshape(2, 2)),
    }
