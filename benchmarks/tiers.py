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
redis-server started here on a loopback port), mooncake (a ``mooncake_master`` started here
on loopback and a ``kvconnect server --mooncake-segment-gb`` holding the segment in ANOTHER
process; this process contributes nothing, so every byte crosses Mooncake's TCP transfer
engine), and mooncake-raw: Mooncake's own zero-copy ``batch_put_from`` / ``batch_get_into``
of the same number of objects of the same payload sizes, between a registered buffer here
and the same holder (one call per prompt; no kvconnect code: the ceiling of the mooncake
row). The node-level cache server as a pool is measured by ``benchmarks/server_bench.py``.

Run: python benchmarks/tiers.py [--tokens 8192] [--repeats 3] [--tiers pool,disk,redis,mooncake,mooncake-raw] [--cold]
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
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from support.redis_server import RedisNode, redis_available

        reason = redis_available()
        if reason:
            raise RuntimeError(reason)
        self.node = RedisNode(workdir, extra_args=("--maxmemory", "0")).start()
        self.url = self.node.url

    def close(self) -> None:
        self.node.stop()


class MooncakeForBench:
    """A loopback mooncake_master and a node server holding the segment, both started here."""

    def __init__(self, workdir: Path, segment_bytes: int) -> None:
        import json

        here = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(here / "tests"))
        from support.mooncake_master import MooncakeMaster, NodeHolder, client_env, mooncake_available

        reason = mooncake_available()
        if reason:
            raise RuntimeError(reason)
        os.environ.update({k: v for k, v in client_env().items() if k.startswith(("MC_", "GLOG_"))})
        self.master = MooncakeMaster(workdir).start()
        self.url = self.master.url
        try:
            self.holder = NodeHolder(self.master, workdir / "node", segment_bytes / (1 << 30), repo=here)
        except Exception:
            self.master.stop()
            raise
        self.config_path = workdir / "mooncake.json"
        self.config_path.write_text(json.dumps({"global_segment_size": 0}))  # this process holds nothing

    def close(self) -> None:
        self.holder.stop()
        self.master.stop()


def wait_tier(engine: KVCacheEngine, timeout_s: float = 60.0) -> None:
    tier = engine.storage.tiers[0]
    deadline = time.monotonic() + timeout_s
    while not tier.connected:
        if time.monotonic() > deadline:
            raise RuntimeError("the Mooncake tier did not connect")
        time.sleep(0.05)


def bench_mooncake_raw(mc: MooncakeForBench, num_objects: int, object_bytes: int, args) -> dict:
    """Mooncake's zero-copy batch calls on the same object count and sizes as one prompt."""
    from kvconnect.storage.mooncake.config import MooncakeSpec, import_store

    store = import_store(MooncakeSpec(master_address=mc.master.address))()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", mc.master.address) != 0:
        raise RuntimeError("raw Mooncake client setup failed")
    src = np.random.default_rng(1).integers(0, 256, num_objects * object_bytes, dtype=np.uint8)
    dst = np.ones_like(src)  # pages faulted in now, as the pool's are: first-touch cost is not Mooncake's
    for a in (src, dst):
        assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    sizes = [object_bytes] * num_objects
    put_s, get_s, lookups = [], [], []
    for r in range(args.repeats):
        keys = [f"raw/{r}/{i}" for i in range(num_objects)]
        t0 = time.perf_counter()
        codes = store.batch_put_from(keys, [src.ctypes.data + i * object_bytes for i in range(num_objects)], sizes)
        put_s.append(time.perf_counter() - t0)
        assert all(c == 0 for c in codes), codes
    for r in range(args.repeats):
        keys = [f"raw/{r}/{i}" for i in range(num_objects)]
        t0 = time.perf_counter()
        codes = store.batch_get_into(keys, [dst.ctypes.data + i * object_bytes for i in range(num_objects)], sizes)
        get_s.append(time.perf_counter() - t0)
        assert all(c == object_bytes for c in codes), codes
    assert np.array_equal(src, dst)
    for i in range(args.lookups):
        keys = [f"raw/{i % args.repeats}/{j}" for j in range(num_objects)]
        t0 = time.perf_counter()
        store.batch_is_exist(keys)
        lookups.append(time.perf_counter() - t0)
    store.close()
    nbytes = num_objects * object_bytes
    return {"tier": "mc-raw", "MB": nbytes / 1e6, "store_GBps": nbytes / statistics.median(put_s) / 1e9,
            "step_ms": float("nan"), "retrieve_GBps": nbytes / statistics.median(get_s) / 1e9,
            "lookup_p50_us": percentile_us(lookups, 50), "lookup_p99_us": percentile_us(lookups, 99)}


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


TIERS = ("pool", "disk", "redis", "mooncake", "mooncake-raw")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--tiers", default="pool,disk,redis", help=f"comma-separated, of: {', '.join(TIERS)} (default pool,disk,redis)")
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--cold", action="store_true", help="drop disk files from the page cache before each read")
    args = parser.parse_args()
    unknown = [t for t in args.tiers.split(",") if t not in TIERS]
    if unknown:  # before minutes of benchmarking, not after
        parser.error(f"unknown tier(s) {', '.join(map(repr, unknown))}; known: {', '.join(TIERS)} "
                     "(the node server as a pool: benchmarks/server_bench.py)")

    layout, chunk_bytes, prompt_gb, base = mla_prompt_setup(args.tokens, args.repeats, args.threads, CHUNK_TOKENS)
    print(f"tiers benchmark: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}")
    print(f"layout dsv3-mla-like: {len(layout.planes)} planes, chunk {CHUNK_TOKENS} tokens = {chunk_bytes / 1e6:.1f} MB, "
          f"prompt {args.tokens} tokens = {prompt_gb * 1e3:.0f} MB, {args.repeats} prompts per tier\n")

    tmp = Path(tempfile.mkdtemp(prefix="kvc-tiers-"))
    args.disk_dir = args.disk_dir or str(tmp / "disk")
    redis: Optional[RedisForBench] = None
    mooncake: Optional[MooncakeForBench] = None
    rows = []
    rng = np.random.default_rng(0)
    try:
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
            elif name in ("mooncake", "mooncake-raw"):
                if mooncake is None:
                    try:  # every prompt of both rows, with slack
                        mooncake = MooncakeForBench(tmp / "mooncake", int(prompt_gb * 1e9 * args.repeats * 2 * 1.15) + (256 << 20))
                    except RuntimeError as exc:
                        print(f"  mooncake: skipped ({exc})")
                        continue
                if name == "mooncake-raw":
                    num_chunks = args.tokens // CHUNK_TOKENS
                    rows.append(bench_mooncake_raw(mooncake, num_chunks, chunk_bytes, args))
                    continue
                cfg = Config(**{**vars(base), "remote_url": mooncake.url, "remote_timeout_s": 30.0,
                                "mooncake_config_path": str(mooncake.config_path)})
            else:
                raise SystemExit(f"unknown tier {name!r}")
            engine = KVCacheEngine(layout, cfg)
            if name == "mooncake":
                wait_tier(engine)
            try:
                rows.append(bench_tier(name, layout, engine, args, rng))
            finally:
                engine.close()
    finally:  # servers started here never outlive the run
        if redis is not None:
            redis.close()
        if mooncake is not None:
            mooncake.close()

    print(f"{'tier':<8}{'MB':>8}{'store GB/s':>12}{'step ms':>10}{'retrieve GB/s':>15}{'lookup p50 us':>15}{'p99 us':>10}")
    for r in rows:
        print(f"{r['tier']:<8}{r['MB']:>8.0f}{r['store_GBps']:>12.2f}{r['step_ms']:>10.1f}{r['retrieve_GBps']:>15.2f}"
              f"{r['lookup_p50_us']:>15.0f}{r['lookup_p99_us']:>10.0f}")


if __name__ == "__main__":
    main()
