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

from support import zoo
from kvconnect import TransferError
from kvconnect.transfer import dispatch
from kvconnect.transfer.tables import SegmentBuilder
from support.tables import NAMES, bad_tables, one_segment, random_tables

BACKENDS = ["cpu", "torch"]


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
    tables, used_bytes = random_tables(layout, rng, unique_slots=False)
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
    tables, used_bytes = random_tables(src.layout(), rng, unique_slots=True)
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
    tables, used = random_tables(layout, rng, unique_slots=True, num_segments=60, max_rows=200)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_bad_tables_raise_and_touch_nothing(backend, direction):
    case = zoo.build("dsv3-mla", max_tokens=200)
    layout = case.layout()
    row_bytes = layout.planes[0].row_bytes
    cache_before = case.snapshot()
    fn = getattr(dispatch, direction)
    for what, tables in bad_tables(layout).items():
        buffer = torch.full((64 * row_bytes,), 0x3C, dtype=torch.uint8)
        with pytest.raises(TransferError):
            fn(layout, tables, buffer, backend=backend)
        assert torch.equal(buffer, torch.full_like(buffer, 0x3C)), what
        assert case.same_bytes(cache_before), what


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_buffers_raise(backend):
    case = zoo.build("dsv3-mla", max_tokens=200)
    layout = case.layout()
    tables = one_segment()
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
