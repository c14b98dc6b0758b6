"""Stores into a fresh CPU pool with and without the background prefault (KVCONNECT_POOL_PREFAULT).

    python benchmarks/pool_prefault.py [--pool-gb 2] [--reps 30]

A Llama-like layout (8 layers, 2 KV heads x 64, bf16, block 128): each rep stores one
2048-token prompt (8 chunks of 1 MiB) into slots the pool has not used yet, as a filling pool
does under traffic. Prints the median store time per prompt for an untouched pool and for a
pool whose prefault finished first, and how long the prefault took (it runs in the
background; the engine does not wait for it). Same process, same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch

from kvconnect import Config, GroupSpec, KVLayout
from kvconnect.engine import KVCacheEngine


def run(layout: KVLayout, pool_gb: float, prefault: bool, reps: int) -> tuple[float, float]:
    engine = KVCacheEngine(layout, Config(chunk_size=256, max_local_cpu_size=pool_gb, pool_prefault=prefault))
    engine.store_threads = 1
    try:
        waited = 0.0
        if engine.pool.prefault is not None:
            start = time.perf_counter()
            engine.pool.prefault.join()
            waited = time.perf_counter() - start
        times = []
        for r in range(reps):
            tokens = np.arange(2048, dtype=np.int64) + 100_000 * r
            start = time.perf_counter()
            engine.store(tokens, [list(range(1 + 16 * (r % 10), 17 + 16 * (r % 10)))])
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3, waited
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-gb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    kv = {f"l{i}": torch.randn(256, 2, 128, 2, 64).to(torch.bfloat16) for i in range(8)}
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=128)])
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}")
    cold, _ = run(layout, args.pool_gb, False, args.reps)
    warm, waited = run(layout, args.pool_gb, True, args.reps)
    print(f"store of a 2048-token prompt (8 MiB) into new slots, median of {args.reps}:")
    print(f"  untouched pool      {cold:7.2f} ms")
    print(f"  prefaulted pool     {warm:7.2f} ms  ({cold / warm:.1f}x faster; prefault of {args.pool_gb} GB took {waited:.2f} s "
          "in the background)")


if __name__ == "__main__":
    main()
