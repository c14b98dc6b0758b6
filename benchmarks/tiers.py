"""Storage tier benchmark: store / retrieve GB/s and lookup latency per tier, in one run.

Layout: DeepSeek-V3-like MLA on CPU (61 layers, [NB, 64, 576] bf16, ~18 MB per 256-token
chunk). For each tier an engine is built with only that tier below its CPU pool, and:

- store GB/s: ``engine.store`` of a fresh prompt plus, for a lower tier, the wait until the
  write-behind has written every chunk (``storage.flush``): end-to-end write throughput.
  ``step ms`` is the time of the ``store`` call alone, what the engine's step pays.
- retrieve GB/s: pool emptied, then ``engine.retrieve`` (tier read + checksum + promotion
  into the pool + scatter into paged memory). ``--cold`` drops the disk files from the page
  cache first (posix_fadvise DONTNEED).
- lookup p50/p99 us: ``engine.lookup`` of the prompt with the pool empty (pool tier: full),
  i.e. one batched existence query against the tier.

Tiers: pool, disk (``--disk-dir``, default a temp dir), redis (``--redis-url``, default: a
redis-server started here on a loopback port). The node-level cache server is a pool, not a
lower tier: ``benchmarks/server_bench.py`` measures it against the private pool.

Run: python benchmarks/tiers.py [--tokens 8192] [--repeats 3] [--tiers pool,disk,redis] [--cold]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from layouts import full_block_tables, mla_prompt_setup

from kvconnect import Config, KVCacheEngine, KVLayout

CHUNK_TOKENS = 256


def percentile_us(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1e6, q))


def drop_page_cache(root: Path) -> None:
    for path in root.rglob("*.kvc"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class RedisForBench:
    """A throwaway redis-server on loopback (reuses the tests' launcher)."""

    def __init__(self, workdir: Path) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "storage"))
        from redis_server import RedisNode, redis_available

        reason = redis_available()
        if reason:
            raise RuntimeError(reason)
        self.node = RedisNode(workdir, extra_args=("--maxmemory", "0")).start()
        self.url = self.node.url

    def close(self) -> None:
        self.node.stop()


def bench_tier(name: str, layout: KVLayout, engine: KVCacheEngine, args, rng: np.random.Generator) -> dict:
    num_tokens = args.tokens
    tables = full_block_tables(layout, num_tokens)
    buffer = getattr(engine.pool, "buffer", None)
    if buffer is not None:
        buffer.zero_()  # fault the pool's pages in now: first-touch cost is not a tier's
    lower = name != "pool"
    store_s, step_s, retrieve_s, nbytes, loaded_bytes = [], [], [], 0, 0
    prompts = []
    for _ in range(args.repeats):
        tokens = rng.integers(0, 32000, num_tokens)
        prompts.append(tokens)
        before = engine.stats.stored_bytes
        t0 = time.perf_counter()
        stored = engine.store(tokens, tables)
        t1 = time.perf_counter()
        if lower and not engine.storage.flush(600):
            raise RuntimeError(f"{name}: write-behind did not finish")
        t2 = time.perf_counter()
        assert stored == num_tokens // CHUNK_TOKENS * CHUNK_TOKENS, f"{name}: stored {stored} tokens"
        nbytes = engine.stats.stored_bytes - before
        step_s.append(t1 - t0)
        store_s.append(t2 - t0)
    if lower:
        dropped = sum(w.stats().dropped_full for w in engine.storage.writers)
        failed = sum(w.stats().failed for w in engine.storage.writers)
        if dropped or failed:
            print(f"  note: {name}: {dropped} chunks dropped (queue full), {failed} failed writes")
    for tokens in prompts:
        if lower:
            engine.pool.clear()
            if args.cold and name == "disk":
                drop_page_cache(Path(args.disk_dir))
        before = engine.stats.retrieved_bytes
        t0 = time.perf_counter()
        loaded = engine.retrieve(tokens, tables)
        retrieve_s.append(time.perf_counter() - t0)
        loaded_bytes = engine.stats.retrieved_bytes - before
        assert loaded == num_tokens // CHUNK_TOKENS * CHUNK_TOKENS, f"{name}: loaded {loaded} tokens"
    lookups = []
    for i in range(args.lookups):
        tokens = prompts[i % len(prompts)]
        if lower:
            engine.pool.clear()
        t0 = time.perf_counter()
        hit = engine.lookup(tokens)
        lookups.append(time.perf_counter() - t0)
        assert hit == num_tokens // CHUNK_TOKENS * CHUNK_TOKENS
    return {
        "tier": name,
        "MB": nbytes / 1e6,
        "store_GBps": nbytes / statistics.median(store_s) / 1e9,
        "step_ms": statistics.median(step_s) * 1e3,
        "retrieve_GBps": loaded_bytes / statistics.median(retrieve_s) / 1e9,
        "lookup_p50_us": percentile_us(lookups, 50),
        "lookup_p99_us": percentile_us(lookups, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--tiers", default="pool,disk,redis,server")
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--cold", action="store_true", help="drop disk files from the page cache before each read")
    args = parser.parse_args()

    layout, chunk_bytes, prompt_gb, base = mla_prompt_setup(args.tokens, args.repeats, args.threads, CHUNK_TOKENS)
    print(f"tiers benchmark: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}")
    print(f"layout dsv3-mla-like: {len(layout.planes)} planes, chunk {CHUNK_TOKENS} tokens = {chunk_bytes / 1e6:.1f} MB, "
          f"prompt {args.tokens} tokens = {prompt_gb * 1e3:.0f} MB, {args.repeats} prompts per tier\n")

    tmp = Path(tempfile.mkdtemp(prefix="kvc-tiers-"))
    args.disk_dir = args.disk_dir or str(tmp / "disk")
    redis: Optional[RedisForBench] = None
    rows = []
    rng = np.random.default_rng(0)
    for name in tqdm(args.tiers.split(","), desc="tiers", unit="tier", leave=False):
        cfg = None
        if name == "pool":
            cfg = base
        elif name == "disk":
            cfg = Config(**{**vars(base), "local_disk": args.disk_dir, "max_local_disk_size": base.max_local_cpu_size})
        elif name == "redis":
            url = args.redis_url
            if url is None:
                try:
                    redis = RedisForBench(tmp / "redis")
                except RuntimeError as exc:
                    print(f"  redis: skipped ({exc})")
                    continue
                url = redis.url
            cfg = Config(**{**vars(base), "remote_url": url, "remote_timeout_s": 30.0})
        else:
            raise SystemExit(f"unknown tier {name!r}")
        engine = KVCacheEngine(layout, cfg)
        try:
            rows.append(bench_tier(name, layout, engine, args, rng))
        finally:
            engine.close()
    if redis is not None:
        redis.close()

    print(f"{'tier':<8}{'MB':>8}{'store GB/s':>12}{'step ms':>10}{'retrieve GB/s':>15}{'lookup p50 us':>15}{'p99 us':>10}")
    for r in rows:
        print(f"{r['tier']:<8}{r['MB']:>8.0f}{r['store_GBps']:>12.2f}{r['step_ms']:>10.1f}{r['retrieve_GBps']:>15.2f}"
              f"{r['lookup_p50_us']:>15.0f}{r['lookup_p99_us']:>10.0f}")


if __name__ == "__main__":
    main()
