"""Node cache server benchmark: the engine over the shared server pool vs its in-process pool.

Layout: DeepSeek-V3-like MLA on CPU (61 layers, [NB, 64, 576] bf16, ~18 MB per 256-token
chunk), the same as benchmarks/tiers.py. For each pool:

- store GB/s: ``engine.store`` of a fresh prompt (keys, one reserve, one gather into the
  pool, one commit per chunk; through the server each control call is a round trip);
- retrieve GB/s: ``engine.retrieve`` of a stored prompt (acquire, gate, one scatter, release);
- lookup p50/p99 us: ``engine.lookup`` of a stored prompt (keys + one masks call);
- control p50/p99 us: one ``masks`` call for one key (server: the bare round trip).

The server is started here (``python -m kvconnect.cli server``) on an ipc socket in a temp
dir, sized like the in-process pool, and stopped at the end. ``--device cuda`` puts the KV
on the GPU: the private pool is then pinned memory and the server pool's mapping is
page-locked with cudaHostRegister (reported in the header line).

Run: python benchmarks/server_bench.py [--tokens 8192] [--repeats 3] [--lookups 200]
"""

from __future__ import annotations

import argparse
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from layouts import full_block_tables, mla_prompt_setup

from kvconnect import Config, KVCacheEngine, KVLayout
from kvconnect.server import make_pool

CHUNK_TOKENS = 256
REPO = Path(__file__).resolve().parents[1]


def pct_us(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1e6, q))


def bench(name: str, layout: KVLayout, engine: KVCacheEngine, args, rng: np.random.Generator) -> dict:
    tables = full_block_tables(layout, args.tokens)
    expected = args.tokens // CHUNK_TOKENS * CHUNK_TOKENS
    engine.pool.buffer.zero_() if name == "pool" else None  # fault the private pool in (the server pre-allocates)
    prompts, store_s, retrieve_s, stored_bytes, loaded_bytes = [], [], [], 0, 0
    for _ in range(args.repeats):
        tokens = rng.integers(0, 32000, args.tokens)
        prompts.append(tokens)
        before = engine.stats.stored_bytes
        t0 = time.perf_counter()
        assert engine.store(tokens, tables) == expected, f"{name}: store fell short"
        store_s.append(time.perf_counter() - t0)
        stored_bytes = engine.stats.stored_bytes - before
    for tokens in prompts:
        before = engine.stats.retrieved_bytes
        t0 = time.perf_counter()
        assert engine.retrieve(tokens, tables) == expected, f"{name}: retrieve fell short"
        retrieve_s.append(time.perf_counter() - t0)
        loaded_bytes = engine.stats.retrieved_bytes - before
    lookups, control = [], []
    probe = [engine.chunks(prompts[0], include_partial=False)[0].key]
    for i in range(args.lookups):
        t0 = time.perf_counter()
        assert engine.lookup(prompts[i % len(prompts)]) == expected
        lookups.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.pool.masks(probe)
        control.append(time.perf_counter() - t0)
    return {
        "pool": name, "MB": stored_bytes / 1e6,
        "store_GBps": stored_bytes / statistics.median(store_s) / 1e9,
        "retrieve_GBps": loaded_bytes / statistics.median(retrieve_s) / 1e9,
        "lookup_p50_us": pct_us(lookups, 50), "lookup_p99_us": pct_us(lookups, 99),
        "control_p50_us": pct_us(control, 50), "control_p99_us": pct_us(control, 99),
    }


def start_server(url: str, size_gb: float, workdir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = open(workdir / "server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvconnect.cli", "server", "--url", url, "--size-gb", f"{size_gb:.3f}"],
                            stdout=subprocess.PIPE, stderr=log, env=env)
    log.close()
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    if not ready or b"ready" not in proc.stdout.readline():
        proc.kill()
        raise SystemExit(f"the cache server did not start; see {workdir / 'server.log'}")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--device", default="cpu", help="where the paged KV lives (cpu, cuda)")
    args = parser.parse_args()

    layout, chunk_bytes, prompt_gb, base = mla_prompt_setup(args.tokens, args.repeats, args.threads, CHUNK_TOKENS, args.device)
    print(f"server benchmark: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}")
    print(f"layout dsv3-mla-like: chunk {CHUNK_TOKENS} tokens = {chunk_bytes / 1e6:.1f} MB, prompt {args.tokens} tokens = "
          f"{prompt_gb * 1e3:.0f} MB, {args.repeats} prompts, {args.threads} kernel threads\n")

    workdir = Path(tempfile.mkdtemp(prefix="kvc-bench-", dir="/tmp"))
    url = f"ipc://{workdir}/kvc.sock"
    server = start_server(url, base.max_local_cpu_size, workdir)
    rows = []
    try:
        for name in tqdm(("pool", "server"), desc="pools", unit="pool", leave=False):
            cfg = base if name == "pool" else Config(**{**vars(base), "server_url": url, "remote_timeout_s": 30.0})
            engine = KVCacheEngine(layout, cfg, pool_factory=make_pool)
            if name == "server":  # like the private pool's zero_() below: time copies, not first-touch faults
                t0 = time.perf_counter()
                engine.pool.prefaulted.wait(120)
                print(f"server pool connected: {engine.pool.connected}, page-locked: {engine.pool.page_locked}, "
                      f"mapping faulted in after {time.perf_counter() - t0:.2f} s more")
            try:
                rows.append(bench(name, layout, engine, args, np.random.default_rng(0)))
            finally:
                engine.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"{'pool':<8}{'MB':>7}{'store GB/s':>12}{'retrieve GB/s':>15}{'lookup p50 us':>15}{'p99 us':>9}{'control p50 us':>16}{'p99 us':>9}")
    for r in rows:
        print(f"{r['pool']:<8}{r['MB']:>7.0f}{r['store_GBps']:>12.2f}{r['retrieve_GBps']:>15.2f}{r['lookup_p50_us']:>15.0f}"
              f"{r['lookup_p99_us']:>9.0f}{r['control_p50_us']:>16.1f}{r['control_p99_us']:>9.1f}")


if __name__ == "__main__":
    main()
