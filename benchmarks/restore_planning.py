"""Where a store's and a retrieve's time goes per chunk, without the copy (issue 41 item 8).

    python benchmarks/restore_planning.py [--preset deepseek-v4-flash] [--tokens 4096] [--repeats 31]

On a preset's real layout (the CLI's, all layers; caches of random bytes), a prompt of
``--tokens`` stored with restore points as the engine stores it. Each row is the median over
``--repeats`` runs of the calling thread's CPU time (``time.thread_time``: other jobs on a
shared machine do not add to it), per chunk of the prompt:

- ``plan_store`` (prefix parts), ``store_segments`` (the gather's tables): the store's planning;
- ``retrieve_part_segments`` over the pinned parts: the retrieve's planning (checks included);
- ``engine.store`` / ``engine.retrieve`` less their transfer kernel: the whole per-chunk work
  (keys, planning, the pool's bookkeeping, headers), what ``kvconnect bench`` reports.

Prints a markdown table (docs/performance.md, "Per-chunk work").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvconnect import sizing
from kvconnect.cli.model_args import model_of
from kvconnect.config import GB, Config
from kvconnect.engine import KVCacheEngine
from kvconnect.restore import plan as planning


def cpu_median(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        c0 = time.thread_time()
        fn()
        out.append(time.thread_time() - c0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="deepseek-v4-flash")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args()
    ns = argparse.Namespace(preset=args.preset, config=None, engine="vllm", block_size=None, tp=1, dcp=1, dcp_interleave=1,
                            kv_dtype=None, chunk_size=256)
    model = model_of(ns)
    layout = model.layout(args.tokens, device="cpu", fill=True)
    s = sizing.of(layout, 256)
    engine = KVCacheEngine(layout, Config(chunk_size=256, max_local_cpu_size=(s.pool_bytes(args.tokens) + s.slot_bytes) / GB,
                                          num_threads=1))
    try:
        tokens = np.arange(args.tokens, dtype=np.int64)
        ids = [list(range(n - 1)) for n in model.blocks_for(args.tokens)]
        layout = engine.layout  # with the engine's sliced planes
        tables = planning.BlockTables.of(layout, ids)
        chunks = engine._chunks(tokens, False, None, None)
        parts = engine.restore.parts
        n = len(chunks)
        rows = []
        plans = planning.plan_store(layout, chunks, tables, groups=parts.prefix_mask)
        rows.append(("plan_store (prefix parts)", cpu_median(lambda: planning.plan_store(layout, chunks, tables, groups=parts.prefix_mask), args.repeats)))
        offsets = [i * s.slot_bytes for i in range(n)]
        rows.append(("store_segments", cpu_median(lambda: planning.store_segments(layout, plans, offsets), args.repeats)))

        kernel = {"s": 0.0}

        def clocked(fn):
            def run(t):
                c0 = time.thread_time()
                fn(t)
                kernel["s"] += time.thread_time() - c0
            return run

        engine.restore.writer.gather = clocked(engine.restore.writer.gather)
        engine.restore.loader.scatter = clocked(engine.restore.loader.scatter)

        def without_kernel(fn, setup=None):
            out = []
            for _ in range(args.repeats):
                if setup:
                    setup()
                kernel["s"] = 0.0
                c0 = time.thread_time()
                fn()
                out.append(time.thread_time() - c0 - kernel["s"])
            return statistics.median(out)

        rows.append(("engine.store less the gather", without_kernel(lambda: engine.store(tokens, ids), engine.pool.clear)))
        engine.pool.clear()
        engine.store(tokens, ids)
        loaded = {}
        real = planning.retrieve_part_segments

        def spy(*a, **kw):
            loaded["args"], loaded["kw"] = a, kw
            return real(*a, **kw)

        from kvconnect.restore import reads  # the loader looks the function up there

        reads.retrieve_part_segments = spy
        try:
            engine.retrieve(tokens, ids)
        finally:
            reads.retrieve_part_segments = real
        a, kw = loaded["args"], loaded["kw"]
        rows.append(("retrieve_part_segments", cpu_median(lambda: real(*a, **kw), args.repeats)))
        rows.append(("engine.retrieve less the scatter", without_kernel(lambda: engine.retrieve(tokens, ids))))
    finally:
        engine.close()
    print(f"{args.preset}, {len(layout.planes)} planes, {args.tokens} tokens = {n} chunks of 256; median of {args.repeats} "
          "runs, CPU time of the calling thread")
    print("| part | ms per call | ms per chunk |")
    print("|---|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec * 1e3:.2f} | {sec * 1e3 / n:.3f} |")


if __name__ == "__main__":
    main()
