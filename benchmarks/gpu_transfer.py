"""GPU transfer benchmark: kvconnect's CUDA kernel vs the pinned memcpy limit and torch baselines.

One run on one GPU prints, side by side:
- the pinned memcpy limit (1 GiB, copy engines) device->host and host->device, and both at once;
- for Llama-8B-like GQA, DeepSeek-V3 MLA and DeepSeek-V4-Flash at 256 (one chunk), 8K and 64K
  tokens: kvconnect store (paged device -> pinned pool, D2H) and load (pool -> paged, H2D),
  each one synchronous call timed on the host clock (planning, launch and wait included), and
  the same calls queued back to back ("pipelined": host planning overlaps the previous copy);
  the torch baseline (per-plane index_select into a GPU staging buffer the size of the batch,
  then one copy; the reverse for load); the naive per-plane copy (index, then copy each plane
  straight to/from pinned memory); each as GB/s and as a ratio to the memcpy limit;
- store and load on two streams at once (combined GB/s);
- each of those for every route of --routes: the CUDA kernel's "kernel" (zero-copy: SMs read
  and write the pinned pool over PCIe) and "staged" (the kernel gathers into a small device
  ring and the copy engines move it in large copies, KernelTuning(staged=True)); the Triton
  route's "triton" (one launch, zero-copy through unified addressing) and "triton_staged"
  (the same staged plan and ring, Triton kernels per piece; the NPU's way); and "torch"
  (kvconnect's torch path, one indexing op per plane and segment: what an NPU gets without
  Triton). Pipelined and device-time columns need an asynchronous call: "-" where a route
  has none;
- optionally (--sweep) launch shapes, ring piece sizes, and merged runs vs one op per row vs
  copy engines per run (DMA).

Store moves every row each chunk keeps; load moves what a retrieve at the full prompt moves
(windowed groups only their window, so DSv4 loads fewer bytes than it stores).

Run: python benchmarks/gpu_transfer.py [--sizes 256,8192,65536] [--routes kernel,staged,triton,triton_staged,torch]
     [--sweep] [--json out.json]
     python benchmarks/gpu_transfer.py --dry-run   # no GPU: CPU tensors, one chunk per layout, Triton in its
                                                   # interpreter; checks bytes against the torch path, times nothing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import dsv4_cache  # noqa: E402

from kvconnect import GroupSpec, KVLayout  # noqa: E402
from kvconnect.chunks.chunk_format import ChunkHeader  # noqa: E402
from kvconnect.chunks.keys import Chunk  # noqa: E402
from kvconnect.layout.spec import ChunkKey  # noqa: E402
from kvconnect.restore.plan import BlockTables, max_chunk_payload_bytes, plan_store, retrieve_segments, store_segments  # noqa: E402
from kvconnect.transfer import dispatch  # noqa: E402
from kvconnect.transfer.tables import SegmentBuilder, plane_table  # noqa: E402
from kvconnect.transfer import cuda as cuda_path  # noqa: E402
from kvconnect.transfer import triton_launch  # noqa: E402
from kvconnect.transfer.kernels import cuda_kernels  # noqa: E402
from kvconnect.transfer.torch_impl import byte_views  # noqa: E402

CHUNK = 256
GB = 1e9
DEVICE = "cuda"  # --dry-run: "cpu"


# ---------------------------------------------------------------------------------------
# layouts, allocated on the GPU directly (capacity_tokens of blocks per group)


def llama8b(capacity_tokens: int) -> KVLayout:
    nb = capacity_tokens // 16 + 1
    kv = {f"layers.{i}": torch.empty(2, nb, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE) for i in range(32)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=16)], model_name="llama-8b-like")


def dsv3_mla(capacity_tokens: int) -> KVLayout:
    nb = capacity_tokens // 64 + 1
    kv = {f"layers.{i}": torch.empty(nb, 64, 576, dtype=torch.bfloat16, device=DEVICE) for i in range(61)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=64)], model_name="dsv3-like")


def dsv4_flash(capacity_tokens: int, packed: bool = False, num_layers: int = 44) -> KVLayout:
    """examples/dsv4_cache.py geometry (168 planes at 44 layers); packed: each group's layers of one
    block in one per-block allocation, every layer an as_strided view (vLLM PR 44577)."""
    names = dsv4_cache.GROUP_NAMES
    layers = {layer: dsv4_cache.layer_caches(layer) for layer in range(num_layers)}
    nb, page = {}, {}
    for n in names:
        spec, row_bytes, _, align = dsv4_cache.GROUPS[n]
        nb[n] = -(-capacity_tokens // spec.block_size) + 1
        page[n] = -(-spec.rows_per_block * row_bytes // align) * align
    members = {n: [layer for layer, caches in layers.items() if n in caches] for n in names}
    packed_backing = {n: torch.empty(nb[n] * page[n] * len(members[n]), dtype=torch.uint8, device=DEVICE) for n in names} if packed else {}
    kv, layer_groups = {}, {}
    for layer, caches in layers.items():
        for n in caches:
            spec, row_bytes, dtype, _ = dsv4_cache.GROUPS[n]
            elem = torch.empty(0, dtype=dtype).element_size()
            shape = (nb[n], spec.rows_per_block, row_bytes // elem)
            if packed:
                block_stride = page[n] * len(members[n]) // elem
                offset = members[n].index(layer) * page[n] // elem
                view = torch.as_strided(packed_backing[n].view(dtype), shape, (block_stride, row_bytes // elem, 1), offset)
            else:
                backing = torch.empty(nb[n] * page[n] // elem, dtype=dtype, device=DEVICE)
                view = torch.as_strided(backing, shape, (page[n] // elem, row_bytes // elem, 1))
            kv[f"layers.{layer}.{n}"] = view
            layer_groups[f"layers.{layer}.{n}"] = names.index(n)
    groups = [dsv4_cache.GROUPS[n][0] for n in names]
    return KVLayout.from_tensors(kv, groups=groups, layer_groups=layer_groups, model_name="dsv4-flash-like")


LAYOUTS = {
    "llama8b": ("Llama-8B-like GQA", llama8b),
    "dsv3_mla": ("DeepSeek-V3 MLA", dsv3_mla),
    "dsv4_flash": ("DeepSeek-V4-Flash", dsv4_flash),
    "dsv4_packed": ("DeepSeek-V4-Flash, per-block packed", lambda t: dsv4_flash(t, packed=True)),
}


def randomize(layout: KVLayout) -> None:
    seen = set()
    for t in layout.tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,)).random_(0, 256)


# ---------------------------------------------------------------------------------------
# tables


class Job:
    """Store and load tables of ``num_tokens`` tokens at buffer offset ``base`` (chunk slots)."""

    def __init__(self, layout: KVLayout, num_tokens: int, block_ids: list, base: int) -> None:
        chunks = [Chunk(i, i * CHUNK, (i + 1) * CHUNK, ChunkKey(i.to_bytes(16, "little"))) for i in range(num_tokens // CHUNK)]
        tables = BlockTables.of(layout, block_ids)
        plans = plan_store(layout, chunks, tables)
        slot_bytes = max_chunk_payload_bytes(layout, CHUNK)
        offsets = [base + i * slot_bytes for i in range(len(plans))]
        self.store = store_segments(layout, plans, offsets).build()
        headers = [ChunkHeader(fingerprint=b"\0" * 16, key=p.chunk.key, token_start=p.chunk.start, token_end=p.chunk.end,
                               group_mask=p.group_mask, plane_rows=p.plane_rows, payload_bytes=p.payload_bytes) for p in plans]
        self.load = retrieve_segments(layout, chunks, headers, offsets, num_tokens, tables).build()
        self.store_bytes = self.store.payload_bytes(layout)
        self.load_bytes = self.load.payload_bytes(layout)
        self.span_bytes = slot_bytes * len(plans)


def block_ids(layout: KVLayout, num_tokens: int, gen: torch.Generator, skip_blocks: int = 0) -> list:
    out = []
    for g, group in enumerate(layout.groups):
        n = -(-num_tokens // group.block_size)
        perm = torch.randperm(layout.group_num_blocks(g), generator=gen)
        out.append(perm[skip_blocks * n : (skip_blocks + 1) * n].tolist())
    return out


# ---------------------------------------------------------------------------------------
# timing


def wall(fn, repeats: int) -> float:
    """Median seconds of a synchronous call (one warm-up)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def memcpy_limit(nbytes: int, repeats: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty_like(dev)
    for _ in range(3):  # bring the link and clocks up before timing
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
    d2h = nbytes / wall(lambda: host.copy_(dev, non_blocking=True), repeats) / GB
    h2d = nbytes / wall(lambda: dev.copy_(host, non_blocking=True), repeats) / GB
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    bidir = 2 * nbytes / wall(both, repeats) / GB
    del dev, dev2, host, host2
    return {"d2h": d2h, "h2d": h2d, "bidir": bidir}


def gpu_seconds(fn_async, repeats: int) -> float:
    """Median device time of one queued call: the stream is kept busy (a spin kernel) while the
    host plans, so the events bracket only the device work (op table read, launch, copy)."""
    samples = []
    for _ in range(max(repeats, 3) + 1):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn_async()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(samples[1:])


def kernel_ceiling(buf: torch.Tensor, repeats: int, tuning=None) -> dict:
    """The kernel on one contiguous 1 GiB run: its rate with no row structure at all."""
    nbytes = 1 << 30
    t = torch.empty(1, 1, nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    layout = KVLayout.from_tensors({"x": t}, groups=[GroupSpec(block_size=1)])
    builder = SegmentBuilder()
    so = builder.add_slots(np.zeros(1, np.int64))
    builder.add_segments(np.array([0]), np.array([1]), np.array([so]), np.array([0]))
    tables = builder.build()
    out = {}
    for d in ("gather", "scatter"):
        out[d] = nbytes / wall(lambda: cuda_path.run(d, layout, tables, buf, tuning=tuning), repeats) / GB
        out[d + "_gpu"] = nbytes / gpu_seconds(lambda: cuda_path.run_async(d, layout, tables, buf, tuning=tuning), repeats) / GB
    del t, layout
    torch.cuda.empty_cache()
    return out


def fixed_overhead(buf: torch.Tensor, repeats: int) -> dict:
    """Microseconds of a 16-byte transfer: what every call costs besides its bytes."""
    t = torch.empty(4, 1, 16, dtype=torch.uint8, device="cuda")
    layout = KVLayout.from_tensors({"x": t}, groups=[GroupSpec(block_size=1)])
    builder = SegmentBuilder()
    so = builder.add_slots(np.array([2], np.int64))
    builder.add_segments(np.array([0]), np.array([1]), np.array([so]), np.array([0]))
    tables = builder.build()
    planes = plane_table(layout)
    n = 20 * repeats

    def per_call(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    k = cuda_kernels()
    return {
        "transfer.gather": per_call(lambda: dispatch.gather(layout, tables, buf)),
        "cuda.run": per_call(lambda: cuda_path.run("gather", layout, tables, buf)),
        "C++ call": per_call(lambda: k.gather(planes, tables.segments, tables.slots, buf.data_ptr(), buf.numel(), 0, 0, True)),
        "C++ queued (no wait)": per_call(lambda: k.gather(planes, tables.segments, tables.slots, buf.data_ptr(), buf.numel(), 0, 0, False)),
        "device time": gpu_seconds(lambda: cuda_path.run_async("gather", layout, tables, buf), repeats) * 1e6,
    }


def pipelined(fn, calls: int) -> float:
    """Seconds per call when ``calls`` async calls are queued back to back."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


# ---------------------------------------------------------------------------------------
# baselines


class TorchBaselines:
    """Per-plane index tensors for the staged and naive torch paths (built outside the timing)."""

    def __init__(self, layout: KVLayout, tables) -> None:
        self.layout, self.views = layout, byte_views(layout)
        per_plane: dict[int, list] = {}
        slots = torch.from_numpy(tables.slots)
        for plane, n, so, _ in tables.segments.tolist():
            per_plane.setdefault(plane, []).append(slots[so : so + n])
        self.items, offset = [], 0
        for plane, parts in sorted(per_plane.items()):
            s = torch.cat(parts).to(layout.device)
            rpb, rb = layout.planes[plane].rows_per_block, layout.planes[plane].row_bytes
            self.items.append((plane, s // rpb, s % rpb, offset, len(s) * rb))
            offset += len(s) * rb
        self.nbytes = offset
        self.staging = torch.empty(offset, dtype=torch.uint8, device=layout.device)

    def staged_store(self, buf):
        for plane, blocks, rows, off, nb in self.items:
            self.staging[off : off + nb].view(len(blocks), -1).copy_(self.views[plane][blocks, rows])
        buf[: self.nbytes].copy_(self.staging, non_blocking=True)

    def staged_load(self, buf):
        self.staging.copy_(buf[: self.nbytes], non_blocking=True)
        for plane, blocks, rows, off, nb in self.items:
            self.views[plane].index_put_((blocks, rows), self.staging[off : off + nb].view(len(blocks), -1))

    def naive_store(self, buf):
        for plane, blocks, rows, off, nb in self.items:
            buf[off : off + nb].view(len(blocks), -1).copy_(self.views[plane][blocks, rows])

    def naive_load(self, buf):
        for plane, blocks, rows, off, nb in self.items:
            self.views[plane].index_put_((blocks, rows), buf[off : off + nb].view(len(blocks), -1).to(self.layout.device))


# ---------------------------------------------------------------------------------------
# the table


class Route:
    """One way of moving a job: ``call(direction, layout, tables, buf, stream=None)`` returns when the
    bytes landed; ``queue`` (None where the route has no asynchronous form) returns once queued."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name in CUDA_ROUTES:
            tuning = CUDA_ROUTES[name]
            self.call = lambda d, layout, tables, buf, stream=None: cuda_path.run(d, layout, tables, buf, stream, tuning=tuning)
            self.queue = lambda d, layout, tables, buf, stream=None: cuda_path.run_async(d, layout, tables, buf, stream, tuning=tuning)
        elif name in TRITON_ROUTES:
            tuning = TRITON_ROUTES[name]
            self.call = lambda d, layout, tables, buf, stream=None: getattr(dispatch, d)(
                layout, tables, buf, backend="triton", triton_tuning=tuning)
            self.queue = None
        elif name == "torch":
            self.call = lambda d, layout, tables, buf, stream=None: getattr(dispatch, d)(layout, tables, buf, backend="torch")
            self.queue = None
        else:
            raise SystemExit(f"unknown route {name!r} (one of {', '.join(ALL_ROUTES)})")


def bench_case(name: str, tokens: int, buf: torch.Tensor, limit: dict, repeats: int, baselines: bool, route: Route) -> dict:
    layout = LAYOUTS[name][1](tokens)
    randomize(layout)
    gen = torch.Generator().manual_seed(tokens)
    job = Job(layout, tokens, block_ids(layout, tokens, gen), 0)
    assert job.span_bytes <= buf.numel(), "pinned buffer too small"
    reps = repeats if tokens <= 8192 else max(2, repeats // 2)
    if route.name == "torch" and len(layout.planes) > 100 and tokens > 8192:
        reps = 1  # one indexing op per plane and segment: minutes at 64K tokens
    r = {"layout": name, "tokens": tokens, "planes": len(layout.planes), "store_MB": job.store_bytes / 1e6,
         "load_MB": job.load_bytes / 1e6, "store_segments": len(job.store.segments)}
    st = lambda: route.call("gather", layout, job.store, buf)  # noqa: E731
    ld = lambda: route.call("scatter", layout, job.load, buf)  # noqa: E731
    r["store"] = job.store_bytes / wall(st, reps) / GB
    r["load"] = job.load_bytes / wall(ld, reps) / GB
    if route.queue is not None:
        q = route.queue
        calls = max(3, min(50, int(2e9 // max(job.store_bytes, 1))))
        r["store_pipe"] = job.store_bytes / pipelined(lambda: q("gather", layout, job.store, buf), calls) / GB
        r["load_pipe"] = job.load_bytes / pipelined(lambda: q("scatter", layout, job.load, buf), calls) / GB
        r["store_gpu"] = job.store_bytes / gpu_seconds(lambda: q("gather", layout, job.store, buf), reps) / GB
        r["load_gpu"] = job.load_bytes / gpu_seconds(lambda: q("scatter", layout, job.load, buf), reps) / GB
    if route.name in CUDA_ROUTES:
        r["store_ops"] = route.call("gather", layout, job.store, buf)
    if baselines:
        torch_reps = max(2, reps // 2)
        b = TorchBaselines(layout, job.store)
        r["staged_store"] = b.nbytes / wall(lambda: b.staged_store(buf), torch_reps) / GB
        r["naive_store"] = b.nbytes / wall(lambda: b.naive_store(buf), 1 if tokens > 8192 else torch_reps) / GB
        b = TorchBaselines(layout, job.load)
        r["staged_load"] = b.nbytes / wall(lambda: b.staged_load(buf), torch_reps) / GB
        r["naive_load"] = b.nbytes / wall(lambda: b.naive_load(buf), 1 if tokens > 8192 else torch_reps) / GB
        del b
    for k in ("store", "store_pipe", "store_gpu", "staged_store", "naive_store"):
        if k in r:
            r[k + "_ratio"] = r[k] / limit["d2h"]
    for k in ("load", "load_pipe", "load_gpu", "staged_load", "naive_load"):
        if k in r:
            r[k + "_ratio"] = r[k] / limit["h2d"]
    del layout
    torch.cuda.empty_cache()
    return r


def bench_bidirectional(name: str, tokens: int, buf: torch.Tensor, repeats: int, route: Route) -> dict:
    """Store job A on one stream while job B (other blocks, other buffer half) loads on another."""
    layout = LAYOUTS[name][1](2 * tokens)
    randomize(layout)
    gen = torch.Generator().manual_seed(1)
    a = Job(layout, tokens, block_ids(layout, tokens, gen, 0), 0)
    b = Job(layout, tokens, block_ids(layout, tokens, gen, 1), a.span_bytes)
    assert a.span_bytes + b.span_bytes <= buf.numel()
    # Load B's full stored rows (the reverse of its store) so both directions move equal bytes.
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        route.queue("gather", layout, a.store, buf, s1)
        route.queue("scatter", layout, b.store, buf, s2)

    seconds = wall(both, repeats)
    calls = max(3, min(20, int(2e9 // a.store_bytes)))
    pipe = pipelined(both, calls)
    out = {"layout": name, "tokens": tokens, "bytes": a.store_bytes + b.store_bytes,
           "combined": (a.store_bytes + b.store_bytes) / seconds / GB,
           "combined_pipe": (a.store_bytes + b.store_bytes) / pipe / GB}
    del layout
    torch.cuda.empty_cache()
    return out


CUDA_ROUTES = {"kernel": cuda_path.DEFAULT_TUNING, "staged": cuda_path.route_tuning("staged")}
TRITON_ROUTES = {"triton": triton_launch.TritonTuning(staged=False), "triton_staged": triton_launch.TritonTuning(staged=True)}
ALL_ROUTES = (*CUDA_ROUTES, *TRITON_ROUTES, "torch")


def dry_run(names: list, routes: list) -> None:
    """No GPU: every layout at one chunk on CPU tensors, each route that runs on CPU (Triton in its
    interpreter, both ways; the torch path) checked byte for byte against the torch path. Exercises
    the layouts, the job tables and the route plumbing; times nothing."""
    global DEVICE
    DEVICE = "cpu"
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are first imported
    runnable = [r for r in routes if r in TRITON_ROUTES or r == "torch"]
    print(f"dry run on CPU (no GPU): routes {', '.join(runnable)}; skipped: {', '.join(set(routes) - set(runnable)) or '-'}")
    if any(r in TRITON_ROUTES for r in runnable) and not triton_launch.available("cpu"):
        raise SystemExit("the Triton routes need triton installed (pip install triton==3.8.0)")
    for name in names:
        layout = LAYOUTS[name][1](CHUNK)
        randomize(layout)
        job = Job(layout, CHUNK, block_ids(layout, CHUNK, torch.Generator().manual_seed(0)), 0)
        want = torch.zeros(job.span_bytes, dtype=torch.uint8)
        dispatch.gather(layout, job.store, want, backend="torch")
        for rname in runnable:
            route = Route(rname)
            got = torch.zeros_like(want)
            t0 = time.perf_counter()
            route.call("gather", layout, job.store, got)
            route.call("scatter", layout, job.store, got)  # writes back the very bytes it read
            seconds = time.perf_counter() - t0
            again = torch.zeros_like(want)
            dispatch.gather(layout, job.store, again, backend="torch")
            ok = torch.equal(got, want) and torch.equal(again, want)
            print(f"  {name:<12} {len(layout.planes):>4} planes {job.store_bytes / 1e6:7.2f} MB  {rname:<14} "
                  f"{'bytes equal the torch path' if ok else 'BYTES DIFFER'} ({seconds:.1f} s on CPU, not a measurement)")
            if not ok:
                raise SystemExit(1)
        del layout


def sweep(buf: torch.Tensor, limit: dict, repeats: int) -> list:
    """Launch shapes and copy methods on a few cases; returns rows for a table."""
    K = cuda_path.KernelTuning
    shapes = [
        ("default", K()),
        ("op table copied", K(copy_op_table=True)),
        ("1 block/SM", K(blocks_per_sm=1)),
        ("rows (no merge)", K(merge_rows=False)),
        ("DMA batch", K(use_dma=True)),
        ("staged 1M..8M x2", K(staged=True)),
        ("staged 256K..4M x2", K(staged=True, first_piece_bytes=256 << 10, max_piece_bytes=4 << 20)),
        ("staged 1M..16M x3", K(staged=True, max_piece_bytes=16 << 20, staging_slots=3)),
        ("staged 4M..32M x2", K(staged=True, first_piece_bytes=4 << 20, max_piece_bytes=32 << 20)),
        ("staged 8 KB ops", K(staged=True, max_op_bytes=8192)),  # more warps per piece (HBM side)
    ]
    rows = []
    side = torch.cuda.Stream()  # DMA batches refuse the legacy default stream
    for name, tokens in [("llama8b", 8192), ("dsv3_mla", 256), ("dsv4_flash", 256), ("dsv4_packed", 8192)]:
        layout = LAYOUTS[name][1](tokens)
        randomize(layout)
        job = Job(layout, tokens, block_ids(layout, tokens, torch.Generator().manual_seed(5)), 0)
        for label, t in shapes:
            with torch.cuda.stream(side):
                st = job.store_bytes / wall(lambda: cuda_path.run("gather", layout, job.store, buf, side, tuning=t), repeats) / GB
                ld = job.load_bytes / wall(lambda: cuda_path.run("scatter", layout, job.load, buf, side, tuning=t), repeats) / GB
            rows.append({"case": f"{name} {tokens}", "shape": label, "store": st, "load": ld})
            print(f"  sweep {name:<12}{tokens:>6} {label:<16} store {st:6.2f} ({st / limit['d2h']:.3f})  load {ld:6.2f} ({ld / limit['h2d']:.3f})", flush=True)
        del layout
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256,8192,65536")
    parser.add_argument("--layouts", default="llama8b,dsv3_mla,dsv4_flash")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--routes", default="kernel,staged,triton,triton_staged,torch",
                        help="routes to measure: kernel, staged (the CUDA kernel), triton, triton_staged (the Triton route), "
                             "torch (kvconnect's torch path)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: check the setup and the CPU-runnable routes at one chunk")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch shapes, staged piece sizes and merge/row/DMA")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    names = args.layouts.split(",")
    routes = args.routes.split(",")
    for r in routes:
        Route(r)  # unknown names fail before anything is allocated
    if args.dry_run:
        dry_run(names, routes)
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run to check the setup without one)")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"kvconnect CUDA runtime {cuda_kernels().cuda_runtime_version}, tuning {cuda_path.DEFAULT_TUNING}", flush=True)
    limit = memcpy_limit(1 << 30, args.repeats)
    print(f"pinned memcpy limit (1 GiB): D2H {limit['d2h']:.2f} GB/s, H2D {limit['h2d']:.2f} GB/s, both at once {limit['bidir']:.2f} GB/s", flush=True)

    need = 0
    for name in names:
        for tokens in sizes:
            need = max(need, max_chunk_payload_bytes(LAYOUTS[name][1](CHUNK), CHUNK) * (tokens // CHUNK))
            torch.cuda.empty_cache()
    t0 = time.perf_counter()
    buf = torch.empty(max(need, 2 << 30), dtype=torch.uint8, pin_memory=True)
    print(f"pinned pool {buf.numel() / 2**30:.2f} GiB allocated in {time.perf_counter() - t0:.1f} s", flush=True)

    results = {"device": props.name, "limit": limit, "cases": [], "bidir": [], "sweep": []}
    results["overhead_us"] = fixed_overhead(buf, args.repeats)
    print("fixed cost of one 16-byte transfer (us): " + ", ".join(f"{k} {v:.1f}" for k, v in results["overhead_us"].items()), flush=True)
    results["ceiling"] = {route: kernel_ceiling(buf, args.repeats, CUDA_ROUTES[route]) for route in routes if route in CUDA_ROUTES}
    for route, c in results["ceiling"].items():
        print(f"{route} on one contiguous 1 GiB run: store {c['gather']:.2f} GB/s ({c['gather'] / limit['d2h']:.3f}; device time "
              f"{c['gather_gpu']:.2f}), load {c['scatter']:.2f} ({c['scatter'] / limit['h2d']:.3f}; device time {c['scatter_gpu']:.2f})", flush=True)
    if args.sweep:
        results["sweep"] = sweep(buf, limit, args.repeats)
    cases = [(name, tokens, i, route) for name in names for tokens in sizes for i, route in enumerate(routes)]
    for name, tokens, i, route in tqdm(cases, desc="cases", unit="case", leave=False):  # torch baselines once per case
        r = bench_case(name, tokens, buf, limit, args.repeats, i == 0 and not args.no_baselines, Route(route))
        r["route"] = route
        results["cases"].append(r)
        tqdm.write("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    bidir = [(n, r) for n in names for r in routes if Route(r).queue is not None]
    for name, route in tqdm(bidir, desc="both directions", unit="case", leave=False):
        r = bench_bidirectional(name, 8192, buf, args.repeats, Route(route))
        r["route"] = route
        results["bidir"].append(r)
        tqdm.write("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    again = memcpy_limit(1 << 30, args.repeats)
    print(f"pinned memcpy limit again: D2H {again['d2h']:.2f}, H2D {again['h2d']:.2f}, both {again['bidir']:.2f} GB/s; ratios use the higher", flush=True)
    limit = {k: max(limit[k], again[k]) for k in limit}
    results["limit"], results["limit_first"], results["limit_last"] = limit, results["limit"], again
    for r in results["cases"] + results["sweep"]:
        for k in [k for k in r if k.startswith(("store", "staged_store", "naive_store")) and not k.endswith(("_ratio", "_MB", "_segments", "_ops"))]:
            r[k + "_ratio"] = r[k] / limit["d2h"]
        for k in [k for k in r if k.startswith(("load", "staged_load", "naive_load")) and not k.endswith(("_ratio", "_MB"))]:
            r[k + "_ratio"] = r[k] / limit["h2d"]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if results["sweep"]:
        print("\nlaunch shapes and copy methods, GB/s (ratio):")
        for r in results["sweep"]:
            print(f"  {r['case']:<18}{r['shape']:<18} store {r['store']:6.2f} ({r['store_ratio']:.3f})  load {r['load']:6.2f} ({r['load_ratio']:.3f})")

    print()
    for route, c in results["ceiling"].items():
        print(f"{route} on one contiguous 1 GiB run: store {c['gather']:.2f} ({c['gather'] / limit['d2h']:.3f}), device time {c['gather_gpu']:.2f} "
              f"({c['gather_gpu'] / limit['d2h']:.3f}); load {c['scatter']:.2f} ({c['scatter'] / limit['h2d']:.3f}), device time "
              f"{c['scatter_gpu']:.2f} ({c['scatter_gpu'] / limit['h2d']:.3f})")
    print(f"\n{props.name}; limit D2H {limit['d2h']:.1f} / H2D {limit['h2d']:.1f} GB/s (1 GiB pinned memcpy); GB/s (ratio to the limit)")
    head = (f"{'layout':<12}{'tokens':>7}{'route':>14}{'MB st/ld':>14}{'store':>15}{'load':>15}{'store pipe':>15}{'load pipe':>15}"
            f"{'store dev':>15}{'load dev':>15}{'torch staged st/ld':>22}{'naive st/ld':>16}")
    print(head)
    for r in results["cases"]:
        fmt = lambda k: f"{r[k]:6.2f} ({r[k + '_ratio']:.3f})" if k in r else "-"  # noqa: E731
        base = f"{r['staged_store']:6.1f}/{r['staged_load']:5.1f}" if "staged_store" in r else "-"
        naive = f"{r['naive_store']:6.2f}/{r['naive_load']:5.2f}" if "naive_store" in r else "-"
        print(f"{r['layout']:<12}{r['tokens']:>7}{r['route']:>14}{r['store_MB']:>7.0f}/{r['load_MB']:<6.0f}{fmt('store'):>15}{fmt('load'):>15}"
              f"{fmt('store_pipe'):>15}{fmt('load_pipe'):>15}{fmt('store_gpu'):>15}{fmt('load_gpu'):>15}{base:>22}{naive:>16}")
    by_case = {}
    for r in results["cases"]:
        by_case.setdefault((r["layout"], r["tokens"]), {})[r["route"]] = r
    for (layout_name, tokens), rs in by_case.items():
        if "torch" in rs:
            gaps = [f"{route} {rs[route]['store'] / rs['torch']['store']:.1f}x store, {rs[route]['load'] / rs['torch']['load']:.1f}x load"
                    for route in rs if route != "torch"]
            print(f"over kvconnect's torch path, {layout_name} {tokens} tokens ({rs['torch']['planes']} planes): " + "; ".join(gaps))
    for r in results["bidir"]:
        print(f"store + load at once, {r['route']}, {r['layout']} {r['tokens']} tokens: {r['combined']:.1f} GB/s combined "
              f"({r['combined_pipe']:.1f} pipelined; memcpy both ways {limit['bidir']:.1f})")


if __name__ == "__main__":
    main()
