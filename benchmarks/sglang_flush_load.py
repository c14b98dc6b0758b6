"""SGLang ``flush_cache`` with kvconnect as HiCache L3 on a loaded machine (issue #26 item 10).

    flock /tmp/engine.lock .venv-sglang/bin/python benchmarks/sglang_flush_load.py \
        [--burners 6] [--prompts 24] [--prompt-tokens 256] [--log /tmp/flush_load.jsonl]

Starts ``--burners`` CPU burners (``python3 -c 'while True: pass'``, nice 0), then one real
SGLang 0.5.23 engine on CPU (tiny random Llama, page 16, write-through, pool + disk tier)
with kvconnect wrapped by ``sglang_timed_backend`` (times every backend call, and samples
what SGLang's storage threads are doing during each ``_stop_storage_threads``). Phases:
a burst of distinct prompts (misses: backups queued) and flush at once; the same burst again
(L3 hits: prefetches) and flush at once; settle and flush. Prints per flush its duration
and outcome, the controller's queue sizes when the stop began, the slowest backend calls
and, for every stop that took over a second, what held the threads. The burners are
stopped by their process ids whatever happens.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "sglang"))

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burners", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--prefetch-threshold", type=int, default=PAGE)
    ap.add_argument("--cold-jit", action="store_true",
                    help="a fresh TORCH_EXTENSIONS_DIR: SGLang JIT-builds its page-hash extension in the engine, as on a new machine")
    ap.add_argument("--log", default="")
    ap.add_argument("--timeout", type=float, default=420)
    args = ap.parse_args()

    from support import tiny_models
    from engine_runs import harness_env

    work = Path(tempfile.mkdtemp(prefix="kvc-flush-load-"))
    log = Path(args.log or work / "timing.jsonl")
    log.unlink(missing_ok=True)
    model = tiny_models.make_llama(str(work / "llama"))
    rng = random.Random(0)
    prompts = [tiny_models.random_tokens(rng, args.prompt_tokens) for _ in range(args.prompts)]
    burst = {"op": "generate", "prompts": prompts, "max_new_tokens": 4}
    backend = {"backend_name": "kvconnect", "module_path": "sglang_timed_backend", "class_name": "TimedKVConnectStorage",
               "interface_v1": 1, "prefetch_threshold": args.prefetch_threshold, "max_local_cpu_size": 0.2,
               "max_local_disk_size": 1, "local_disk": str(work / "disk"), "timing_log": str(log)}
    spec = {"model": model, "page_size": PAGE, "hicache": True, "layout": "page_first_direct", "hicache_ratio": 2,
            "backend": "dynamic", "extra": backend,
            "phases": [burst, {"op": "flush"}, burst, {"op": "flush"}, {"op": "settle", "seconds": 3}, {"op": "flush"}]}
    (work / "spec.json").write_text(json.dumps(spec))
    env = harness_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), env["PYTHONPATH"]])
    if args.cold_jit:
        env["TORCH_EXTENSIONS_DIR"] = str(work / "torch_extensions")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still stops the burners (finally)
    burners = [subprocess.Popen(["python3", "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "sglang" / "sglang_run.py"), str(work / "spec.json")],
                              capture_output=True, text=True, timeout=args.timeout, env=env, cwd=str(work))
    finally:
        for b in burners:
            b.kill()
            b.wait()
    result = next((json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("KVCONNECT_RESULT ")), None)
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    report(args, result, events, proc)


def report(args, result, events, proc) -> None:
    print(f"burners {args.burners}, cold JIT {args.cold_jit}, {args.prompts} prompts x {args.prompt_tokens} tokens (page {PAGE}), load {os.getloadavg()[0]:.1f}")
    if result is None:
        print(f"engine run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    else:
        flushes = [p for p in result["phases"] if "flushed" in p]
        print("flushes (SGLang flush_cache):", [(f["flushed"], f["seconds"]) for f in flushes])
    calls = [e for e in events if e["ev"] == "call"]
    by_name = collections.defaultdict(list)
    for c in calls:
        by_name[c["name"]].append(c["s"])
    for name, ts in sorted(by_name.items()):
        ts.sort()
        print(f"  {name:14s} calls {len(ts):5d}  median {1e3 * ts[len(ts) // 2]:7.2f} ms  max {1e3 * ts[-1]:8.2f} ms  total {sum(ts):6.2f} s")
    for e in events:
        if e["ev"] == "stop_begin":
            print(f"stop at t={e['t']:.1f}s: queues {e['queues']}, threads alive {e['alive']}")
        elif e["ev"] == "stop_end":
            print(f"  -> {'ok' if e['ok'] else 'FAILED'} after {e['s']} s {e.get('error', '')} {e.get('stacks', '')}")
    stops = [e for e in events if e["ev"] in ("stop_begin", "stop_end", "sample")]
    holders = collections.Counter()
    for e in stops:
        if e["ev"] == "sample":
            for thread, stack in e["stacks"].items():
                holders[(thread, " < ".join(stack[:3]))] += 1
    if holders:
        print("while stopping, storage threads seen in (0.2 s samples):")
        for (thread, where), n in holders.most_common(12):
            print(f"  {n:4d} x {thread}: {where}")
        prefetch = [e["queues"].get("prefetch_queue", 0) for e in stops if e["ev"] == "sample"]
        print(f"  prefetch_queue during stops: max {max(prefetch)}, samples {prefetch[:40]}")


if __name__ == "__main__":
    main()
