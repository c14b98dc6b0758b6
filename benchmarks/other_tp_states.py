"""Gated DeltaNet states across TP sizes (issue 40): what a mismatched read of a hybrid prompt costs.

    python benchmarks/other_tp_states.py [--gdn-layers 12] [--attn-layers 4] [--reps 5]

A Qwen3-Next-like hybrid: ``--gdn-layers`` Gated DeltaNet layers of Qwen3-Next's dims (16 key and
32 value heads of 128, conv kernel 4: a state page per block of a (3, 8192) bf16 conv state and a
(32, 128, 128) fp32 recurrent state, 2.05 MiB at TP 1) and ``--attn-layers`` attention layers
(2 KV heads x 256, bf16), blocks and chunks of 512 tokens. Every rank is a ``KVCacheEngine`` over
its own tensors (its channels, value heads and KV heads as vLLM splits them), all on one disk
tier directory (in /tmp). TP 2's two ranks store a 2048-token prompt: four prefix parts per rank
(the attention rows) and one window part (every GDN layer's state page at 2048). Then, fresh
engines each repetition (empty pools: every byte from the disk tier, the files in the page
cache), the lookup + retrieve of: TP 2 rank 0 (its own objects: the matched path), TP 1 (its
pages assembled from both TP 2 ranks' window pieces, its heads from their prefix parts), TP 4
rank 0 (its quarter cut out of TP 2 rank 0's objects).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from kvconnect import Config, GroupSpec, KVLayout
from kvconnect.engine import KVCacheEngine
from kvconnect.layout.spec import GroupKind, ShardField, TPShard

KEY_HEADS, VALUE_HEADS, HEAD_DIM, STATE_LEN = 16, 32, 128, 3
KV_HEADS, ATTN_HEAD_DIM, BLOCK, PROMPT = 2, 256, 512, 2048
KEY_DIM, VALUE_DIM = KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM


def state_shard(tp_rank: int, tp_size: int) -> TPShard:
    """The page's fields as vLLM splits them (``recurrent.state_shard``, SD conv layout)."""
    conv = ShardField.even(outer=STATE_LEN, unit_bytes=2, blocks=(KEY_DIM, KEY_DIM, VALUE_DIM), tp_rank=tp_rank,
                           tp_size=tp_size)
    ssm = ShardField.even(outer=1, unit_bytes=HEAD_DIM * HEAD_DIM * 4, blocks=(VALUE_HEADS,), tp_rank=tp_rank,
                          tp_size=tp_size)
    return TPShard.ranges((conv, ssm))


def rank_layout(gdn: int, attn: int, tp_rank: int, tp_size: int) -> KVLayout:
    heads, states = TPShard.of_kv_heads(KV_HEADS, tp_rank=tp_rank, tp_size=tp_size), state_shard(tp_rank, tp_size)
    attn_blocks, state_blocks = 2 * PROMPT // BLOCK + 2, PROMPT // BLOCK + 2
    kv = {f"attn.{i}": torch.randint(-100, 100, (2, attn_blocks, BLOCK, heads.count, ATTN_HEAD_DIM)).to(torch.bfloat16)
          for i in range(attn)}
    kv.update({f"gdn.{i}": torch.randint(-100, 100, (state_blocks, 1, 1, states.row_bytes), dtype=torch.int8)
               for i in range(gdn)})
    groups = [GroupSpec(block_size=BLOCK), GroupSpec(block_size=BLOCK, kind=GroupKind.STATE)]
    return KVLayout.from_tensors(kv, groups=groups, layer_groups={n: int(n.startswith("gdn")) for n in kv},
                                 layout_hints={n: "kv_first" for n in kv if n.startswith("attn")},
                                 model_name="qwen3-next-like", tp_rank=tp_rank, tp_size=tp_size,
                                 group_shards=[heads, states])


def config(disk: str) -> Config:
    return Config(chunk_size=BLOCK, max_local_cpu_size=1.0, local_disk=disk, max_local_disk_size=4.0,
                  pool_prefault=False, num_threads=1)


def tables(offset: int) -> list[list[int]]:
    return [list(range(1 + offset, 1 + offset + PROMPT // BLOCK)), list(range(1, 1 + PROMPT // BLOCK))]


def restored_mib(layout: KVLayout, gdn: int) -> float:
    attn = sum(p.row_bytes for p in layout.planes if p.group_index == 0) * PROMPT
    return (attn + gdn * layout.shards[1].row_bytes) / (1 << 20)


def cost(gdn: int, attn: int, reps: int) -> None:
    disk = tempfile.mkdtemp(prefix="kvc-othertp-gdn-")
    tokens = np.arange(PROMPT, dtype=np.int64) + 5
    try:
        for r in range(2):
            e = KVCacheEngine(rank_layout(gdn, attn, r, 2), config(disk))
            assert e.store(tokens, tables(0)) == PROMPT
            e.close()
        for name, rank, size in (("TP 2 rank 0, own objects", 0, 2), ("TP 1, from both TP 2 ranks", 0, 1),
                                 ("TP 4 rank 0, from TP 2 rank 0", 0, 4)):
            times, parts = [], (0, 0)
            for _ in range(reps):
                e = KVCacheEngine(rank_layout(gdn, attn, rank, size), config(disk))
                start = time.perf_counter()
                hit = e.lookup(tokens)
                got = e.retrieve(tokens, tables(PROMPT // BLOCK))
                times.append(time.perf_counter() - start)
                if e.other_tp is not None:
                    parts = (e.other_tp.assembled_chunks, e.other_tp.assembled_window_parts)
                mib = restored_mib(e.layout, gdn)
                e.close()
                assert hit == got == PROMPT, (name, hit, got)
            print(f"  {name:32s} {statistics.median(times) * 1e3:8.1f} ms  ({mib:.1f} MiB restored, "
                  f"{parts[0]} prefix parts and {parts[1]} window part assembled)")
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gdn-layers", type=int, default=12)
    ap.add_argument("--attn-layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.gdn_layers} GDN layers (Qwen3-Next dims), "
          f"{args.attn_layers} attention layers, {PROMPT}-token prompt, blocks and chunks of {BLOCK}")
    print("lookup + retrieve from the disk tier (fresh engine, median):")
    cost(args.gdn_layers, args.attn_layers, args.reps)


if __name__ == "__main__":
    main()
