"""kvconnect.transfer on CPU: the compiled kernel and the torch implementation against a
reference that reads rows through the engine's own tensor indexing, plus validation.

Random descriptor tables drive ``gather`` (paged planes -> buffer) and ``scatter`` (buffer
-> paged planes) directly; every byte of the buffer and of the cache that no segment names
must be left exactly as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zoo
from kvconnect import TransferError
from kvconnect.transfer import dispatch
from kvconnect.transfer.tables import SegmentBuilder, TransferTables

NAMES = ["llama-flash", "llama-hnd-flashinfer", "dsv3-mla-ascend", "dsv32-ascend", "dsv4-flash", "dsv4-flash-packed",
         "vllm-cpu", "state-hybrid"]
BACKENDS = ["cpu", "torch"]


def _random_tables(layout, rng, *, unique_slots: bool, num_segments: int = 24, max_rows: int = 40):
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


def _reference_rows(case, tables):
    """(buffer_offset, RefPlane, blocks, rows, n) per segment."""
    planes = zoo.reference_planes(case)
    out = []
    for p, n, slot_off, buf_off in tables.segments.tolist():
        plane = planes[p]
        rpb = case.rows_per_block(plane.group)
        slots = torch.from_numpy(tables.slots[slot_off : slot_off + n])
        out.append((buf_off, plane, slots // rpb, slots % rpb, n))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_gather_matches_reference(name, rng):
    case = zoo.build(name, max_tokens=260)
    layout = case.layout()
    tables, used_bytes = _random_tables(layout, rng, unique_slots=False)
    expected = torch.full((used_bytes + 64,), 0xEE, dtype=torch.uint8)
    for off, plane, b, r, n in _reference_rows(case, tables):
        rows = plane.get(b, r).reshape(-1)
        expected[off : off + rows.numel()] = rows
    before = case.snapshot()
    for backend in BACKENDS:
        for threads in (1, 2, 4):
            buffer = torch.full_like(expected, 0xEE)
            dispatch.gather(layout, tables, buffer, backend=backend, num_threads=threads)
            assert torch.equal(buffer, expected), f"{backend} x{threads}"
    assert case.same_bytes(before)


@pytest.mark.parametrize("name", NAMES)
def test_scatter_matches_reference(name, rng):
    src = zoo.build(name, max_tokens=260)
    tables, used_bytes = _random_tables(src.layout(), rng, unique_slots=True)
    buffer = torch.from_numpy(rng.integers(0, 256, used_bytes + 64, dtype=np.uint8))
    buffer_before = buffer.clone()
    expected = src.clone()
    for off, plane, b, r, n in _reference_rows(expected, tables):
        shape = plane.get(b, r).shape
        plane.put(b, r, buffer[off : off + shape.numel()].view(shape))
    for backend in BACKENDS:
        for threads in (1, 3):
            dst = src.clone()
            dispatch.scatter(dst.layout(), tables, buffer, backend=backend, num_threads=threads)
            assert dst.first_difference(expected) is None, f"{backend} x{threads}"
    assert torch.equal(buffer, buffer_before)


def test_gather_scatter_round_trip_all_threads(rng):
    """Many pieces (the kernel's parallel path): gather then scatter into a clone restores it."""
    case = zoo.build("dsv3-mla", max_tokens=600)
    layout = case.layout()
    tables, used = _random_tables(layout, rng, unique_slots=True, num_segments=60, max_rows=200)
    assert tables.num_rows > 2000
    buffer = torch.zeros(used, dtype=torch.uint8)
    dispatch.gather(layout, tables, buffer, num_threads=4)
    zeroed = case.clone(fill=0)
    dispatch.scatter(zeroed.layout(), tables, buffer, num_threads=4)
    again = torch.zeros_like(buffer)
    dispatch.gather(zeroed.layout(), tables, again, backend="torch")
    assert torch.equal(again, buffer)
    assert tables.payload_bytes(layout) == int(sum(n * layout.planes[p].row_bytes for p, n, _, _ in tables.segments.tolist()))


def test_empty_tables_are_a_no_op():
    case = zoo.build("llama-flash", max_tokens=100)
    layout = case.layout()
    before = case.snapshot()
    empty = SegmentBuilder().build()
    for backend in BACKENDS:
        buf = torch.full((16,), 7, dtype=torch.uint8)
        dispatch.gather(layout, empty, buf, backend=backend)
        dispatch.scatter(layout, empty, buf, backend=backend)
        assert torch.equal(buf, torch.full((16,), 7, dtype=torch.uint8))
    assert case.same_bytes(before)


# ---------------------------------------------------------------------------------------
# validation: TransferError before any byte moves


def _one_segment(plane=0, num_rows=4, slot_offset=0, buffer_offset=0, slots=(0, 1, 2, 3)):
    return TransferTables(
        np.array([[plane, num_rows, slot_offset, buffer_offset]], dtype=np.int64), np.array(slots, dtype=np.int64)
    )


def _bad_tables(layout):
    num_slots = layout.planes[0].num_slots
    row_bytes = layout.planes[0].row_bytes
    good = _one_segment()
    return {
        "slot past the plane": _one_segment(slots=(0, 1, 2, num_slots)),
        "negative slot": _one_segment(slots=(0, -1, 2, 3)),
        "plane index": _one_segment(plane=len(layout.planes)),
        "negative plane": _one_segment(plane=-1),
        "buffer overflow": _one_segment(buffer_offset=64 * row_bytes - 3 * row_bytes),
        "negative buffer offset": _one_segment(buffer_offset=-1),
        "slot table overrun": _one_segment(slot_offset=1),
        "negative rows": _one_segment(num_rows=-1),
        "segments dtype": TransferTables(good.segments.astype(np.int32), good.slots),
        "segments shape": TransferTables(good.segments[:, :3].copy(), good.slots),
        "slots dtype": TransferTables(good.segments, good.slots.astype(np.float64)),
        "slots 2-D": TransferTables(good.segments, good.slots.reshape(2, 2)),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_bad_tables_raise_and_touch_nothing(backend, direction):
    case = zoo.build("dsv3-mla", max_tokens=200)
    layout = case.layout()
    row_bytes = layout.planes[0].row_bytes
    cache_before = case.snapshot()
    fn = getattr(dispatch, direction)
    for what, tables in _bad_tables(layout).items():
        buffer = torch.full((64 * row_bytes,), 0x3C, dtype=torch.uint8)
        with pytest.raises(TransferError):
            fn(layout, tables, buffer, backend=backend)
        assert torch.equal(buffer, torch.full_like(buffer, 0x3C)), what
        assert case.same_bytes(cache_before), what


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_buffers_raise(backend):
    case = zoo.build("dsv3-mla", max_tokens=200)
    layout = case.layout()
    tables = _one_segment()
    before = case.snapshot()
    n = 8 * layout.planes[0].row_bytes
    for buffer in (
        torch.zeros(n, dtype=torch.int8),
        torch.zeros(n // 4, dtype=torch.float32),
        torch.zeros(2, n, dtype=torch.uint8),
        torch.zeros(2 * n, dtype=torch.uint8)[::2],
        np.zeros(n, dtype=np.uint8),
    ):
        for fn in (dispatch.gather, dispatch.scatter):
            with pytest.raises(TransferError):
                fn(layout, tables, buffer, backend=backend)
    assert case.same_bytes(before)


def test_backend_selection():
    layout = zoo.build("llama-flash", max_tokens=100).layout()
    assert dispatch.backend_for(layout) == "cpu"
    assert dispatch.backend_for(layout, "torch") == "torch"
    for bad in ("cuda", "npu", "CPU"):
        with pytest.raises(TransferError):
            dispatch.backend_for(layout, bad)


def test_a_cuda_route_is_refused_by_name():
    from kvconnect.transfer import cuda as cuda_path

    assert cuda_path.route_tuning("kernel") is None and cuda_path.route_tuning("staged").staged
    with pytest.raises(TransferError, match="route"):
        cuda_path.route_tuning("dma")
