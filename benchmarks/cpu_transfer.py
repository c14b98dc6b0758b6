"""CPU transfer benchmark: kvconnect's compiled kernel vs a plain memcpy vs the torch path.

For each layout (Llama-8B-like GQA, DeepSeek-V3 MLA, DeepSeek-V4-Flash) it plans a store of
``--tokens`` tokens with random block tables, then times, side by side in one run:
- memcpy: one contiguous copy of the same number of bytes (the machine's limit),
- kvconnect gather (store: paged -> pool) and scatter (load: pool -> paged),
- the torch implementation of the same contract (kvconnect.transfer.torch_impl).
It also times the prefix hash chain and a full restore-gated lookup for a 128K-token prompt.

Run: python benchmarks/cpu_transfer.py [--tokens 8192] [--threads N] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from layouts import LAYOUTS, full_block_tables

from kvconnect import Config, GroupSpec, KVCacheEngine, KVLayout
from kvconnect.restore.plan import BlockTables, plan_store, retrieve_segments, store_segments
from kvconnect.transfer import dispatch


def best_of(fn, repeats: int) -> float:
    fn()  # warm: page faults, thread pool start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_layout(name: str, num_tokens: int, threads: int, repeats: int, chunk_tokens: int) -> dict:
    layout: KVLayout = LAYOUTS[name](num_tokens)
    for t in layout.tensors:
        t.view(torch.uint8).random_() if t.is_contiguous() else None
    engine = KVCacheEngine(layout, Config(chunk_size=chunk_tokens, max_local_cpu_size=0.001, num_threads=threads))
    tables = BlockTables.of(layout, full_block_tables(layout, num_tokens))
    chunks = engine.chunks(np.arange(num_tokens), include_partial=False)
    plans = plan_store(layout, chunks, tables)
    slot_bytes = max(p.payload_bytes for p in plans)  # whole-chunk plans: with split parts the engine's slot holds a part
    buffer = torch.zeros(slot_bytes * len(plans), dtype=torch.uint8)
    offsets = [i * slot_bytes for i in range(len(plans))]
    store_tables = store_segments(layout, plans, offsets).build()
    nbytes = store_tables.payload_bytes(layout)
    headers = [_header(p) for p in plans]
    load_tables = retrieve_segments(layout, chunks, headers, offsets, num_tokens, tables).build()
    load_bytes = load_tables.payload_bytes(layout)  # windowed groups load only their window at P

    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    out = {"layout": name, "planes": len(layout.planes), "MB": nbytes / 1e6, "load_MB": load_bytes / 1e6,
           "segments": len(store_tables.segments)}
    out["memcpy"] = nbytes / best_of(lambda: dst.copy_(src), repeats) / 1e9
    out["store"] = nbytes / best_of(lambda: dispatch.gather(layout, store_tables, buffer, backend="cpu", num_threads=threads), repeats) / 1e9
    out["load"] = load_bytes / best_of(lambda: dispatch.scatter(layout, load_tables, buffer, backend="cpu", num_threads=threads), repeats) / 1e9
    torch_repeats = max(1, repeats // 2)
    out["torch_store"] = nbytes / best_of(lambda: dispatch.gather(layout, store_tables, buffer, backend="torch"), torch_repeats) / 1e9
    out["torch_load"] = load_bytes / best_of(lambda: dispatch.scatter(layout, load_tables, buffer, backend="torch"), torch_repeats) / 1e9
    return out


def _header(plan):
    from kvconnect.chunks.chunk_format import ChunkHeader

    return ChunkHeader(fingerprint=b"\0" * 16, key=plan.chunk.key, token_start=plan.chunk.start, token_end=plan.chunk.end,
                       group_mask=plan.group_mask, plane_rows=plan.plane_rows, payload_bytes=plan.payload_bytes)


def bench_lookup(num_tokens: int, chunk_tokens: int, repeats: int) -> dict:
    """Hash + restore-gated lookup of a fully stored 128K-token prompt (a tiny one-plane layout)."""
    kv = {"l0": torch.zeros(num_tokens // 16 + 1, 16, 8, dtype=torch.uint8)}
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=16)])
    engine = KVCacheEngine(layout, Config(chunk_size=chunk_tokens, max_local_cpu_size=0.01))
    tokens = torch.randint(0, 150000, (num_tokens,), dtype=torch.int64)
    assert engine.store(tokens, list(range(num_tokens // 16))) == num_tokens
    tok_np = tokens.numpy()
    samples = []
    for _ in range(repeats * 4):
        t0 = time.perf_counter()
        hit = engine.lookup(tok_np)
        samples.append(time.perf_counter() - t0)
    assert hit == num_tokens
    hash_s = best_of(lambda: engine.chunks(tok_np, include_partial=True), repeats)
    return {"tokens": num_tokens, "hash_ms": hash_s * 1e3, "lookup_p50_ms": statistics.median(samples) * 1e3,
            "lookup_min_ms": min(samples) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dsv4-tokens", type=int, default=4096, help="DSv4 state groups are large: fewer tokens")
    parser.add_argument("--threads", type=int, default=Config().num_threads)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--layouts", default="llama8b,dsv3_mla,dsv4_flash")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.threads} kernel threads, chunk {args.chunk_size} tokens; best of {args.repeats}")
    print(f"{'layout':<12}{'planes':>7}{'segments':>9}{'MB st':>8}{'MB ld':>8}{'memcpy':>8}{'store':>8}{'load':>8}"
          f"{'st/mc':>7}{'ld/mc':>7}{'torch st':>9}{'torch ld':>9}{'st/torch':>9}{'ld/torch':>9}   (GB/s)")
    for name in tqdm(args.layouts.split(","), desc="layouts", unit="layout", leave=False):
        tokens = args.dsv4_tokens if name == "dsv4_flash" else args.tokens
        r = bench_layout(name, tokens, args.threads, args.repeats, args.chunk_size)
        tqdm.write(f"{name:<12}{r['planes']:>7}{r['segments']:>9}{r['MB']:>8.1f}{r['load_MB']:>8.1f}{r['memcpy']:>8.2f}{r['store']:>8.2f}{r['load']:>8.2f}"
              f"{r['store'] / r['memcpy']:>7.2f}{r['load'] / r['memcpy']:>7.2f}{r['torch_store']:>9.2f}{r['torch_load']:>9.2f}"
              f"{r['store'] / r['torch_store']:>9.1f}{r['load'] / r['torch_load']:>9.1f}")
    lk = bench_lookup(131072, args.chunk_size, args.repeats)
    print(f"\nprefix hash of {lk['tokens']} tokens: {lk['hash_ms']:.2f} ms; restore-gated lookup (hash + index + gate): "
          f"p50 {lk['lookup_p50_ms']:.2f} ms, best {lk['lookup_min_ms']:.2f} ms")


if __name__ == "__main__":
    main()
