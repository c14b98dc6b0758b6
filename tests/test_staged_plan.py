"""The CUDA staged route's host planner (csrc/staged_plan.h), on every machine.

The staged route moves a batch through a ring of device slots: a kernel gathers piece k's
rows into slot k % K, the copy engines move the slot's extents to the pinned buffer (a load
runs the other way). The planner decides every byte of that, so it is tested here without a
GPU: ``execute`` below runs a plan with memmove in the CUDA executor's order (per piece:
kernel ops then copies for a store, copies then ops for a load, through a slot refilled
with garbage first), and the result must equal the compiled CPU kernel byte for byte, with
every byte no op names left untouched. Invariants of the plan are checked on random tables.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from support import zoo
from kvconnect.transfer import dispatch
from kvconnect.chunks.keys import Chunk
from kvconnect.restore.plan import BlockTables, max_chunk_payload_bytes, plan_store, store_segments
from kvconnect.layout.spec import ChunkKey
from kvconnect.transfer.tables import SegmentBuilder, TransferTables, plane_table
from support.tables import NAMES, random_tables

_cpu_kernels = pytest.importorskip("kvconnect._cpu_kernels")

SHAPES = [  # (first_piece_bytes, max_piece_bytes, merge_gap_bytes, max_op_bytes)
    (16, 16, 0, 16),
    (64, 256, 7, 64),
    (1024, 4096, 64, 32768),
    (1 << 20, 8 << 20, 64 << 10, 32768),  # the CUDA route's defaults
]
NUM_SLOTS = 2


PLAN_ARRAYS = ("piece_bytes", "ops", "op_begin", "ops_at_done", "copies", "copy_begin")


def staged_plan(layout, tables: TransferTables, buffer_bytes: int, to_buffer: bool, shape) -> dict:
    """The plan the executor gets; when it was streamed, it must equal the whole plan exactly
    and every piece must have been reported complete as soon as its last op was out."""
    first, largest, gap, max_op = shape
    args = (plane_table(layout), tables.segments, tables.slots, buffer_bytes, to_buffer, max_op, first, largest, gap)
    plan = _cpu_kernels.staged_plan(*args)
    assert np.array_equal(plan["ops_at_done"], plan["op_begin"][1:])
    if plan["streamed"]:
        whole = _cpu_kernels.staged_plan(*args, allow_streaming=False)
        assert not whole["streamed"]
        for name in PLAN_ARRAYS:
            assert np.array_equal(plan[name], whole[name]), name
    return plan


def execute(plan: dict, buffer: torch.Tensor, to_buffer: bool, largest: int) -> None:
    """Run a plan on the host in the CUDA executor's order, through a ring of garbage-filled slots."""
    ring = torch.empty(NUM_SLOTS * largest, dtype=torch.uint8)
    base = buffer.data_ptr()
    ops, copies = plan["ops"], plan["copies"]
    for k, size in enumerate(plan["piece_bytes"].tolist()):
        slot = ring[(k % NUM_SLOTS) * largest :][:largest]
        slot.fill_(0xA5)
        addr = slot.data_ptr()
        piece_ops = ops[plan["op_begin"][k] : plan["op_begin"][k + 1]].tolist()
        piece_copies = copies[plan["copy_begin"][k] : plan["copy_begin"][k + 1]].tolist()
        for paged, staging, n in piece_ops:
            assert 0 <= staging and staging + n <= size
        for staging, flat, n in piece_copies:
            assert 0 <= staging and staging + n <= size and 0 <= flat and flat + n <= buffer.numel()
        if to_buffer:
            for paged, staging, n in piece_ops:
                ctypes.memmove(addr + staging, paged, n)
            for staging, flat, n in piece_copies:
                ctypes.memmove(base + flat, addr + staging, n)
        else:
            for staging, flat, n in piece_copies:
                ctypes.memmove(addr + staging, base + flat, n)
            for paged, staging, n in piece_ops:
                ctypes.memmove(paged, addr + staging, n)


def check_gather(case, tables: TransferTables, nbytes: int, shape) -> dict:
    layout = case.layout()
    want = torch.full((nbytes + 32,), 0xEE, dtype=torch.uint8)
    dispatch.gather(layout, tables, want, backend="cpu")
    got = torch.full_like(want, 0xEE)
    plan = staged_plan(layout, tables, got.numel(), True, shape)
    before = case.snapshot()
    execute(plan, got, True, shape[1])
    assert torch.equal(got, want), f"{int((got != want).sum())} buffer bytes differ from the CPU kernel"
    assert case.same_bytes(before)
    return plan


def check_scatter(case, tables: TransferTables, buffer: torch.Tensor, shape) -> dict:
    want = case.clone()
    dispatch.scatter(want.layout(), tables, buffer, backend="cpu")
    got = case.clone()
    plan = staged_plan(got.layout(), tables, buffer.numel(), False, shape)
    buffer_before = buffer.clone()
    execute(plan, buffer, False, shape[1])
    assert got.first_difference(want) is None
    assert torch.equal(buffer, buffer_before)
    return plan


# ---------------------------------------------------------------------------------------
# byte-exact against the compiled CPU kernel


@pytest.mark.parametrize("shape", SHAPES, ids=["16", "small", "mid", "default"])
@pytest.mark.parametrize("name", NAMES)
def test_random_tables_match_the_cpu_kernel(name, shape, rng):
    case = zoo.build(name, max_tokens=260)
    tables, used = random_tables(case.layout(), rng, unique_slots=True)
    check_gather(case, tables, used, shape)
    buffer = torch.from_numpy(rng.integers(0, 256, used + 32, dtype=np.uint8))
    check_scatter(case, tables, buffer, shape)


def planned_tables(case, num_tokens: int, chunk: int, rng, pad_bytes: int) -> tuple[TransferTables, int]:
    """The engine planner's store tables: one slot per chunk, ``pad_bytes`` after each payload
    (standing for the chunk header and the rest of a pool slot, which a store must not write)."""
    layout = case.layout()
    chunks = [Chunk(i, i * chunk, (i + 1) * chunk, ChunkKey(bytes(16))) for i in range(num_tokens // chunk)]
    keep = zoo.window_keep(case, [(c.start, c.end) for c in chunks])  # windowed groups hold only their windows
    plans = plan_store(layout, chunks, BlockTables.of(layout, zoo.random_tables(case, num_tokens, rng, keep=keep)))
    slot_bytes = max_chunk_payload_bytes(layout, chunk) + pad_bytes
    tables = store_segments(layout, plans, [i * slot_bytes + pad_bytes for i in range(len(plans))]).build()
    return tables, slot_bytes * len(plans) + pad_bytes


@pytest.mark.parametrize("shape", SHAPES[1:], ids=["small", "mid", "default"])
@pytest.mark.parametrize("name", ["llama-flash", "dsv3-mla", "dsv32", "dsv4-flash", "dsv4-flash-packed", "gemma3-swa"])
def test_planned_chunks_match_the_cpu_kernel(name, shape, rng):
    case = zoo.build(name, max_tokens=600)
    chunk = zoo.ZOO[name][1][0]
    tables, nbytes = planned_tables(case, 512, chunk, rng, pad_bytes=88)
    plan = check_gather(case, tables, nbytes, shape)
    assert len(plan["piece_bytes"]) >= 1
    buffer = torch.from_numpy(rng.integers(0, 256, nbytes + 32, dtype=np.uint8))
    check_scatter(case, tables, buffer, shape)


def test_one_contiguous_extent_becomes_one_copy_per_piece(rng):
    """A chunk payload is one extent: its copies are exactly the pieces, growing for a store,
    shrinking for a load; the kernel keeps 16-byte alignment (staging = buffer offset mod 16)."""
    case = zoo.build("dsv3-mla", max_tokens=600)
    tables, nbytes = planned_tables(case, 512, 256, rng, pad_bytes=0)
    shape = (1024, 8192, 0, 32768)
    store = staged_plan(case.layout(), tables, nbytes, True, shape)
    sizes = store["piece_bytes"].tolist()
    assert sizes[:4] == [1024, 2048, 4096, 8192] and max(sizes) == 8192 and sum(sizes) == -(-tables.payload_bytes(case.layout()) // 16) * 16
    assert len(store["copies"]) == len(sizes)  # one extent, cut only at piece edges
    load = staged_plan(case.layout(), tables, nbytes, False, shape)
    assert load["piece_bytes"].tolist() == sizes[::-1]
    for plan in (store, load):
        staging, flat, n = plan["copies"].T
        assert (staging % 16 == flat % 16).all()
        assert n.sum() == tables.payload_bytes(case.layout())


def test_engine_tables_stream_and_others_take_the_whole_plan(rng):
    """Tables in buffer order (the engine's) stream; segments out of order or overlapping do not,
    and still move the same bytes."""
    case = zoo.build("dsv4-flash", max_tokens=600)
    tables, nbytes = planned_tables(case, 512, 256, rng, pad_bytes=88)
    assert staged_plan(case.layout(), tables, nbytes, True, SHAPES[2])["streamed"]
    shuffled = TransferTables(tables.segments[rng.permutation(len(tables.segments))].copy(), tables.slots)
    assert not staged_plan(case.layout(), shuffled, nbytes, True, SHAPES[2])["streamed"]
    check_gather(case, shuffled, nbytes, SHAPES[1])
    buffer = torch.from_numpy(rng.integers(0, 256, nbytes + 32, dtype=np.uint8))
    check_scatter(case, shuffled, buffer, SHAPES[1])


def test_empty_tables_plan_nothing():
    case = zoo.build("llama-flash", max_tokens=100)
    plan = staged_plan(case.layout(), SegmentBuilder().build(), 64, True, SHAPES[2])
    assert len(plan["piece_bytes"]) == 0 and plan["op_begin"].tolist() == [0] and plan["copy_begin"].tolist() == [0]


def test_bad_input_is_refused():
    case = zoo.build("llama-flash", max_tokens=100)
    layout = case.layout()
    tables, used = random_tables(layout, np.random.default_rng(0), unique_slots=True)
    for shape in [(8, 64, 0, 64), (64, 32, 0, 64), (24, 64, 0, 64), (64, 64, -1, 64)]:
        with pytest.raises(ValueError, match="staging|merge_gap"):
            staged_plan(layout, tables, used, True, shape)
    bad = TransferTables(tables.segments.copy(), tables.slots.copy())
    bad.slots[0] = layout.planes[int(bad.segments[0, 0])].num_slots
    with pytest.raises(IndexError, match="slot"):
        staged_plan(layout, bad, used, True, SHAPES[1])
    with pytest.raises(IndexError, match="buffer"):
        staged_plan(layout, tables, used - 1, True, SHAPES[1])


# ---------------------------------------------------------------------------------------
# invariants on random tables


def _byte_set(ranges) -> np.ndarray:
    return np.unique(np.concatenate([np.arange(a, a + n) for a, n in ranges])) if len(ranges) else np.zeros(0, np.int64)


@st.composite
def random_transfer(draw):
    row_bytes = draw(st.integers(1, 96))
    rows_per_block = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(1, 12))
    block_stride = rows_per_block * row_bytes + draw(st.integers(0, 40))
    num_slots = rows_per_block * num_blocks
    segments, slots, offset = [], [], 0
    for _ in range(draw(st.integers(1, 6))):
        run = draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=num_slots))
        offset += draw(st.integers(0, 40))  # gaps the store must leave alone
        segments.append([0, len(run), len(slots), offset])
        slots += run
        offset += len(run) * row_bytes
    first = 16 * draw(st.integers(1, 8))
    shape = (first, first * 2 ** draw(st.integers(0, 3)), draw(st.sampled_from([0, 5, 48])), 16 * draw(st.integers(1, 4)))
    return (row_bytes, rows_per_block, block_stride, num_slots), segments, slots, offset, shape


@given(random_transfer(), st.booleans())
def test_plan_invariants(spec, to_buffer):
    (row_bytes, rows_per_block, block_stride, num_slots), segments, slots, nbytes, shape = spec
    pages = torch.zeros(block_stride * (num_slots // rows_per_block), dtype=torch.uint8)
    planes = np.array([[pages.data_ptr(), block_stride, row_bytes, row_bytes, rows_per_block, num_slots]], np.int64)
    first, largest, gap, max_op = shape
    plan = _cpu_kernels.staged_plan(planes, np.array(segments, np.int64), np.array(slots, np.int64), nbytes, to_buffer,
                                    max_op, first, largest, gap)
    sizes = plan["piece_bytes"]
    assert (sizes > 0).all() and (sizes <= largest).all() and sizes.sum() % 16 == 0
    grown = sizes if to_buffer else sizes[::-1]
    assert all(grown[k] == min(largest, first << k) for k in range(len(grown) - 1))  # only the last is cut short
    wanted = _byte_set([(off, n * row_bytes) for _, n, _, off in segments])
    copied = _byte_set([(flat, n) for _, flat, n in plan["copies"].tolist()])
    total_copied = int(plan["copies"][:, 2].sum()) if len(plan["copies"]) else 0
    assert len(copied) == total_copied  # no buffer byte is copied twice
    if to_buffer:
        assert np.array_equal(copied, wanted)  # a store writes exactly the named bytes
    else:
        assert np.isin(wanted, copied).all()  # a load reads them, plus gaps under merge_gap
        extra = np.setdiff1d(copied, wanted)
        assert len(extra) <= gap * len(segments)
    assert int(plan["ops"][:, 2].sum()) == len(slots) * row_bytes  # every row once
    staging, flat, _ = plan["copies"].T
    assert (staging % 16 == flat % 16).all()
    if to_buffer:  # and the bytes: the plan run on the host equals the CPU kernel
        pages.copy_(torch.randint(0, 256, pages.shape, dtype=torch.uint8))
        want = torch.full((nbytes + 16,), 0xEE, dtype=torch.uint8)
        got = want.clone()
        _cpu_kernels.gather(planes, np.array(segments, np.int64), np.array(slots, np.int64), want.data_ptr(), nbytes, 1)
        execute(plan, got, True, largest)
        assert torch.equal(got, want)


@given(st.data())
def test_a_load_whose_ranges_overlap_matches_the_cpu_kernel(data):
    """Segments reading overlapping buffer bytes (into distinct rows): the ops' parts do not come
    in piece order, and every row must still get its own bytes."""
    row_bytes, rows_per_block, num_blocks = data.draw(st.integers(1, 64)), 4, 6
    num_slots = rows_per_block * num_blocks
    order = data.draw(st.permutations(range(num_slots)))
    cuts = sorted(data.draw(st.lists(st.integers(1, num_slots - 1), max_size=5, unique=True)))
    runs = [order[a:b] for a, b in zip([0] + cuts, cuts + [num_slots])]
    segments, slots, offset = [], [], 0
    for run in runs:
        offset = max(0, offset + data.draw(st.integers(-3 * row_bytes, 2 * row_bytes)))  # may step back: overlap
        segments.append([0, len(run), len(slots), offset])
        slots += run
    nbytes = max(off + n * row_bytes for _, n, _, off in segments)
    first = 16 * data.draw(st.integers(1, 4))
    pages = torch.zeros(rows_per_block * row_bytes * num_blocks, dtype=torch.uint8)
    planes = np.array([[pages.data_ptr(), rows_per_block * row_bytes, row_bytes, row_bytes, rows_per_block, num_slots]], np.int64)
    seg, sl = np.array(segments, np.int64), np.array(slots, np.int64)
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    _cpu_kernels.scatter(planes, seg, sl, buffer.data_ptr(), nbytes, 1)
    want = pages.clone()
    pages.zero_()
    plan = _cpu_kernels.staged_plan(planes, seg, sl, nbytes, False, 16, first, 2 * first, data.draw(st.sampled_from([0, 9])))
    execute(plan, buffer, False, 2 * first)
    assert torch.equal(pages, want)


def test_a_shared_slot_run_is_checked_against_each_plane():
    """Segments of several planes share one slot run (the validator checks the run once):
    a slot inside the first plane but past the second is still refused."""
    big, small = torch.zeros(100 * 64, dtype=torch.uint8), torch.zeros(10 * 64, dtype=torch.uint8)
    planes = np.array([[big.data_ptr(), 64, 64, 64, 1, 100], [small.data_ptr(), 64, 64, 64, 1, 10]], np.int64)
    slots = np.array([3, 50], np.int64)
    segments = np.array([[0, 2, 0, 0], [1, 2, 0, 128]], np.int64)
    with pytest.raises(IndexError, match="slot 50"):
        _cpu_kernels.staged_plan(planes, segments, slots, 256, True, 64, 64, 64, 0)
    ok = _cpu_kernels.staged_plan(planes, segments[:1], slots, 256, True, 64, 64, 64, 0)
    assert int(ok["ops"][:, 2].sum()) == 128
