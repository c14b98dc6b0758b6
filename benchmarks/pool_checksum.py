"""What the shared pool's checksums cost: store and first restore through a node cache server.

    python benchmarks/pool_checksum.py [--layers 16] [--reps 10]

A Llama-like layout (``--layers`` layers, 8 KV heads x 128, bf16, block 128, chunks of 256
tokens: 8 MiB per chunk at 16 layers) stores one 2048-token prompt into a cache server (a
thread of this process, ipc://) and restores it. ``commit`` computes each chunk's XXH3
checksum over the shared segment; ``acquire`` verifies it the first time this process reads
an entry. Prints, same process, same run, medians of ``--reps``:

- XXH3 over the prompt's bytes in the segment (the checksum alone);
- the store (gather + checksum + commit);
- a restore that verifies every entry (the verified-entry cache emptied before each) and one
  that finds them verified (what every later restore in that process costs).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

from kvconnect import Config, GroupSpec, KVLayout
from kvconnect.chunks.chunk_format import compute_checksum
from kvconnect.engine import KVCacheEngine
from kvconnect.server.server import CacheServer

PROMPT_TOKENS = 2048


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    kv = {f"l{i}": torch.randn(2 * PROMPT_TOKENS // 128, 2, 128, 8, 128).to(torch.bfloat16) for i in range(args.layers)}
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=128)])
    tokens = np.arange(PROMPT_TOKENS, dtype=np.int64)
    blocks = [list(range(PROMPT_TOKENS // 128))]
    restore_to = [list(range(PROMPT_TOKENS // 128, 2 * PROMPT_TOKENS // 128))]
    prompt_bytes = args.layers * 2 * PROMPT_TOKENS * 8 * 128 * 2
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}")
    with tempfile.TemporaryDirectory(prefix="kvc-", dir="/tmp") as d:
        server = CacheServer(f"ipc://{d}/kvc.sock", 4 * prompt_bytes + (64 << 20), page_bytes=1 << 20)
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        engine = KVCacheEngine(layout, Config(chunk_size=256, server_url=server.url, remote_timeout_s=30.0))
        try:
            engine.pool.prefaulted.wait(60)

            def store() -> None:
                engine.pool.clear()
                assert engine.store(tokens, blocks) == PROMPT_TOKENS

            store_ms = median_ms(store, args.reps)
            entries = [e for e in engine.pool.acquire([c.key for c in engine.chunks(tokens, include_partial=False)]) if e is not None]
            views = [engine.pool.entry_view(e).numpy() for e in entries]
            checksum_ms = median_ms(lambda: [compute_checksum(e.header, v) for e, v in zip(entries, views)], args.reps)
            engine.pool.release(entries)

            def restore(verify: bool) -> None:
                if verify:
                    engine.pool._verified.clear()  # what a process that never read these entries pays
                assert engine.retrieve(tokens, restore_to) == PROMPT_TOKENS

            verified_ms = median_ms(lambda: restore(True), args.reps)
            cached_ms = median_ms(lambda: restore(False), args.reps)
            assert engine.pool.counters["bad_checksums"] == 0
        finally:
            engine.close()
            stop.set()
            thread.join(timeout=10)
            server.close()
    mib = prompt_bytes / (1 << 20)
    print(f"{PROMPT_TOKENS}-token prompt, {len(entries)} chunks, {mib:.0f} MiB, median of {args.reps}:")
    print(f"  XXH3 over the prompt in the segment   {checksum_ms:7.2f} ms  ({prompt_bytes / checksum_ms / 1e6:.1f} GB/s)")
    print(f"  store (gather + checksum + commit)    {store_ms:7.2f} ms")
    print(f"  restore, every entry verified         {verified_ms:7.2f} ms")
    print(f"  restore, entries already verified     {cached_ms:7.2f} ms")


if __name__ == "__main__":
    main()
