"""The CUDA transfer kernel against the torch oracle, byte for byte, over a model zoo.

GPU tests skip cleanly without a CUDA device or without the built extension; the host-side
validation (which runs before any CUDA call) is tested everywhere the extension is built
(the build switch: test_build_cuda.py). Every zoo cache lives in flat uint8 backings, so each comparison
covers the whole memory: padding between pages, unused and absent blocks, canaries.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvconnect import Config, KVCacheEngine, TransferError
from kvconnect.transfer import dispatch
from kvconnect.transfer.tables import TransferTables
from kvconnect.transfer import cuda as cuda_path

from support.cuda_zoo import (  # noqa: F401  (gen is a fixture)
    ZOO,
    dsv4,
    llama_flash,
    mla,
    CHUNK,
    DEVICE,
    HAS_GPU,
    built,
    check_gather,
    check_scatter,
    gen,
    gpu,
    pinned,
    planned_tables,
    random_block_tables,
    random_tables,
)

try:
    from kvconnect import _cuda_kernels
except ImportError:
    _cuda_kernels = None


@built
def test_validation_precedes_any_cuda_call():
    """Bad tables are refused on the host, before the device (or its absence) is consulted."""
    planes = np.array([[1 << 20, 4096, 256, 256, 16, 160]], np.int64)
    seg = np.array([[0, 2, 0, 0]], np.int64)
    cases = [
        (np.array([[1, 2, 0, 0]], np.int64), np.array([0, 1]), 1024, IndexError, "plane index"),
        (seg, np.array([0, 160]), 1024, IndexError, "slot 160"),
        (seg, np.array([-1, 3]), 1024, IndexError, "slot -1"),
        (seg, np.array([0]), 1024, IndexError, "slot range"),
        (seg, np.array([0, 1]), 511, IndexError, "buffer range"),
    ]
    for segments, slots, nbytes, exc, text in cases:
        with pytest.raises(exc, match=text):
            _cuda_kernels.gather(planes, segments, slots.astype(np.int64), 1 << 30, nbytes, 0, 0, True)
    bad_plane = planes.copy()
    bad_plane[0, 4] = 0  # rows_per_block 0 would divide by zero
    with pytest.raises(ValueError, match="malformed"):
        _cuda_kernels.scatter(bad_plane, seg, np.array([0, 1], np.int64), 1 << 30, 1024, 0, 0, True)
    with pytest.raises(ValueError, match="unroll"):
        _cuda_kernels.gather(planes, seg, np.array([0, 1], np.int64), 1 << 30, 1024, 0, 0, True, unroll=3)
    with pytest.raises(ValueError, match="threads_per_block"):
        _cuda_kernels.gather(planes, seg, np.array([0, 1], np.int64), 1 << 30, 1024, 0, 0, True, threads_per_block=1024)
    assert _cuda_kernels.gather(planes, seg[:0], np.zeros(0, np.int64), 1 << 30, 0, 0, 0, True) == 0


@built
@pytest.mark.skipif(HAS_GPU, reason="checks the error path of a machine without a GPU")
def test_without_gpu_a_transfer_raises_cuda_error_naming_the_call():
    planes = np.array([[1 << 20, 4096, 256, 256, 16, 160]], np.int64)
    with pytest.raises(_cuda_kernels.CudaError, match=r"kvconnect CUDA transfer: cuda\w+ .*failed"):
        _cuda_kernels.gather(planes, np.array([[0, 1, 0, 0]], np.int64), np.array([3], np.int64), 1 << 30, 256, 0, 0, True)
    assert isinstance(_cuda_kernels.CudaError("x"), RuntimeError)
    assert _cuda_kernels.device_count() == 0


# ---------------------------------------------------------------------------------------
# on a GPU


@gpu
@pytest.mark.parametrize("name", list(ZOO))
def test_planned_store_and_load_match_the_oracle(name, gen):
    case = ZOO[name]()
    case.randomize(gen)
    layout = case.layout()
    assert dispatch.backend_for(layout) == "cuda"
    tables, nbytes = planned_tables(layout, 768, gen)
    check_gather(layout, tables, nbytes, gen)
    check_scatter(case, layout, tables, nbytes, gen)


@gpu
@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_random_rows_at_odd_alignments_match_the_oracle(name, offset, gen):
    case = ZOO[name]()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = random_tables(layout, gen)
    check_gather(layout, tables, nbytes, gen, offset=offset)
    check_scatter(case, layout, tables, nbytes, gen, offset=offset)


@gpu
@pytest.mark.parametrize("name", ["llama_flash", "dsv4", "dsv4_packed"])
def test_absent_blocks_are_never_touched(name, gen):
    case = ZOO[name]()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = planned_tables(layout, 1024, gen, absent_chunk=1, pad_bytes=3)
    check_gather(layout, tables, nbytes, gen)
    check_scatter(case, layout, tables, nbytes, gen)


TUNINGS = [
    cuda_path.KernelTuning(merge_rows=False),
    cuda_path.KernelTuning(unroll=2, threads_per_block=64, blocks_per_sm=1, max_op_bytes=16),
    cuda_path.KernelTuning(threads_per_block=512, blocks_per_sm=4, max_op_bytes=1 << 20, copy_op_table=True),
    cuda_path.KernelTuning(use_dma=True),
]


@gpu
@pytest.mark.parametrize("tuning", TUNINGS, ids=["rows", "small", "large", "dma"])
@pytest.mark.parametrize("name", ["llama_flash", "narrow", "dsv4_packed"])
def test_every_launch_shape_moves_the_same_bytes(name, tuning, gen):
    case = ZOO[name]()
    case.randomize(gen)
    layout = case.layout()
    side = torch.cuda.Stream()  # the DMA path refuses the legacy default stream
    tables, nbytes = random_tables(layout, gen)
    check_gather(layout, tables, nbytes, gen, offset=3, tuning=tuning, stream=side)
    check_scatter(case, layout, tables, nbytes, gen, tuning=tuning, stream=side)


@gpu
def test_async_on_a_caller_stream_returns_an_event(gen):
    case = dsv4(True)
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = planned_tables(layout, 1024, gen)
    ref = pinned(nbytes, gen)
    dispatch.gather(layout, tables, ref, backend="torch")
    side = torch.cuda.Stream()
    for stream in (side, side.cuda_stream):
        buf = pinned(nbytes, gen)
        event = cuda_path.run_async("gather", layout, tables, buf, stream)
        assert isinstance(event, torch.cuda.Event)
        event.synchronize()
        assert torch.equal(buf, ref)
    # load on the side stream, then order the default stream after it
    before = case.snapshot()
    event = cuda_path.run_async("scatter", layout, tables, ref, side)
    torch.cuda.current_stream().wait_event(event)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(case.snapshot(), before))  # the same bytes went back


SMALL_RING = cuda_path.KernelTuning(staged=True, first_piece_bytes=256, max_piece_bytes=4096)  # staged route, many pieces


@gpu
@pytest.mark.parametrize("tuning", [None, SMALL_RING], ids=["kernel", "staged"])
def test_concurrent_callers_on_their_own_streams(tuning, gen):
    case = llama_flash(layers=4, nb=64)
    case.randomize(gen)
    layout = case.layout()
    jobs = [planned_tables(layout, 768, gen) for _ in range(4)]
    refs = []
    for tables, nbytes in jobs:
        ref = pinned(nbytes, gen)
        dispatch.gather(layout, tables, ref, backend="torch")
        refs.append(ref)
    outs = [pinned(nbytes, gen) for _, nbytes in jobs]
    errors = []

    def work(k):
        try:
            stream = torch.cuda.Stream()
            for _ in range(5):
                cuda_path.run("gather", layout, jobs[k][0], outs[k], stream, tuning=tuning)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)


@gpu
@pytest.mark.parametrize("tuning", [None, SMALL_RING], ids=["kernel", "staged"])  # staged: a device buffer takes the kernel
def test_device_buffer_and_uva_alias(tuning, gen):
    case = mla()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = planned_tables(layout, 512, gen)
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE)
    dispatch.gather(layout, tables, dev, cuda_tuning=tuning)
    ref = pinned(nbytes, gen)
    dispatch.gather(layout, tables, ref, backend="torch")
    assert torch.equal(dev.cpu(), ref)
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    if _cuda_kernels.unified_addressing(torch.cuda.current_device()):
        assert _cuda_kernels.device_pointer(host.data_ptr()) == host.data_ptr()
        assert _cuda_kernels.device_pointer(host.data_ptr() + 100) == host.data_ptr() + 100


@gpu
def test_bad_input_is_refused_before_anything_moves(gen):
    case = llama_flash()
    case.randomize(gen)
    layout = case.layout()
    tables, nbytes = planned_tables(layout, 512, gen)
    before = case.snapshot()
    buf = pinned(nbytes, gen)
    bad = TransferTables(tables.segments.copy(), tables.slots.copy())
    bad.slots[-1] = layout.planes[0].num_slots  # one past the end
    with pytest.raises(TransferError, match="slot"):
        dispatch.scatter(layout, bad, buf)
    with pytest.raises(TransferError, match="buffer"):
        dispatch.scatter(layout, tables, buf[: nbytes - 1])
    with pytest.raises(TransferError, match="pinned"):
        dispatch.scatter(layout, tables, torch.zeros(nbytes, dtype=torch.uint8))  # pageable
    with pytest.raises(TransferError, match="uint8"):
        dispatch.scatter(layout, tables, buf.view(torch.int16))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(case.snapshot(), before))


@gpu
@pytest.mark.parametrize("route", ["kernel", "staged"])
@pytest.mark.parametrize("name", ["llama_flash", "dsv32", "dsv4", "dsv4_packed"])
def test_engine_store_retrieve_round_trip_matches_the_torch_engine(name, route, gen):
    """The whole engine (pinned pool, planner, restore gate) on cuda tensors, kernel vs torch
    (route: KVCONNECT_CUDA_TRANSFER)."""
    num_tokens = 1024
    tokens = torch.randint(0, 50000, (num_tokens,), generator=gen)
    results = {}
    for backend in ("cuda", "torch"):
        g = torch.Generator().manual_seed(7)
        case = ZOO[name]()
        case.randomize(g)
        layout = case.layout()
        engine = KVCacheEngine(layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.05, cuda_transfer=route), backend=backend)
        stored = engine.store(tokens, random_block_tables(layout, num_tokens, g))
        original = case.snapshot()
        case.randomize(g)  # the engine's blocks are reused for other requests
        loaded = engine.retrieve(tokens, random_block_tables(layout, num_tokens, g))
        results[backend] = (stored, loaded, case.snapshot(), original)
        engine.close()
    (stored, loaded, got, original), (t_stored, t_loaded, want, _) = results["cuda"], results["torch"]
    assert (stored, loaded) == (t_stored, t_loaded) == (num_tokens, num_tokens)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"backing {i} differs from the torch engine"
    assert not all(torch.equal(a, b) for a, b in zip(got, original))  # rows moved to new blocks
