"""Capacity whatever the tensor granularity (issue 33 item 2): a window plane wider than a pool
slot is stored in column slices (``restore.parts.slice_wide_planes``).

DeepSeek V4-Flash registered one tensor per layer (as vLLM does) or one per cache group (as an
engine with one buffer per cache type, or a Python API user, would) must give the same slots,
and the trace replay the same served share; a coarse layout round-trips byte-exactly (the zoo's
``gemma3-swa-coarse`` in every zoo sweep, e.g. tests/test_engine_roundtrip.py), and a missing
slice is a miss at that restore point, never a partial window.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from support import zoo
from kvconnect import KVCacheEngine
from kvconnect.integrations import presets
from kvconnect.restore.parts import PartLayout, slice_wide_planes, window_key

REPO = Path(__file__).resolve().parents[1]


def _trace_replay():
    spec = importlib.util.spec_from_file_location("trace_replay", REPO / "benchmarks" / "trace_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dsv4_per_group_tensors_get_the_per_layer_slot():
    replay = _trace_replay()
    per_layer = presets.preset("deepseek-v4-flash").layout(0)
    per_group = replay.per_group_tensors(per_layer)
    assert len(per_group.planes) == per_layer.num_groups  # one plane per group, before slicing
    unsliced = PartLayout.of(per_group, 256)
    sliced = PartLayout.of(slice_wide_planes(per_group, 256), 256)
    reference = PartLayout.of(slice_wide_planes(per_layer, 256), 256)
    assert slice_wide_planes(per_layer, 256) is per_layer  # vLLM's per-layer layout: nothing to slice
    assert unsliced.slot_bytes > 3 * reference.slot_bytes  # the coarse plane was the slot
    assert sliced.slot_bytes == reference.slot_bytes == reference.prefix_bytes
    assert (sliced.prefix_bytes, sliced.window_bytes) == (reference.prefix_bytes, reference.window_bytes)
    layout = slice_wide_planes(per_group, 256)
    window_planes = [i for i, p in enumerate(layout.planes) if (sliced.window_mask >> p.group_index) & 1]
    assert sorted(sum(sliced.pieces, ())) == window_planes  # every slice in exactly one piece
    assert len(layout.planes) > len(per_group.planes)


def test_replay_serves_the_same_share_whatever_the_tensors():
    replay = _trace_replay()
    trace = replay.load_trace("synthetic", 400)
    rows = {}
    for tensors in ("per-layer", "per-group"):
        model = replay.Model("deepseek-v4-flash", max(r["input_length"] for r in trace), tensors)
        rows[tensors] = replay.replay(model, trace, "4096", 50.0)
    assert rows["per-layer"]["slots"] == rows["per-group"]["slots"]
    assert abs(rows["per-layer"]["served"] - rows["per-group"]["served"]) <= 0.02
    assert rows["per-group"]["served"] > 0


@pytest.mark.parametrize("chunk", [32, 64])
def test_a_missing_slice_falls_back_to_an_earlier_restore_point(chunk, rng):
    case = zoo.build("gemma3-swa-coarse", max_tokens=4 * chunk + 8, seed=chunk)
    engine = KVCacheEngine(case.layout(), zoo.small_config(chunk, restore_interval_tokens=2 * chunk))
    assert any(p.num_slices > 1 for p in engine.layout.planes)  # the window plane travels in slices
    assert engine.parts.slot_bytes == engine.parts.prefix_bytes
    n = 4 * chunk + 8
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    assert engine.store(tokens, tables) == 4 * chunk
    assert engine.lookup(tokens) == 4 * chunk
    last = engine.chunks(tokens, include_partial=False)[-1]
    sliced_pieces = [i for i, piece in enumerate(engine.parts.pieces)
                     if any(engine.layout.planes[j].num_slices > 1 for j in piece)]
    engine.storage.drop(window_key(last.key, sliced_pieces[-1]))
    # the window at 4 chunks lost a slice of the last chunk's rows: the largest end whose window
    # rows are all present is 3 chunks (its window lies in chunks 0-2, stored for the point at 2
    # and the one at 4), and its restore is exact
    assert engine.lookup(tokens) == 3 * chunk
    dst = case.clone(fill=0x5A)
    reader = KVCacheEngine(dst.layout(), zoo.small_config(chunk, restore_interval_tokens=2 * chunk))
    assert zoo.transplant(engine, reader, tokens) > 0
    assert reader.lookup(tokens) == 3 * chunk
    dst_tables = zoo.random_tables(case, n, rng)
    expected = zoo.expected_restore(case, dst.clone(), tables, dst_tables, 3 * chunk)
    assert reader.retrieve(tokens, dst_tables) == 3 * chunk
    assert dst.first_difference(expected) is None  # the rows of [0, 3 chunks) exact, no byte elsewhere


@pytest.fixture
def rng():
    return np.random.default_rng(5)
