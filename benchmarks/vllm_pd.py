"""Prefill/decode disaggregation through kvconnect, against one plain server, with vLLM's own client.

    .venv-vllm/bin/python benchmarks/vllm_pd.py [--reps 2] [--num-prompts 16] [--quick]

Needs ``.ci/install_vllm.sh`` and ``.ci/install_vllm_router.sh``. Builds a random Llama with
a local word-level tokenizer (benchmarks/vllm_serve.py's ``build_model``; nothing is
downloaded), then on this machine:

- ``plain``: one ``vllm serve`` without a connector, on every core (``VLLM_CPU_OMP_THREADS_BIND``
  auto);
- ``pd``: the deployment of tests/integration/pd_cluster.py: ``kvconnect server`` (the shared
  tier), a ``kv_producer`` ``vllm serve`` on core 0, a ``kv_consumer`` ``vllm serve`` on core 1,
  and ``vllm-router --vllm-pd-disaggregation`` in front; ``vllm bench serve`` talks to the router.

Both get the same prompts (``random`` dataset, ``--input-len`` / ``--output-len`` tokens, 0%
reuse, a new seed every repetition) at each ``--concurrency``; the order alternates per
repetition. Prints, per concurrency, the median over repetitions of TTFT mean / median / p99,
TPOT median and output throughput for both and their ratio (pd / plain), and the decode server's
own counters over the pd runs: prompt tokens, tokens loaded from the shared tier (its share),
P/D waits and timeouts; the producer's loads and the consumer's stores (both must be 0).

The comparison is of one machine's two cores used two ways, not of P/D at scale: on a 2-core
VM each P/D server has one core where the plain server has two, and the router adds a hop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))
sys.path.insert(0, str(HERE.parent / "tests"))  # support (pd_cluster's Mooncake master)

import pd_cluster as pc  # noqa: E402
from vllm_serve import bench, build_model, load_average  # noqa: E402

METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput")
COUNTERS = ("prompt_tokens_total", "prefix_cache_hits_total", "kvconnect_retrieved_tokens_total", "kvconnect_stored_chunks_total",
            "kvconnect_lookups_total", "kvconnect_pd_remote_prefills_total", "kvconnect_pd_remote_prefill_ready_total",
            "kvconnect_pd_remote_prefill_timeouts_total", "kvconnect_pd_remote_prefill_wait_seconds_total",
            "kvconnect_pd_remote_decode_prefills_total", "kvconnect_load_failures_total")


def counters(url: str) -> dict[str, float]:
    text = pc.get(url + "/metrics")
    return {name: pc.metric(text, "vllm:" + name) for name in COUNTERS}


def main() -> None:
    os.environ.setdefault("KVCONNECT_TEST_FORK_RUNS", "0")  # servers as a user starts them, not forked from the test zygote
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--pool-gb", type=float, default=1.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--run-timeout-s", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="1 rep, 8 prompts of 512 tokens, concurrency 1 and 4")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.num_prompts, args.input_len = 1, 8, 512
    if not pc.router_available():
        sys.exit("vllm-router is not installed: bash .ci/install_vllm_router.sh")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workdir = Path(args.out or tempfile.mkdtemp(prefix="kvconnect-pd-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, {platform.platform()}; load {load_average()}; out {workdir}")
    model = build_model(workdir / "model", hidden=args.hidden, layers=args.layers)
    serve_args = ("--tokenizer-init", "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
                  "--max-num-batched-tokens", "2048", "--max-num-seqs", "16")
    plain = pc.PlainServer(str(model), workdir, block_size=args.block_size, serve_args=serve_args)
    cluster = pc.PDCluster(str(model), workdir, chunk_tokens=args.chunk_size, block_size=args.block_size,
                           serve_args=serve_args, pool_gb=args.pool_gb)
    bargs = SimpleNamespace(input_len=args.input_len, output_len=args.output_len, run_timeout_s=args.run_timeout_s)
    router = SimpleNamespace(name="pd", url=cluster.router_url)
    results: dict = {}
    try:
        t0 = time.monotonic()
        cluster.start(plain)
        print(f"servers up in {time.monotonic() - t0:.0f} s")
        targets = {"plain": plain, "pd": router}
        for name, target in targets.items():  # warm-up: first-request costs out of the figures
            bench(target, bargs, model, "random", 1, 2, 999, workdir / f"warmup-{name}.json")
        before_d, before_p = counters(cluster.consumer_url), counters(cluster.producer_url)
        for rep in range(args.reps):
            order = list(targets) if rep % 2 == 0 else list(reversed(targets))
            for c in concurrencies:
                seed = 1000 + 10 * rep + c
                for name in order:
                    r = bench(targets[name], bargs, model, "random", c, args.num_prompts, seed,
                              workdir / f"{name}-c{c}-rep{rep}.json")
                    results.setdefault((c, name), []).append(r)
                    print(f"rep {rep} c={c} {name}: TTFT mean {r['mean_ttft_ms']:.1f} ms, TPOT median "
                          f"{r['median_tpot_ms']:.2f} ms, {r['output_throughput']:.1f} tok/s", flush=True)
        time.sleep(6)  # kvconnect's figures reach /metrics within seconds of the last step
        after_d, after_p = counters(cluster.consumer_url), counters(cluster.producer_url)
    finally:
        plain.stop()
        cluster.stop()
    print(f"\nload after: {load_average()}")
    print(f"{'c':>3} {'server':>6} " + " ".join(f"{m:>16}" for m in METRICS))
    for c in concurrencies:
        med = {n: {m: statistics.median(r[m] for r in results[(c, n)]) for m in METRICS} for n in ("plain", "pd")}
        for n in ("plain", "pd"):
            print(f"{c:>3} {n:>6} " + " ".join(f"{med[n][m]:>16.2f}" for m in METRICS))
        print(f"{c:>3} {'ratio':>6} " + " ".join(f"{med['pd'][m] / med['plain'][m]:>15.2f}x" for m in METRICS))
    d = {k: after_d[k] - before_d[k] for k in COUNTERS}
    p = {k: after_p[k] - before_p[k] for k in COUNTERS}
    total = max(1.0, d["prompt_tokens_total"])
    loaded, cached = d["kvconnect_retrieved_tokens_total"], d["prefix_cache_hits_total"]
    print(f"\ndecode server: {total:.0f} prompt tokens: {loaded:.0f} loaded from the shared tier ({100 * loaded / total:.1f}%), "
          f"{cached:.0f} from vLLM's own prefix cache ({100 * cached / total:.1f}%), "
          f"{100 * (total - loaded - cached) / total:.1f}% computed; "
          f"{d['kvconnect_pd_remote_prefills_total']:.0f} P/D requests, {d['kvconnect_pd_remote_prefill_ready_total']:.0f} ready, "
          f"{d['kvconnect_pd_remote_prefill_timeouts_total']:.0f} timeouts, "
          f"{d['kvconnect_pd_remote_prefill_wait_seconds_total'] * 1e3:.1f} ms waited in all; "
          f"{d['kvconnect_stored_chunks_total']:.0f} chunks stored, {d['kvconnect_load_failures_total']:.0f} load failures")
    print(f"producer: {p['kvconnect_pd_remote_decode_prefills_total']:.0f} prefills named, "
          f"{p['kvconnect_retrieved_tokens_total']:.0f} tokens loaded, {p['kvconnect_lookups_total']:.0f} lookups")
    (workdir / "summary.json").write_text(json.dumps({f"{c}|{n}": v for (c, n), v in results.items()}, default=str))


if __name__ == "__main__":
    main()
