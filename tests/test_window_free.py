"""Window-free restore points (``GroupSpec.window_free_every``): a window group whose restore window
is 0 at restore points that are multiples of N tokens (set by an engine adapter per release, from a
bench on the real forward: vLLM DeepSeek V4's C128 compressor state, N = 128).

At such points none of its rows are stored or restored; at any other point its whole restore
window is (never assumed). When N divides the chunk size every full chunk's end is such a point
and the group is stored in no part; a layout with the rule has its own fingerprint, so chunks
stored with and without the rule never meet (a miss, never wrong bytes).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from support import zoo
from kvconnect import KVCacheEngine
from kvconnect.errors import LayoutError
from kvconnect.restore.parts import PartLayout, window_free_mask
from kvconnect.restore.plan import max_group_rows
from kvconnect.layout.rows import GroupGeometry
from kvconnect.layout.spec import DCPSpec, GroupSpec

C128_STATE = zoo.DSV4_NAMES.index("c128_state")


def _ruled(case, names=("c128_state",), every=128, groups=None):
    """The case with ``window_free_every`` on the named groups (indices ``groups`` for non-DSv4 cases)."""
    pick = set(groups) if groups is not None else {zoo.DSV4_NAMES.index(n) for n in names}
    return replace(case, groups=[replace(s, window_free_every=every) if g in pick else s for g, s in enumerate(case.groups)])


def test_group_spec_rule_needs_a_window():
    spec = GroupSpec(block_size=8, sliding_window=128, restore_window=127, window_free_every=128)
    assert spec.window_tokens == 127 and spec.window_free_every == 128
    with pytest.raises(LayoutError, match="window_free_every needs a sliding_window"):
        GroupSpec(block_size=8, window_free_every=128)
    for bad in (0, -128, 1.5):
        with pytest.raises(LayoutError, match="window_free_every"):
            GroupSpec(block_size=8, sliding_window=128, window_free_every=bad)


def test_needed_rows_are_empty_only_at_multiples():
    geo = GroupGeometry.of(GroupSpec(block_size=8, sliding_window=128, restore_window=127, window_free_every=128),
                           is_page=False, dcp=DCPSpec())
    for point in (128, 1280, 2176):
        lo, hi = geo.needed_rows(point)
        assert lo == hi == point and geo.window_free_at(point)
    for point in (700, 1300, 129, 64):
        assert geo.needed_rows(point) == (max(0, point - 127), point) and not geo.window_free_at(point)
    plain = GroupGeometry.of(GroupSpec(block_size=8, sliding_window=128, restore_window=127), is_page=False, dcp=DCPSpec())
    assert plain.needed_rows(1280) == (1153, 1280)


def test_part_layout_stores_the_group_in_no_part_when_every_chunk_end_is_aligned():
    case = zoo.dsv4(max_tokens=600)
    base, ruled = case.layout(), _ruled(case).layout()
    for chunk in (128, 256, 512):
        before, after = PartLayout.of(base, chunk), PartLayout.of(ruled, chunk)
        assert window_free_mask(ruled, chunk) == after.free_mask == 1 << C128_STATE
        assert after.window_mask == before.window_mask & ~(1 << C128_STATE)
        assert after.prefix_mask == before.prefix_mask and after.prefix_bytes == before.prefix_bytes
        c128_planes = [i for i, p in enumerate(ruled.planes) if p.group_index == C128_STATE]
        assert c128_planes and not set(c128_planes) & {i for piece in after.pieces for i in piece}
        rows = max_group_rows(ruled, chunk)[C128_STATE]
        c128_bytes = sum(rows * ruled.planes[i].row_bytes for i in c128_planes)
        assert after.window_bytes == before.window_bytes - c128_bytes  # the C128 state's share of the window part
        assert after.slot_bytes < before.slot_bytes  # its planes were the largest window planes
    # parts off (whole chunks): every group stored as before
    assert PartLayout.of(ruled, 256, split=False) == PartLayout.of(base, 256, split=False)


def test_part_layout_keeps_the_group_where_chunk_ends_are_not_aligned():
    case = zoo.gemma_swa(max_tokens=600)  # group 1: sliding window 80
    ruled = _ruled(case, groups=(1,), every=64).layout()
    for chunk in (32, 96):  # chunk ends 32, 96, ... are not multiples of 64
        parts = PartLayout.of(ruled, chunk)
        assert parts.free_mask == 0 and parts.window_mask == 0b10
        assert parts == PartLayout.of(case.layout(), chunk)
    assert PartLayout.of(ruled, 128).free_mask == 0  # the only window group: kept (no part would hold a window)


def test_fingerprint_changes_with_the_rule_only_where_set():
    case = zoo.dsv4(max_tokens=600)
    base = case.layout().fingerprint
    assert case.layout().fingerprint == base
    assert _ruled(case).layout().fingerprint != base
    assert _ruled(case, every=256).layout().fingerprint not in (base, _ruled(case).layout().fingerprint)
    assert _ruled(case, names=("swa", "c128_state")).layout().fingerprint != _ruled(case).layout().fingerprint


def _restore_into_zeros(case, engine, tokens, src_tables, boundary, rng, free_groups):
    """Restore ``boundary`` tokens into an all-zero copy of ``case``; returns the expected cache,
    where the ``free_groups`` keep their zeros and every other group holds the reference rows."""
    dst = case.clone(fill=0)
    dst_engine = KVCacheEngine(dst.layout(), engine.config)
    zoo.transplant(engine, dst_engine, tokens)
    dst_tables = zoo.random_tables(case, len(tokens), rng, keep=zoo.restore_keep(case, max(boundary, 1)))
    unruled = replace(case, groups=[replace(s, window_free_every=None) for s in case.groups])
    expected = zoo.expected_restore(unruled, dst.clone(), src_tables, dst_tables, boundary)
    for name, g in case.layer_groups.items():
        if g in free_groups:
            views = expected.kv_caches[name] if isinstance(expected.kv_caches[name], tuple) else (expected.kv_caches[name],)
            for view in views:
                view.zero_()
    assert dst_engine.lookup(tokens) == boundary
    assert dst_engine.retrieve(tokens, dst_tables) == boundary
    return dst, expected


@pytest.mark.parametrize("chunk", [128, 256])
def test_aligned_restores_leave_the_group_untouched_and_the_rest_exact(chunk, rng):
    n = 1024
    case = _ruled(zoo.dsv4(max_tokens=n + chunk))
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, bounds))
    engine = KVCacheEngine(case.layout(), zoo.small_config(chunk, restore_interval_tokens=512))
    plain = KVCacheEngine(zoo.dsv4(max_tokens=n + chunk).layout(), zoo.small_config(chunk, restore_interval_tokens=512))
    assert engine.store(tokens, src_tables) == n
    assert plain.store(tokens, src_tables) == n
    assert engine.stats.window_parts_stored == plain.stats.window_parts_stored > 0
    assert engine.stats.window_bytes_stored < plain.stats.window_bytes_stored
    for boundary in (512, 1024):
        dst, expected = _restore_into_zeros(case, engine, tokens[:boundary], src_tables, boundary, rng, {C128_STATE})
        assert dst.first_difference(expected) is None


def test_unaligned_restore_points_restore_the_whole_window(rng):
    """Chunks of 32 with the rule at 64: restore points 64, 128 leave the window group alone, 96 restores it."""
    chunk, n = 32, 160
    case = _ruled(zoo.gemma_swa(window=24, max_tokens=n + chunk), groups=(1,), every=64)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, bounds))
    engine = KVCacheEngine(case.layout(), zoo.small_config(chunk))
    assert engine.parts.free_mask == 0 and engine.parts.window_mask == 0b10
    assert engine.store(tokens, src_tables) == n
    for boundary, free in ((64, {1}), (96, set()), (128, {1}), (160, set())):
        dst, expected = _restore_into_zeros(case, engine, tokens[:boundary], src_tables, boundary, rng, free)
        assert dst.first_difference(expected) is None, boundary


@pytest.mark.parametrize("writer_ruled", [True, False])
def test_a_deployment_with_another_rule_misses(writer_ruled, tmp_path, rng):
    """Chunks stored with the rule are never read by a deployment without it, nor the reverse: a miss."""
    chunk, n = 128, 512
    plain = zoo.dsv4(max_tokens=n + chunk)
    ruled = _ruled(plain)
    writer, reader = (ruled, plain) if writer_ruled else (plain, ruled)
    disk = dict(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.2)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(writer, n, rng, keep=zoo.window_keep(writer, zoo.chunk_bounds_ref(n, chunk, False)))
    engine = KVCacheEngine(writer.layout(), zoo.small_config(chunk, **disk))
    assert engine.store(tokens, tables) == n
    assert engine.storage.flush(30)
    engine.close()
    same = KVCacheEngine(writer.clone(fill=0).layout(), zoo.small_config(chunk, **disk))
    other = KVCacheEngine(reader.clone(fill=0).layout(), zoo.small_config(chunk, **disk))
    try:
        assert same.lookup(tokens) == n  # the disk tier holds them for a deployment like the writer
        assert other.lookup(tokens) == 0
    finally:
        same.close()
        other.close()
