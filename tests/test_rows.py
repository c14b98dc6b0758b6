"""Row arithmetic (kvconnect.layout.rows) and slot mapping (kvconnect.restore.plan.BlockTables), property-tested
against brute-force references that enumerate tokens and rows one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from support import zoo
from kvconnect import BlockTableError, DCPSpec, GroupKind, GroupSpec, KVLayout
from kvconnect.restore.plan import BlockTables, max_group_rows
from kvconnect.layout.rows import GroupGeometry, chunk_bounds, intersect


@st.composite
def geometries(draw, *, dcp=True):
    """A group spec (attention, compressed, windowed or state), page or not, with a DCP shard."""
    kind = draw(st.sampled_from(["full", "compressed", "window", "state", "page"]))
    cr = draw(st.sampled_from([2, 4, 128])) if kind == "compressed" else 1
    block = cr * draw(st.sampled_from([1, 2, 4, 16])) if kind == "compressed" else draw(st.sampled_from([1, 4, 8, 16, 64]))
    window = draw(st.integers(1, 300)) if kind == "window" else None
    restore = draw(st.one_of(st.none(), st.integers(1, window))) if window else None
    spec = GroupSpec(
        block_size=block, compress_ratio=cr, sliding_window=window, restore_window=restore,
        kind=GroupKind.STATE if kind == "state" else GroupKind.ATTENTION,
    )
    size = draw(st.sampled_from([1, 1, 2, 3, 4])) if dcp and kind not in ("page", "state") else 1
    shard = DCPSpec(rank=draw(st.integers(0, size - 1)), size=size, interleave_tokens=draw(st.sampled_from([1, 2, 8, 64]))) if size > 1 else DCPSpec()
    return spec, kind == "page", shard


def _ref_case(spec, is_page, shard):
    """A zoo case shell carrying only the geometry, for the reference functions."""
    return zoo.ZooCase(
        name="ref", groups=[spec], layer_groups={}, hints=None, layers={}, backings=[], num_blocks=[1],
        page_groups=frozenset({0}) if is_page else frozenset(), dcp=shard,
    )


@given(geometries(), st.integers(1, 400), st.integers(0, 1500))
def test_chunk_rows_partition_all_rows(geo_args, chunk, num_tokens):
    spec, is_page, shard = geo_args
    geo = GroupGeometry.of(spec, is_page=is_page, dcp=shard)
    ref = _ref_case(*geo_args)
    bounds = chunk_bounds(num_tokens, chunk, True)
    assert bounds == zoo.chunk_bounds_ref(num_tokens, chunk, True)
    rows = [geo.chunk_rows(s, e) for s, e in bounds]
    covered = [r for lo, hi in rows for r in range(lo, hi)]
    assert covered == list(range(zoo.rows_of(ref, 0, 0, num_tokens)[1]))  # a partition, in order


@given(geometries(), st.integers(0, 1000), st.integers(1, 300), st.integers(0, 700))
def test_stored_covers_needed(geo_args, start, length, beyond):
    """For every later boundary P >= e, what chunk [s, e) stores holds all it must give P."""
    spec, is_page, shard = geo_args
    geo = GroupGeometry.of(spec, is_page=is_page, dcp=shard)
    ref = _ref_case(*geo_args)
    s, e = start, start + length
    p = e + beyond
    stored, chunk_rows = geo.stored_rows(s, e), geo.chunk_rows(s, e)
    assert stored == zoo.stored_rows(ref, 0, s, e)
    assert geo.needed_rows(p) == zoo.needed_rows(ref, 0, p)
    assert chunk_rows == zoo.rows_of(ref, 0, s, e)
    assert chunk_rows[0] <= stored[0] <= stored[1] == chunk_rows[1]  # a suffix of the chunk's rows
    lo, hi = intersect(geo.needed_rows(p), chunk_rows)
    assert hi <= lo or stored[0] <= lo and hi <= stored[1]


@given(geometries(), st.integers(0, 2000))
def test_needed_rows_and_page_edges(geo_args, boundary):
    spec, is_page, shard = geo_args
    geo = GroupGeometry.of(spec, is_page=is_page, dcp=shard)
    local = zoo.local_tokens(shard, boundary)
    lo, hi = geo.needed_rows(boundary)
    assert hi == local // zoo.ZooCase.tokens_per_row(_ref_case(*geo_args), 0)
    if geo.window_tokens is None:
        assert lo == 0
    page_like = is_page or spec.kind is GroupKind.STATE
    assert geo.boundary_ok(boundary) == (not page_like or boundary % spec.block_size == 0)


@given(st.integers(0, 3000), st.integers(1, 600), st.booleans())
def test_chunk_bounds(num_tokens, chunk, partial):
    bounds = chunk_bounds(num_tokens, chunk, partial)
    assert bounds == zoo.chunk_bounds_ref(num_tokens, chunk, partial)
    assert all(e - s == chunk for s, e in bounds[: len(bounds) - (1 if partial else 0)])
    assert (bounds[-1][1] if bounds else 0) == (num_tokens if partial else num_tokens - num_tokens % chunk)


@given(geometries(), st.integers(1, 300), st.integers(0, 1500))
def test_max_group_rows_bounds_every_chunk(geo_args, chunk_factor, num_tokens):
    """A pool slot is sized by max_group_rows: no chunk may store more rows than that."""
    spec, is_page, shard = geo_args
    chunk = chunk_factor * shard.period_tokens * (spec.block_size if is_page or spec.kind is GroupKind.STATE else spec.compress_ratio)
    rows = spec.rows_per_block if not (is_page or spec.kind is GroupKind.STATE) else 1
    tensor = torch.zeros(2, rows, 4, dtype=torch.uint8) if rows > 1 or not is_page else torch.zeros(2, 4, dtype=torch.uint8)
    layout = KVLayout.from_tensors({"l": tensor}, groups=[spec], layout_hints="page" if is_page else None, dcp=shard)
    bound = max_group_rows(layout, chunk)[0]
    geo = layout.geometries[0]
    for s, e in chunk_bounds(num_tokens, chunk, True):
        lo, hi = geo.stored_rows(s, e)
        assert hi - lo <= bound


@st.composite
def tables_and_rows(draw):
    rpb = draw(st.sampled_from([1, 2, 4, 64]))
    num_blocks = draw(st.integers(1, 40))
    n = draw(st.integers(0, 12))
    ids = draw(st.lists(st.integers(-1, num_blocks - 1), min_size=n, max_size=n))
    r0 = draw(st.integers(0, (n + 1) * rpb))
    r1 = draw(st.integers(r0, (n + 1) * rpb))
    return rpb, num_blocks, ids, (r0, r1)


@given(tables_and_rows(), st.booleans())
def test_slots_against_brute_force(args, required):
    rpb, num_blocks, ids, (r0, r1) = args
    layout = KVLayout.from_tensors(
        {"l": torch.zeros(num_blocks, rpb, 2, dtype=torch.uint8)}, groups=[GroupSpec(block_size=rpb)]
    )
    tables = BlockTables.of(layout, [ids])
    expected, absent, too_short = [], False, False
    for r in range(r0, r1):
        b = r // rpb
        if b >= len(ids):
            too_short = True
            break
        if ids[b] < 0:
            absent = True
        expected.append(ids[b] * rpb + r % rpb)
    if too_short or (absent and required):
        with pytest.raises(BlockTableError):
            tables.slots(0, (r0, r1), required=required, what="test")
        return
    got = tables.slots(0, (r0, r1), required=required, what="test")
    if absent:
        assert got is None
    else:
        assert got.dtype == np.int64 and got.tolist() == expected


@given(tables_and_rows(), st.lists(st.tuples(st.integers(0, 13 * 64), st.integers(0, 64)), max_size=6))
def test_slots_many_is_slots_of_each_range(args, more):
    """The planner's batched form (one gather for every chunk of a call) agrees with ``slots``
    range by range: the same slots, None where a block is absent, BlockTableError past the table."""
    rpb, num_blocks, ids, first = args
    layout = KVLayout.from_tensors(
        {"l": torch.zeros(num_blocks, rpb, 2, dtype=torch.uint8)}, groups=[GroupSpec(block_size=rpb)]
    )
    tables = BlockTables.of(layout, [ids])
    ranges = [first] + [(r0 % ((len(ids) + 1) * rpb), r0 % ((len(ids) + 1) * rpb) + n) for r0, n in more]
    one_by_one = []
    for r in ranges:
        try:
            one_by_one.append(tables.slots(0, r, required=False, what="test"))
        except BlockTableError:
            with pytest.raises(BlockTableError):
                tables.slots_many(0, ranges, what=lambda i: "test")
            return
    got = tables.slots_many(0, ranges, what=lambda i: "test")
    assert len(got) == len(ranges)
    for want, have in zip(one_by_one, got):
        assert (want is None) == (have is None)
        if want is not None:
            assert have.dtype == np.int64 and have.tolist() == want.tolist()


@given(st.lists(st.integers(-5, 9), max_size=10), st.sampled_from(["list", "tuple", "numpy", "torch", "int32"]))
def test_block_tables_accept_engine_forms(ids, form):
    """Ids as lists, numpy or torch (any int dtype); negatives mean absent; >= num_blocks is an error."""
    layout = KVLayout.from_tensors({"l": torch.zeros(10, 4, 2, dtype=torch.uint8)}, groups=[GroupSpec(block_size=4)])
    value = {
        "list": ids, "tuple": tuple(ids), "numpy": np.array(ids, dtype=np.int64),
        "torch": torch.tensor(ids, dtype=torch.int64), "int32": torch.tensor(ids, dtype=torch.int32),
    }[form]
    tables = BlockTables.of(layout, value)
    assert tables.tables[0].tolist() == [i if i >= 0 else -1 for i in ids]
    with pytest.raises(BlockTableError):
        BlockTables.of(layout, [list(ids) + [10]])


def test_intersect():
    assert intersect((0, 10), (5, 20)) == (5, 10)
    assert intersect((0, 5), (5, 20)) == (5, 5)
    lo, hi = intersect((8, 10), (0, 3))
    assert hi <= lo
