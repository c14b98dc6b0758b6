"""The Triton transfer route against the torch oracle, byte for byte, over the model zoo.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is
imported): the CPU tensors stand in for device memory and the interpreter executes the very
kernel source a GPU or an NPU compiles (triton_kernels.py). Both ways are covered: the direct
launch over the whole batch, and the staged route (the CUDA staged route's plan, a device ring
of a few slots much smaller than the batch, one kernel per piece). Each comparison covers the
whole memory of the cache (padding, unused and absent blocks) and of the buffer (the gaps
between segments, the slot padding a store must not write).

The GPU builds of the same source are compiled here for an H100 (sm_90) and an MI300 (gfx942),
no GPU needed, and their assembly checked for 128-bit loads; the ``gpu`` tests run it on a CUDA device and skip without one.
Skips cleanly when triton is not installed (the core CI run).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the GPU tests need it unset)

import re  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from support import zoo  # noqa: E402
from kvconnect import Config, GroupSpec, KVCacheEngine, TransferError  # noqa: E402
from kvconnect.throttled_warning import OnceWarnings  # noqa: E402
from kvconnect.transfer import dispatch  # noqa: E402
from kvconnect.chunks.keys import Chunk  # noqa: E402
from kvconnect.restore.plan import BlockTables, max_chunk_payload_bytes, plan_store, store_segments  # noqa: E402
from kvconnect.layout.spec import ChunkKey  # noqa: E402
from kvconnect.transfer.tables import SegmentBuilder, TransferTables  # noqa: E402
from kvconnect.transfer import staging, triton_launch, triton_route, triton_staged  # noqa: E402
from kvconnect.transfer.triton_launch import TritonTuning  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is unset (a GPU run)")
gpu = pytest.mark.gpu

# the direct launch; a staged ring of 3 slots of 1-4 KB pieces (every batch here is many times larger)
DIRECT = TritonTuning(staged=False, item_bytes=8192)
STAGED = TritonTuning(staged=True, staging_slots=3, first_piece_bytes=1024, max_piece_bytes=4096, merge_gap_bytes=64,
                      max_op_bytes=2048)
TUNINGS = {"direct": DIRECT, "staged": STAGED}

# GQA (flash, HND), MLA (CUDA, Ascend), DSv3.2 indexer (CUDA, Ascend), DSv4 padded and packed,
# SWA hybrid, state hybrid, vLLM CPU pages, DCP shards
NAMES = ["llama-flash", "llama-hnd-flashinfer", "dsv3-mla", "dsv3-mla-ascend", "dsv32", "dsv32-ascend", "dsv4-flash",
         "dsv4-flash-packed", "gemma3-swa", "state-hybrid", "vllm-cpu", "dsv3-mla-dcp", "mla-swa-dcp"]


# In the interpreter each layout runs once, the two launch modes alternating over the zoo so that
# each kind of layout (GQA, MLA, indexer, DSv4 padded and packed, window, state, DCP) meets both
# modes somewhere: the direct and the staged launch run the same kernel source, and an
# interpreted DSv4 batch costs about a minute on 2 cores. The GPU run below takes the whole cross product.
PLANNED = [("llama-flash", "direct"), ("llama-hnd-flashinfer", "staged"), ("dsv3-mla", "staged"),
           ("dsv3-mla-ascend", "direct"), ("dsv32", "direct"), ("dsv32-ascend", "staged"), ("dsv4-flash", "staged"),
           ("dsv4-flash-packed", "direct"), ("gemma3-swa", "staged"), ("state-hybrid", "direct"),
           ("vllm-cpu", "staged"), ("dsv3-mla-dcp", "direct"), ("mla-swa-dcp", "staged")]
assert sorted(n for n, _ in PLANNED) == sorted(NAMES) and {t for _, t in PLANNED} == set(TUNINGS)


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _chunk(name: str) -> int:
    return zoo.ZOO[name][1][0] if name in zoo.ZOO else 64


def _case(name: str):
    return zoo.build(name, max_tokens=2 * _chunk(name))


def edge_rows(nb: int = 40, bs: int = 16):
    """The narrowest and widest rows: 1-byte and 3-byte rows (odd alignment) and 40 KB pages."""
    b = zoo.CaseBuilder()
    b.add("one", b.tight(torch.uint8, (nb, bs, 1)))
    b.add("three", b.tight(torch.uint8, (nb, bs, 3)))
    b.add("wide", b.padded(torch.uint8, 8, 2, 40960, 2 * 40960 + 48, group=1))
    groups = [GroupSpec(block_size=bs), GroupSpec(block_size=2)]
    return b.case("edge-rows", groups, hints=None, num_blocks=[nb, 8])


def planned_tables(case, layout, rng, *, pad_bytes: int = 40) -> tuple[TransferTables, int]:
    """Store tables of two chunks from random block tables, one block of one group absent (-1):
    the planner skips that group in that chunk, so its rows must never be touched."""
    chunk = _chunk(case.name)
    bounds = [(0, chunk), (chunk, 2 * chunk)]
    ids = zoo.random_tables(case, 2 * chunk, rng, keep=zoo.window_keep(case, bounds))
    g = int(rng.integers(len(ids)))
    present = [i for i, x in enumerate(ids[g]) if x >= 0]
    if len(present) > 1:
        ids[g][present[-1]] = -1
    chunks = [Chunk(i, i * chunk, (i + 1) * chunk, ChunkKey(bytes(16))) for i in range(2)]
    plans = plan_store(layout, chunks, BlockTables.of(layout, ids))
    slot_bytes = max_chunk_payload_bytes(layout, chunk) + pad_bytes
    tables = store_segments(layout, plans, [i * slot_bytes for i in range(len(plans))]).build()
    assert len(tables.segments)
    return tables, slot_bytes * len(plans)


def scattered_tables(layout, rng, *, max_rows: int = 24) -> tuple[TransferTables, int]:
    """Distinct random rows of every plane (sorted runs and scattered) at odd buffer offsets."""
    builder, offset = SegmentBuilder(), 0
    for i, p in enumerate(layout.planes):
        n = int(rng.integers(1, min(max_rows, p.num_slots) + 1))
        slots = rng.choice(p.num_slots, size=n, replace=False)
        if rng.random() < 0.5:
            slots.sort()
        offset += int(rng.integers(0, 16))
        so = builder.add_slots(slots.astype(np.int64))
        builder.add_segments(np.array([i]), np.array([n]), np.array([so]), np.array([offset]))
        offset += n * p.row_bytes
    return builder.build(), offset + 5


def check_gather(case, layout, tables, nbytes, rng, tuning, offset: int = 0):
    base = torch.from_numpy(rng.integers(0, 256, nbytes + offset, dtype=np.uint8))
    ref = base.clone()
    before = case.snapshot()
    dispatch.gather(layout, tables, base[offset:], backend="triton", triton_tuning=tuning)
    dispatch.gather(layout, tables, ref[offset:], backend="torch")
    assert dispatch.triton_failure(layout.device.type) is None  # the Triton route ran, not the fallback
    assert torch.equal(base, ref), f"{int((base != ref).sum())} buffer bytes differ from the torch oracle"
    assert case.same_bytes(before), "a gather wrote into the cache"


def check_scatter(case, tables, nbytes, rng, tuning, offset: int = 0):
    buffer = torch.from_numpy(rng.integers(0, 256, nbytes + offset, dtype=np.uint8))[offset:]
    kept = buffer.clone()
    got, want = case.clone(), case.clone()
    dispatch.scatter(got.layout(), tables, buffer, backend="triton", triton_tuning=tuning)
    dispatch.scatter(want.layout(), tables, buffer, backend="torch")
    assert dispatch.triton_failure("cpu") is None  # the Triton route ran, not the fallback
    assert got.first_difference(want) is None  # every byte, targeted rows or not
    assert not got.same_bytes(case), "nothing was written"
    assert torch.equal(buffer, kept), "a scatter wrote into the buffer"


# ---------------------------------------------------------------------------------------
# the interpreter on CPU


@cpu_only
@pytest.mark.parametrize(("name", "tuning"), PLANNED)
def test_planned_chunks_match_the_oracle(name, tuning, rng):
    case = _case(name)
    layout = case.layout()
    tables, nbytes = planned_tables(case, layout, rng)
    check_gather(case, layout, tables, nbytes, rng, TUNINGS[tuning])
    check_scatter(case, tables, nbytes, rng, TUNINGS[tuning])


@cpu_only
@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("name", ["edge-rows", "dsv4-flash-packed", "dsv32-ascend"])
def test_scattered_rows_at_odd_offsets_match_the_oracle(name, tuning, rng):
    """Every unit width (1..16 bytes), rows from 1 byte to 40 KB, buffers at odd addresses."""
    case = edge_rows() if name == "edge-rows" else _case(name)
    layout = case.layout()
    tables, nbytes = scattered_tables(layout, rng)
    for offset in (0, 1, 8):
        check_gather(case, layout, tables, nbytes, rng, TUNINGS[tuning], offset)
        check_scatter(case, tables, nbytes, rng, TUNINGS[tuning], offset)


@cpu_only
@pytest.mark.parametrize("tuning", list(TUNINGS))
def test_the_npu_variant_align_1_matches_the_oracle(tuning, rng, monkeypatch):
    """ALIGN=1, the only variant the NPU route launches (and tests/ascend_compile compiles), on rows that
    would otherwise launch ALIGN 16: DeepSeek V3 as vLLM-Ascend registers it (separate nope and rope
    planes, 1024- and 128-byte rows)."""
    real_align = triton_launch.launch_align
    seen = []
    monkeypatch.setattr(triton_launch, "launch_align", lambda device, *values: seen.append(real_align(device, *values)) or 1)
    case = _case("dsv3-mla-ascend")
    layout = case.layout()
    tables, nbytes = planned_tables(case, layout, rng)
    check_gather(case, layout, tables, nbytes, rng, TUNINGS[tuning])
    check_scatter(case, tables, nbytes, rng, TUNINGS[tuning])
    assert seen and max(seen) >= 8, seen  # those launches would have stated a wider ALIGN


@cpu_only
def test_work_items_cover_each_row_once(rng):
    case = edge_rows()
    layout = case.layout()
    tables, _ = scattered_tables(layout, rng, max_rows=40)
    items = triton_launch.work_items(layout, tables, item_bytes=24)
    seg, first, n = items.T
    for s, (plane, rows, _, _) in enumerate(tables.segments.tolist()):
        mine = seg == s
        covered = np.concatenate([np.arange(f, f + k) for f, k in zip(first[mine], n[mine])])
        assert np.array_equal(covered, np.arange(rows))  # every row once, in order
        p = layout.planes[plane]
        assert (n[mine] * p.row_bytes <= max(24, p.row_bytes)).all()


def test_launch_align_is_the_widest_common_power_of_two():
    cpu, npu = torch.device("cpu"), type("D", (), {"type": "npu"})()
    assert triton_launch.launch_align(cpu, np.array([4096, 1152]), np.array([64])) == 16
    assert triton_launch.launch_align(cpu, np.array([4096, 584]), np.array([64])) == 8
    assert triton_launch.launch_align(cpu, np.array([4096, 3]), np.array([64])) == 1
    assert triton_launch.launch_align(cpu, np.array([0]), np.array([1 << 40])) == 16
    assert triton_launch.launch_align(npu, np.array([4096]), np.array([64])) == 1  # DMA is byte-granular


@cpu_only
def test_staged_ring_is_bounded_by_the_pieces_not_the_batch(rng):
    case = _case("dsv4-flash")
    layout = case.layout()
    tables, nbytes = planned_tables(case, layout, rng)
    plan = triton_staged.staged_plan(layout, tables, nbytes, True, STAGED)
    assert len(plan["piece_bytes"]) > 3 * STAGED.staging_slots  # every slot is reused several times
    assert plan["piece_bytes"].max() <= STAGED.max_piece_bytes
    staging.device_resources().rings.clear()
    check_gather(case, layout, tables, nbytes, rng, STAGED)
    (ring,) = staging.device_resources().rings[layout.device]
    assert ring.numel() <= STAGED.staging_slots * STAGED.max_piece_bytes < nbytes // 4


class _Log:
    """A stand-in device module (torch.cuda's Stream/Event API) that runs everything at once and
    logs what the staged executor queues where: no stream exists on CPU, the protocol is checked."""

    def __init__(self) -> None:
        self.log: list = []
        self.active = "compute"
        outer = self

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name

            def wait_event(self, event):
                outer.log.append(("wait", self.name, event.name, event.at))

            def synchronize(self):
                pass

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.name, self.at = f"e{Event.count}", None

            def record(self, stream):
                self.at = len(outer.log)
                outer.log.append(("record", stream.name, self.name, self.at))

        self.Stream, self.Event, self._compute = Stream, Event, Stream(name="compute")

    def current_stream(self, device=None):
        return self._compute

    def stream(self, s):
        outer = self

        class Ctx:
            def __enter__(self):
                outer.active = s.name

            def __exit__(self, *exc):
                outer.active = "compute"

        return Ctx()


@cpu_only
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_staged_executor_orders_every_slot_reuse(direction, rng, monkeypatch):
    """The stream/event protocol of the staged executor (what runs on a GPU or an NPU), on CPU
    through a logging stand-in: each piece's kernel runs on the compute stream, its copies on the
    side stream after the slot is filled; a slot is refilled only after its previous contents were
    drained; the caller's stream waits for the last copy. Bytes are checked against the oracle too."""
    case = _case("dsv4-flash")
    layout = case.layout()
    tables, nbytes = planned_tables(case, layout, rng)
    fake = _Log()
    kernels = triton_launch.kernels()

    class Launch:
        def __getitem__(self, grid):
            def launch(ops, n, ring_addr, **kw):
                fake.log.append(("kernel", fake.active))
                kernels.ops_kernel[grid](ops, n, ring_addr, **kw)
            return launch

    monkeypatch.setattr(triton_launch, "kernels",
                        lambda: type("K", (), {"ops_kernel": Launch(), "CHUNK_BYTES": kernels.CHUNK_BYTES})())
    monkeypatch.setattr(staging.device_resources(), "copy_streams", {})
    copies = []
    real_copy = torch.Tensor.copy_
    to_buffer = direction == "gather"
    plan = triton_staged.staged_plan(layout, tables, nbytes, to_buffer, STAGED)
    slot_bytes = int(-(-int(plan["piece_bytes"].max()) // 256) * 256)
    ring = torch.zeros(STAGED.staging_slots * slot_bytes, dtype=torch.uint8)
    buffer = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    kept, want = buffer.clone(), buffer.clone()
    scattered = case.clone()

    def logged_copy(self, src, non_blocking=False):
        copies.append(fake.active)
        fake.log.append(("copy", fake.active))
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    target_layout = layout if to_buffer else scattered.layout()
    plan = triton_staged.staged_plan(target_layout, tables, nbytes, to_buffer, STAGED)
    triton_staged.execute(plan, ring, slot_bytes, buffer, to_buffer, STAGED, layout.device, fake)
    monkeypatch.undo()
    assert copies and set(copies) == {"side"}
    kernels_at = [i for i, e in enumerate(fake.log) if e[0] == "kernel"]
    assert kernels_at and all(fake.log[i][1] == "compute" for i in kernels_at)
    # every wait names an event already recorded (a wait on an unrecorded event would not order anything)
    assert all(e[3] is not None and e[3] < i for i, e in enumerate(fake.log) if e[0] == "wait")
    num_pieces, K = len(plan["piece_bytes"]), STAGED.staging_slots
    waits = [e for e in fake.log if e[0] == "wait"]
    reuse_waits = [e for e in waits if e[1] == ("compute" if to_buffer else "side")]
    assert len(reuse_waits) >= num_pieces - K  # a drained-wait before every reuse of a slot
    assert fake.log[-1][:2] == ("wait", "compute")  # the caller's stream waits for the last copy
    if to_buffer:
        dispatch.gather(layout, tables, want, backend="torch")
        assert torch.equal(buffer, want)
    else:
        expected = case.clone()
        dispatch.scatter(expected.layout(), tables, buffer, backend="torch")
        assert scattered.first_difference(expected) is None
        assert torch.equal(buffer, kept)


@cpu_only
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_bad_tables_are_refused_before_launch(direction):
    """The shared validation (tables.validate): the same TransferError as the other kernels."""
    from support.tables import bad_tables

    case = _case("dsv3-mla")
    layout = case.layout()
    before = case.snapshot()
    row_bytes = layout.planes[0].row_bytes
    for tuning in TUNINGS.values():
        for what, tables in bad_tables(layout).items():
            buffer = torch.full((64 * row_bytes,), 0x3C, dtype=torch.uint8)
            with pytest.raises(TransferError):
                getattr(dispatch, direction)(layout, tables, buffer, backend="triton", triton_tuning=tuning)
            assert torch.equal(buffer, torch.full_like(buffer, 0x3C)), what
            assert case.same_bytes(before), what
    good = TransferTables(np.array([[0, 2, 0, 0]], np.int64), np.array([0, 1], np.int64))
    for buffer in (torch.zeros(4 * row_bytes, dtype=torch.int8), torch.zeros(8 * row_bytes, dtype=torch.uint8)[::2]):
        with pytest.raises(TransferError):
            getattr(dispatch, direction)(layout, good, buffer, backend="triton")
    assert case.same_bytes(before)


@cpu_only
def test_tuning_and_route_are_checked():
    for bad in (dict(num_programs=65536), dict(staging_slots=1), dict(item_bytes=0), dict(num_programs=0)):
        with pytest.raises(TransferError):
            TritonTuning(**bad)
    layout = _case("llama-flash").layout()
    assert dispatch.backend_for(layout, "triton") == "triton"
    assert dispatch.route_backend(layout, "auto") is None
    assert dispatch.route_backend(layout, "compiled") == "cpu"
    assert dispatch.route_backend(layout, "triton") == "triton"
    with pytest.raises(TransferError):
        dispatch.route_backend(layout, "dma")
    empty = SegmentBuilder().build()
    dispatch.gather(layout, empty, torch.zeros(4, dtype=torch.uint8), backend="triton")


@cpu_only
def test_engine_round_trip_on_the_configured_triton_route(rng):
    """KVCONNECT_TRANSFER_ROUTE=triton drives the whole engine: store with one cache, retrieve
    into a zeroed one, and the restored rows equal what the torch route restores."""
    case = _case("dsv32-ascend")
    tokens = zoo.random_tokens(rng, 128)
    ids = zoo.random_tables(case, 128, rng)
    restored = {}
    for route in ("triton", "torch"):
        config = zoo.small_config(64, transfer_route=route)
        src = KVCacheEngine(case.layout(), config)
        assert src.backend == route
        assert src.store(tokens, ids) > 0
        dst_case = case.clone(fill=0)
        dst = KVCacheEngine(dst_case.layout(), config)
        zoo.transplant(src, dst, tokens)
        assert dst.retrieve(tokens, ids) == 128
        restored[route] = dst_case
    assert restored["triton"].first_difference(restored["torch"]) is None
    assert not restored["triton"].same_bytes(case.clone(fill=0))


def test_config_reads_the_route():
    assert Config.from_env({"KVCONNECT_TRANSFER_ROUTE": "triton"}).transfer_route == "triton"
    assert Config.from_env({}).transfer_route == "auto"
    from kvconnect.errors import ConfigError

    with pytest.raises(ConfigError):
        Config.from_env({"KVCONNECT_TRANSFER_ROUTE": "fast"})


class _Recorder:
    """Wraps the interpreter's memory access (triton.runtime.interpreter._interpreter): every lane's
    address of every byte-wide load and store, masked or not, is recorded before it is dereferenced."""

    def __init__(self, real) -> None:
        self.real, self.spans = real, []

    def _note(self, ptrs, itemsize):
        if itemsize == 1:  # the data path (the descriptor tables are int64)
            p = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
            if p.size:
                self.spans.append((int(p.min()), int(p.max()) + 1))

    def load(self, ptrs, mask, other, dtype):
        self._note(ptrs, np.dtype(dtype).itemsize)
        return self.real.load(ptrs, mask, other, dtype)

    def store(self, ptrs, value, mask):
        self._note(ptrs, np.asarray(value).dtype.itemsize)
        return self.real.store(ptrs, value, mask)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _plane_extents(layout):
    out = []
    for p, t in zip(layout.planes, layout.tensors):
        base = t.data_ptr()
        out.append((base, base + (p.num_blocks - 1) * p.block_stride_bytes + (p.rows_per_block - 1) * p.row_stride_bytes
                    + p.row_bytes))
    return out


@cpu_only
@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("name", ["edge-rows", "dsv4-flash", "dsv4-flash-packed"])
def test_no_address_outside_the_planes_and_the_buffer_is_dereferenced(name, tuning, rng, monkeypatch):
    """Every plane's last row is moved (the plane's bytes end there; a tight plane's allocation too), the
    buffer is a slice of a larger allocation with guard bytes on both sides: every address a data load or
    store is given, masked or not, lies inside a plane, the buffer or the staging ring, and the guards
    are untouched."""
    import triton.runtime.interpreter as interp

    case = edge_rows() if name == "edge-rows" else _case(name)
    layout = case.layout()
    builder, offset = SegmentBuilder(), 0
    for i, p in enumerate(layout.planes):
        last = np.array([p.num_slots - 1, 0, p.num_slots // 2], np.int64)[: min(3, p.num_slots)]
        so = builder.add_slots(np.unique(last)[::-1].copy())
        builder.add_segments(np.array([i]), np.array([len(np.unique(last))]), np.array([so]), np.array([offset]))
        offset += len(np.unique(last)) * p.row_bytes
    tables, nbytes = builder.build(), offset
    guard = 64
    rings = []
    real_acquire = staging.device_resources().acquire_ring
    monkeypatch.setattr(staging.device_resources(), "acquire_ring", lambda d, n: rings.append(real_acquire(d, n)) or rings[-1])
    recorder = _Recorder(interp._interpreter)
    monkeypatch.setattr(interp, "_interpreter", recorder)
    buffers = []  # kept alive: their ranges are checked below
    for direction in ("gather", "scatter"):
        backing = torch.from_numpy(rng.integers(0, 256, nbytes + 2 * guard, dtype=np.uint8))
        kept = backing.clone()
        buffers.append(backing)
        buffer = backing[guard : guard + nbytes]
        getattr(dispatch, direction)(layout, tables, buffer, backend="triton", triton_tuning=TUNINGS[tuning])
        assert torch.equal(backing[:guard], kept[:guard]) and torch.equal(backing[-guard:], kept[-guard:])
    monkeypatch.undo()
    allowed = (_plane_extents(layout) + [(r.data_ptr(), r.data_ptr() + r.numel()) for r in rings]
               + [(b.data_ptr() + guard, b.data_ptr() + guard + nbytes) for b in buffers])
    assert recorder.spans
    for lo, hi in recorder.spans:
        assert any(a <= lo and hi <= b for a, b in allowed), f"bytes [{lo:#x}, {hi:#x}) are outside every plane, buffer and ring"


def test_npu_route_needs_an_npu_and_triton_ascend(monkeypatch):
    from triton.backends import backends

    monkeypatch.setitem(backends, "ascend", object())  # triton-ascend's backend, as if installed
    monkeypatch.setattr(triton_launch, "npu_present", lambda: False)
    assert not triton_launch.available("npu")  # installed, but no NPU: no Triton route
    monkeypatch.setattr(triton_launch, "npu_present", lambda: True)
    assert triton_launch.available("npu")
    monkeypatch.delitem(backends, "ascend")
    assert not triton_launch.available("npu")
    monkeypatch.undo()
    assert triton_launch.npu_present() == (hasattr(torch, "npu") and torch.npu.is_available())  # False here: no torch_npu


def test_grids_stay_under_the_launcher_limit():
    big = TritonTuning(num_programs=65535)
    assert triton_launch.num_programs(torch.device("cpu"), big) <= triton_launch.MAX_GRID == 65535
    with pytest.raises(TransferError):
        TritonTuning(num_programs=65536)


class _Failing:
    """Stands in for triton_kernels: every launch raises what a compiler stage (or the driver) raises."""

    def __init__(self, real, exc, after: int = 0):
        self.real, self.exc, self.after, self.calls = real, exc, after, 0
        self.CHUNK_BYTES = real.CHUNK_BYTES
        outer = self

        class Kernel:
            def __init__(self, name):
                self.name = name

            def __getitem__(self, grid):
                def launch(*args, **kw):
                    outer.calls += 1
                    if outer.calls > outer.after:
                        raise outer.exc
                    return getattr(outer.real, self.name)[grid](*args, **kw)
                return launch

        self.segments_kernel, self.ops_kernel = Kernel("segments_kernel"), Kernel("ops_kernel")


def _fresh_route_state(monkeypatch):
    monkeypatch.setattr(dispatch.route_health(), "triton_failed", {})
    monkeypatch.setattr(dispatch.route_health(), "triton_warm", set())


@cpu_only
@pytest.mark.parametrize("when", ["compile", "launch"])
def test_a_failing_kernel_means_one_warning_and_the_torch_path(when, rng, monkeypatch, caplog):
    """A compile failure at the engine's warm-up, or a launch failure on a later store: one WARNING naming
    the stage and the reason, the torch path for the rest of the process, stores and retrieves byte-exact."""
    import subprocess

    _fresh_route_state(monkeypatch)
    case = _case("dsv32-ascend")
    kernels = triton_launch.kernels()
    if when == "compile":
        exc, after = subprocess.CalledProcessError(1, ["triton-adapter-opt", "--triton-to-unstructure"]), 0
    else:
        exc, after = RuntimeError("rtKernelLaunch failed: 507015"), 4  # the 4 warm-up launches pass
    failing = _Failing(kernels, exc, after)
    monkeypatch.setattr(triton_launch, "kernels", lambda: failing)
    monkeypatch.setattr(triton_launch, "interpreted", lambda: True)  # the stand-in runs the interpreted kernels
    chunk, n = 64, 128
    tokens = zoo.random_tokens(rng, n)
    ids = zoo.random_tables(case, n, rng)
    config = zoo.small_config(chunk, transfer_route="triton")
    with caplog.at_level("WARNING", logger="kvconnect.transfer"):
        src = KVCacheEngine(case.layout(), config)
        assert src.store(tokens, ids) > 0
        dst_case = case.clone(fill=0)
        dst = KVCacheEngine(dst_case.layout(), config)
        zoo.transplant(src, dst, tokens)
        assert dst.retrieve(tokens, ids) == n
    warnings = [r.getMessage() for r in caplog.records if "Triton transfer route failed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    stage = "warm-up compile" if when == "compile" else "launch"
    assert f"at the {stage} stage" in warnings[0] and str(exc)[:20] in warnings[0], warnings[0]
    assert dispatch.triton_failure("cpu").startswith(stage)
    calls = failing.calls
    want_case = case.clone(fill=0)
    want = KVCacheEngine(want_case.layout(), zoo.small_config(chunk, transfer_route="torch"))
    zoo.transplant(src, want, tokens)
    assert want.retrieve(tokens, ids) == n
    assert dst_case.first_difference(want_case) is None
    src.store(zoo.random_tokens(rng, n), ids)
    assert failing.calls == calls  # given up: never tried again


def test_npu_dispatch_takes_triton_only_where_triton_ascend_is_importable(monkeypatch, caplog):
    """An npu layout cannot be built here (no torch_npu); the choice is checked on a stand-in."""

    class NpuLayout:
        device = torch.device("meta")

    layout = NpuLayout()
    layout.device = type("D", (), {"type": "npu"})()
    monkeypatch.setattr(dispatch.route_health(), "fallbacks", OnceWarnings(dispatch.logger.warning))
    monkeypatch.setattr(triton_launch, "available", lambda device_type: False)
    with caplog.at_level("WARNING"):
        assert dispatch.backend_for(layout) == "torch"
        assert dispatch.backend_for(layout) == "torch"
    assert sum("torch transfer path" in r.message for r in caplog.records) == 1  # logged once
    monkeypatch.setattr(triton_launch, "available", lambda device_type: device_type == "npu")
    assert dispatch.backend_for(layout) == "triton"
    with pytest.raises(TransferError):
        dispatch.route_backend(layout, "compiled")


def _compiled_kernels():
    """triton_kernels.py loaded afresh with the interpreter off (its @triton.jit objects compile)."""
    import importlib.util

    from kvconnect.transfer import triton_route

    path = os.path.join(os.path.dirname(triton_route.__file__), "triton_kernels.py")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        spec = importlib.util.spec_from_file_location("kvconnect_triton_kernels_compiled", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved
    assert isinstance(module.segments_kernel, triton.runtime.jit.JITFunction)
    return module


TARGETS = {  # target -> (Triton target, assembly, 128-bit load and store, byte load and store)
    "cuda-sm90": (("cuda", 90, 32), "ptx", ("ld.global.v4.b32", "st.global.v4.b32"), ("ld.global.b8", "st.global.b8")),
    "hip-gfx942": (("hip", "gfx942", 64), "amdgcn", ("global_load_dwordx4", "global_store_dwordx4"),
                   ("global_load_ubyte", "global_store_byte")),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_the_gpu_builds_compile_with_128_bit_units(target):
    """The same source through Triton's GPU compilers (no GPU needed): it compiles for an H100 and an
    MI300; a launch whose addresses and lengths are 16-byte aligned (ALIGN=16) moves its whole blocks with
    128-bit loads and stores, an unaligned one (ALIGN=1) byte by byte."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    (backend, arch, warp), asm, wide, narrow = TARGETS[target]
    k = _compiled_kernels()
    i64 = "*i64"
    cases = [
        (k.segments_kernel, {"planes_ptr": i64, "segments_ptr": i64, "slots_ptr": i64, "items_ptr": i64, "num_items": "i32",
                             "buffer_addr": "i64", "TO_BUFFER": "constexpr", "ALIGN": "constexpr", "CHUNK": "constexpr"}),
        (k.ops_kernel, {"ops_ptr": i64, "num_ops": "i32", "ring_addr": "i64", "TO_BUFFER": "constexpr",
                        "ALIGN": "constexpr", "CHUNK": "constexpr"}),
    ]
    for kernel, signature in cases:
        for to_buffer in (True, False):
            for align, want in ((16, wide), (1, narrow)):
                src = ASTSource(kernel, signature,
                                constexprs={"TO_BUFFER": to_buffer, "ALIGN": align, "CHUNK": k.CHUNK_BYTES})
                try:
                    code = triton.compile(src, target=GPUTarget(backend, arch, warp)).asm[asm]
                except RuntimeError as exc:
                    if "ptxas" not in str(exc) and "lld" not in str(exc):
                        raise
                    pytest.skip(f"Triton's {backend} toolchain is not usable here: {exc}")
                ops = set(re.findall(r"(?:ld|st)\.global\.\w+(?:\.\w+)?|global_(?:load|store)_\w+", code))
                assert set(want) <= ops, (align, sorted(ops))


# ---------------------------------------------------------------------------------------
# real Triton on a CUDA GPU (TRITON_INTERPRET unset; skipped without a GPU)


def _cuda_case(case):
    moved = case.clone()
    moved.backings = [b.cuda() for b in case.backings]
    moved.kv_caches = moved._views(moved.backings)
    return moved


@gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(),
                    reason="needs a CUDA GPU and TRITON_INTERPRET=0 (run: TRITON_INTERPRET=0 pytest -m gpu this file)")
@pytest.mark.parametrize("tuning", ["auto", "staged"])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_planned_chunks_match_the_oracle(name, tuning, rng):
    case = _case(name)
    dev = _cuda_case(case)
    layout = dev.layout()
    tables, nbytes = planned_tables(case, layout, rng)
    t = TritonTuning() if tuning == "auto" else TritonTuning(staged=True, first_piece_bytes=4096, max_piece_bytes=16384)
    host = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)).pin_memory()
    ref = host.clone().pin_memory()
    dispatch.gather(layout, tables, host, backend="triton", triton_tuning=t)
    dispatch.gather(layout, tables, ref, backend="torch")
    assert torch.equal(host, ref)
    got, want = _cuda_case(case), _cuda_case(case)
    dispatch.scatter(got.layout(), tables, host, backend="triton", triton_tuning=t)
    dispatch.scatter(want.layout(), tables, host, backend="torch")
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got.backings, want.backings))
