"""The CUDA staged route (kernel into a device ring, copy engines to pinned memory) against the
torch oracle, byte for byte. Its planner is tested without a GPU in test_staged_plan.py; these
tests run its executor (two streams, per-slot events, ring reuse) and skip without a GPU.
test_cuda_transfer.py runs it too: concurrent callers, a device buffer, the whole engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvconnect.transfer import dispatch
from kvconnect.transfer import cuda as cuda_path
from support.cuda_zoo import (  # noqa: F401  (gen is a fixture)
    ZOO,
    built,
    check_gather,
    check_scatter,
    gen,
    gpu,
    pinned,
    planned_tables,
    random_tables,
)

try:
    from kvconnect import _cuda_kernels
except ImportError:
    _cuda_kernels = None

STAGED = {
    "default": cuda_path.KernelTuning(staged=True),
    "tiny": cuda_path.KernelTuning(staged=True, first_piece_bytes=256, max_piece_bytes=4096, merge_gap_bytes=64),
    "ring3": cuda_path.KernelTuning(staged=True, staging_slots=3, first_piece_bytes=16, max_piece_bytes=1024,
                                    merge_gap_bytes=0, max_op_bytes=64),
}


@gpu
@pytest.mark.parametrize("tuning", list(STAGED))
@pytest.mark.parametrize("name", list(ZOO))
def test_planned_chunks_match_the_oracle(name, tuning, gen):
    case = ZOO[name]()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = planned_tables(layout, 768, gen, pad_bytes=88)  # slot padding a store must not write
    check_gather(layout, tables, nbytes, gen, tuning=STAGED[tuning])
    check_scatter(case, layout, tables, nbytes, gen, tuning=STAGED[tuning])


@gpu
@pytest.mark.parametrize("offset", [1, 8])
@pytest.mark.parametrize("name", ["llama_flash", "narrow", "dsv4", "dsv4_packed"])
def test_random_rows_at_odd_alignments_match_the_oracle(name, offset, gen):
    case = ZOO[name]()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = random_tables(layout, gen)
    check_gather(layout, tables, nbytes, gen, offset=offset, tuning=STAGED["tiny"])
    check_scatter(case, layout, tables, nbytes, gen, offset=offset, tuning=STAGED["tiny"])


@gpu
def test_absent_blocks_are_never_touched(gen):
    case = ZOO["dsv4_packed"]()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = planned_tables(layout, 1024, gen, absent_chunk=1, pad_bytes=3)
    check_gather(layout, tables, nbytes, gen, tuning=STAGED["tiny"])
    check_scatter(case, layout, tables, nbytes, gen, tuning=STAGED["tiny"])


@gpu
def test_streams_events_and_a_growing_ring(gen):
    """Default stream, a side stream, queued calls with an event; then a larger ring."""
    case = ZOO["dsv4"]()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = planned_tables(layout, 1024, gen)
    ref = pinned(nbytes, gen)
    dispatch.gather(layout, tables, ref, backend="torch")
    side = torch.cuda.Stream()
    for tuning in (STAGED["tiny"], STAGED["default"], cuda_path.KernelTuning(staged=True, max_piece_bytes=32 << 20)):
        buf = pinned(nbytes, gen)
        cuda_path.run("gather", layout, tables, buf, tuning=tuning)
        assert torch.equal(buf, ref)
        outs = [pinned(nbytes, gen) for _ in range(3)]
        events = [cuda_path.run_async("gather", layout, tables, out, side, tuning=tuning) for out in outs]
        for event, out in zip(events, outs):
            event.synchronize()
            assert torch.equal(out, ref)
    before = case.snapshot()
    case.randomize(gen)
    event = cuda_path.run_async("scatter", layout, tables, ref, side, tuning=STAGED["tiny"])
    torch.cuda.current_stream().wait_event(event)
    torch.cuda.synchronize()
    restored = case.snapshot()
    case.restore(before)
    dispatch.scatter(layout, tables, ref, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(restored, case.snapshot()))


@built
def test_bad_staging_options_are_refused_before_any_cuda_call():
    planes = np.array([[1 << 20, 4096, 256, 256, 16, 160]], np.int64)
    seg, slots = np.array([[0, 2, 0, 0]], np.int64), np.array([0, 1], np.int64)
    for bad, text in [(dict(staging_slots=1), "staging_slots"), (dict(first_piece_bytes=24), "multiples of 16"),
                      (dict(first_piece_bytes=1 << 20, max_piece_bytes=4096), "first <= max"),
                      (dict(merge_gap_bytes=-1), "merge_gap_bytes")]:
        with pytest.raises(ValueError, match=text):
            _cuda_kernels.gather(planes, seg, slots, 1 << 30, 1024, 0, 0, True, staged=True, **bad)
    assert _cuda_kernels.scatter(planes, seg[:0], slots[:0], 1 << 30, 0, 0, 0, True, staged=True) == 0

