"""The torch transfer path (kvconnect/transfer/torch_impl.py): O(planes) device ops per batch, and
byte-exact against the compiled CPU kernel over the model zoo (planner-built store tables of two
chunks, and random rows at odd buffer offsets), every byte of cache and buffer compared."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support import zoo
from kvconnect.transfer import dispatch
from kvconnect.transfer.kernels import cpu_kernels
from kvconnect.chunks.keys import Chunk
from kvconnect.restore.plan import BlockTables, max_chunk_payload_bytes, plan_store, store_segments
from kvconnect.layout.spec import ChunkKey
from kvconnect.transfer.tables import SegmentBuilder

NAMES = ["llama-flash", "llama-hnd-flashinfer", "dsv3-mla", "dsv3-mla-ascend", "dsv32-ascend", "dsv4-flash",
         "dsv4-flash-packed", "gemma3-swa", "state-hybrid", "vllm-cpu", "dsv3-mla-dcp", "mla-swa-dcp"]
_NO_LAUNCH = {"view", "_unsafe_view", "slice", "as_strided", "set_", "select", "reshape", "alias", "lift_fresh", "empty",
              "detach", "unsqueeze", "expand"}

needs_cpu_kernel = pytest.mark.skipif(cpu_kernels() is None, reason="kvconnect._cpu_kernels is not built")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launches(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in _NO_LAUNCH)


def _planned(name, rng, num_chunks=2):
    chunk = zoo.ZOO[name][1][0]
    case = zoo.build(name, max_tokens=num_chunks * chunk)
    layout = case.layout()
    bounds = [(i * chunk, (i + 1) * chunk) for i in range(num_chunks)]
    ids = zoo.random_tables(case, num_chunks * chunk, rng, keep=zoo.window_keep(case, bounds))
    chunks = [Chunk(i, i * chunk, (i + 1) * chunk, ChunkKey(bytes(16))) for i in range(num_chunks)]
    plans = plan_store(layout, chunks, BlockTables.of(layout, ids))
    slot_bytes = max_chunk_payload_bytes(layout, chunk) + 40  # slot padding a store must not write
    return case, layout, store_segments(layout, plans, [i * slot_bytes for i in range(len(plans))]).build(), \
        slot_bytes * len(plans)


def _scattered(layout, rng):
    builder, offset = SegmentBuilder(), 3  # odd offsets: units narrower than the rows
    for i, p in enumerate(layout.planes):
        n = int(rng.integers(1, min(24, p.num_slots) + 1))
        so = builder.add_slots(rng.choice(p.num_slots, size=n, replace=False).astype(np.int64))
        builder.add_segments(np.array([i]), np.array([n]), np.array([so]), np.array([offset]))
        offset += n * p.row_bytes + int(rng.integers(0, 5))
    return builder.build(), offset + 7


def _both_ways(case, layout, tables, nbytes, rng):
    got = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    want = got.clone()
    dispatch.gather(layout, tables, got, backend="torch")
    dispatch.gather(layout, tables, want, backend="cpu")
    assert torch.equal(got, want), f"{int((got != want).sum())} buffer bytes differ from the CPU kernel"
    buffer = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    a, b = case.clone(), case.clone()
    dispatch.scatter(a.layout(), tables, buffer, backend="torch")
    dispatch.scatter(b.layout(), tables, buffer, backend="cpu")
    assert a.first_difference(b) is None


@needs_cpu_kernel
@pytest.mark.parametrize("name", NAMES)
def test_torch_path_matches_the_cpu_kernel(name, rng):
    case, layout, tables, nbytes = _planned(name, rng)
    _both_ways(case, layout, tables, nbytes, rng)
    tables, nbytes = _scattered(layout, rng)
    _both_ways(case, layout, tables, nbytes, rng)


@pytest.mark.parametrize("name", ["dsv4-flash", "dsv4-flash-packed", "llama-flash"])
def test_device_ops_per_batch_follow_the_planes_not_the_segments(name, rng):
    """Each direction: at most three launching ops per plane used, plus the index upload and one arange; four times the
    chunks (four times the segments) costs the same."""
    counts = {}
    for num_chunks in (1, 4):
        case, layout, tables, nbytes = _planned(name, rng, num_chunks)
        planes_used = len(np.unique(tables.segments[:, 0]))
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        dispatch.gather(layout, tables, buffer, backend="torch")  # byte views built outside the count
        for direction in ("gather", "scatter"):
            with _Ops() as ops:
                getattr(dispatch, direction)(layout, tables, buffer, backend="torch")
            assert ops.launches() <= 3 * planes_used + 3, (direction, dict(ops.ops))
            counts[num_chunks, direction] = ops.launches()
        if num_chunks == 4:
            assert len(tables.segments) > 2 * planes_used  # more segments than planes: the count is per plane
    assert counts[1, "gather"] == counts[4, "gather"] and counts[1, "scatter"] == counts[4, "scatter"], counts


@needs_cpu_kernel
def test_a_buffer_the_device_cannot_address_goes_through_one_span_copy(rng, monkeypatch):
    """Device planes with a host buffer (an NPU's pool): the span is copied to the device first (the bytes
    between segments kept) and back once after a store. Simulated on CPU by handing the path a separate
    copy of the span, as ``.to(device)`` would."""
    from kvconnect.transfer import torch_impl

    copies = []

    def device_span(layout, buffer, lo, hi):
        copies.append((lo, hi))
        return buffer[lo:hi].clone()

    monkeypatch.setattr(torch_impl, "_device_span", device_span)
    case, layout, tables, nbytes = _planned("dsv4-flash", rng)
    _both_ways(case, layout, tables, nbytes, rng)
    assert len(copies) == 2  # one a direction
