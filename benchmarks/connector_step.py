"""Where the connector's time goes at 0% reuse: one request's work, part by part.

    python benchmarks/connector_step.py [--tokens 2048] [--layers 8] [--reps 20]

At 0% reuse the connector does, per request, exactly: one lookup (scheduler -> worker over
the lookup channel: hash the prompt's chunk keys, ask the pool), a save plan, and one store
(gather the prompt's chunks from vLLM's pages into the CPU pool, on the store thread, joined
at the next step). This runs those parts with the real scheduler, worker, lookup channel and
engine on a cache shaped like the one vLLM CPU gives the model of benchmarks/vllm_serve.py
(8 layers, 2 KV heads x 64, bf16, packed pages of 128 tokens: 1 MiB per 256-token chunk),
every prompt new, and reports the median time of each part, and of the store with 1 and 2
kernel threads and with the storing thread pinned to another core than the caller. The
engine-side figure to compare with is vLLM's own prefill of the same prompt (TTFT in
benchmarks/vllm_serve.py) and decode step (TPOT).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

from kvconnect import Config, GroupSpec, KVLayout
from kvconnect.integrations.vllm.lookup_channel import LookupClient, rank_address
from kvconnect.integrations.vllm.metadata import RequestView, StepPlan
from kvconnect.integrations.vllm.scheduler import KVConnectScheduler
from kvconnect.integrations.vllm.translate import Translation
from kvconnect.integrations.vllm.worker import KVConnectWorker
from kvconnect.chunks.keys import ChunkKeyer

BS = 128


def page_translation(layers: int, num_blocks: int) -> Translation:
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, 2, BS, 128, dtype=torch.bfloat16) for i in range(layers)}
    for t in kv.values():
        t.view(torch.int16).random_(-1000, 1000)
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=BS)], layout_hints="page", model_name="serve-like")
    return Translation(layout, source_groups=(0,), num_vllm_groups=1, layer_names=tuple(kv))


def median_ms(samples) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    blocks_per_prompt = args.tokens // BS
    translation = page_translation(args.layers, blocks_per_prompt * 4 + 1)
    workdir = tempfile.mkdtemp(prefix="kvconnect-step-")
    url = f"ipc://{workdir}/kvc"
    worker = KVConnectWorker(Config(chunk_size=256, max_local_cpu_size=2.0, num_threads=2, log_interval_s=0), rank_address(url, 0))
    worker.register(translation)
    client = LookupClient([rank_address(url, 0)], timeout_s=5.0)
    sched = KVConnectScheduler(client, chunk_tokens=256)
    engine = worker.engine
    rng = np.random.default_rng(0)
    keyer = ChunkKeyer(translation.layout.fingerprint, 256)
    parts: dict = {k: [] for k in ("hash keys", "lookup (channel + pool)", "save plan", "store 1 thread", "store 2 threads",
                                   "store 1 thread, other core")}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    for rep in range(args.reps):
        for variant in ("store 1 thread", "store 2 threads", "store 1 thread, other core"):
            prompt = rng.integers(0, 32000, args.tokens, dtype=np.int64)
            req = RequestView(f"r{rep}-{variant}", prompt, args.tokens)
            start = time.perf_counter()
            keyer.keys(prompt, [(i, i + 256) for i in range(0, args.tokens, 256)], None)
            parts["hash keys"].append(time.perf_counter() - start)
            start = time.perf_counter()
            sched.num_new_matched_tokens(req, 0)
            parts["lookup (channel + pool)"].append(time.perf_counter() - start)
            blocks = tuple(range(1 + (rep % 3) * blocks_per_prompt, 1 + (rep % 3 + 1) * blocks_per_prompt))
            sched.after_alloc(req, (), 0, 0)
            start = time.perf_counter()
            plan = sched.build_plan({req.req_id: args.tokens}, lambda r: 0, lambda r: (blocks,))
            parts["save plan"].append(time.perf_counter() - start)
            engine.store_threads = 2 if variant == "store 2 threads" else 1
            job = plan.saves[0]
            if variant.endswith("other core") and len(cores) > 1:
                box = {}

                def pinned():
                    os.sched_setaffinity(0, {cores[-1]})
                    t0 = time.perf_counter()
                    worker._save_one(job)
                    box["s"] = time.perf_counter() - t0

                th = threading.Thread(target=pinned)
                th.start()
                th.join()
                parts[variant].append(box["s"])
            else:
                start = time.perf_counter()
                worker._save_one(job)
                parts[variant].append(time.perf_counter() - start)
            worker.begin_step()
            sched.request_finished(req.req_id)
    chunk_mib = engine.pool.slot_bytes / (1 << 20)
    print(f"{args.tokens}-token prompts, {args.layers} layers, {chunk_mib:.1f} MiB per 256-token chunk "
          f"({args.tokens // 256 * chunk_mib:.0f} MiB stored per prompt), {args.reps} reps, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, samples in parts.items():
        if samples:
            print(f"  {name:<28} {median_ms(samples):8.2f} ms")
    client.close()
    worker.close()


if __name__ == "__main__":
    main()
