"""Reads across TP sizes (issue 40): what a mismatched read costs, and the share a mixed-TP fleet serves.

    python benchmarks/other_tp.py [--layers 4] [--reps 5] [--prompts 16]

A Llama-like layout (8 KV heads x 128, bf16, ``--layers`` layers, block 16, chunks of 256
tokens) split over TP ranks the way vLLM splits the heads; every rank is a ``KVCacheEngine``
over its own tensors, all on one disk tier directory (in /tmp).

1. Cost. TP 2's two ranks store a 2048-token prompt. Then, fresh engines each repetition
   (empty pools: every byte comes from the disk tier, the files in the page cache), the
   lookup + retrieve of: TP 2 rank 0 (its own objects: today's path), TP 1 (its 8 heads
   assembled from both TP 2 ranks' objects), TP 4 rank 0 (its 2 heads cut from TP 2 rank 0's).
2. Served share. ``--prompts`` prompts, each asked twice, in a random order, each request by a
   TP 1 or a TP 2 replica at random (one engine per rank, all on the disk tier): the share of
   the repeated requests' tokens restored from the cache, with reads across TP sizes off
   (``read_tp_sizes=""``: every TP size its own cache, as before issue 40) and on (default).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from kvconnect import Config, GroupSpec, KVLayout
from kvconnect.engine import KVCacheEngine
from kvconnect.layout.spec import TPShard

HEADS, HEAD_SIZE, BS, CHUNK, PROMPT = 8, 128, 16, 256, 2048


def rank_layout(layers: int, tp_rank: int, tp_size: int) -> KVLayout:
    shard = TPShard.of_kv_heads(HEADS, tp_rank=tp_rank, tp_size=tp_size)
    blocks = 2 * PROMPT // BS + 2
    kv = {f"layers.{i}": torch.randint(-100, 100, (2, blocks, BS, shard.count, HEAD_SIZE)).to(torch.bfloat16)
          for i in range(layers)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=BS)], layout_hints="kv_first", model_name="llama-like",
                                 tp_rank=tp_rank, tp_size=tp_size, group_shards=[shard])


def config(disk: str, **kw) -> Config:
    return Config(chunk_size=CHUNK, max_local_cpu_size=0.5, local_disk=disk, max_local_disk_size=4.0,
                  pool_prefault=False, num_threads=1, **kw)


def blocks(offset: int) -> list[list[int]]:
    return [list(range(1 + offset, 1 + offset + PROMPT // BS))]


def cost(layers: int, reps: int) -> None:
    disk = tempfile.mkdtemp(prefix="kvc-othertp-")
    tokens = np.arange(PROMPT, dtype=np.int64) + 5
    try:
        for r in range(2):
            e = KVCacheEngine(rank_layout(layers, r, 2), config(disk))
            e.store(tokens, blocks(0))
            e.close()
        for name, rank, size in (("TP 2 rank 0, own objects", 0, 2), ("TP 1, from both TP 2 ranks", 0, 1),
                                 ("TP 4 rank 0, from TP 2 rank 0", 0, 4)):
            times, assembled = [], 0
            for _ in range(reps):
                e = KVCacheEngine(rank_layout(layers, rank, size), config(disk))
                start = time.perf_counter()
                hit = e.lookup(tokens)
                got = e.retrieve(tokens, blocks(PROMPT // BS))
                times.append(time.perf_counter() - start)
                assembled = e.other_tp.assembled_chunks if e.other_tp else 0
                e.close()
                assert hit == got == PROMPT, (name, hit, got)
            mib = layers * PROMPT * 2 * HEAD_SIZE * 2 * TPShard.of_kv_heads(HEADS, tp_rank=rank, tp_size=size).count / (1 << 20)
            print(f"  {name:32s} {statistics.median(times) * 1e3:8.1f} ms  ({mib:.0f} MiB restored, "
                  f"{assembled} chunks assembled)")
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def served_share(layers: int, prompts: int, read_tp_sizes: str, seed: int = 0) -> float:
    disk = tempfile.mkdtemp(prefix="kvc-fleet-")
    rng = random.Random(seed)
    fleets = {1: [KVCacheEngine(rank_layout(layers, 0, 1), config(disk, read_tp_sizes=read_tp_sizes))],
              2: [KVCacheEngine(rank_layout(layers, r, 2), config(disk, read_tp_sizes=read_tp_sizes)) for r in range(2)]}
    order = [p for p in range(prompts) for _ in range(2)]
    rng.shuffle(order)
    seen, served, asked = set(), 0, 0
    try:
        for p in order:
            tokens = np.arange(PROMPT, dtype=np.int64) + 1000 * p
            ranks = fleets[rng.choice((1, 2))]
            hit = min(e.lookup(tokens) for e in ranks)  # a hit is the minimum over the ranks
            if p in seen:
                asked += PROMPT
                served += min(e.retrieve(tokens, blocks(PROMPT // BS)) for e in ranks) if hit else 0
            seen.add(p)
            for e in ranks:
                e.store(tokens, blocks(0))
                e.storage.flush()
    finally:
        for es in fleets.values():
            for e in es:
                e.close()
        shutil.rmtree(disk, ignore_errors=True)
    return served / asked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.layers} layers, 8 KV heads x 128 bf16, "
          f"{PROMPT}-token prompt, chunks of {CHUNK}")
    print("1. lookup + retrieve from the disk tier (fresh engine, median):")
    cost(args.layers, args.reps)
    print(f"2. served share of repeated requests, {args.prompts} prompts x 2, TP 1 or TP 2 at random:")
    for label, sizes in (("reads across TP sizes off (as before)", ""), ("reads across TP sizes on", "1,2,4,8")):
        print(f"  {label:40s} {served_share(args.layers, args.prompts, sizes):.2f}")


if __name__ == "__main__":
    main()
