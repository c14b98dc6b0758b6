"""Eviction policies side by side: prefix traces replayed through a real KVCacheEngine.

Each request does what the vLLM connector does for it: ``lookup`` (the scheduler's query),
``retrieve`` of the hit into the request's blocks, then ``store`` of the chunks past the hit
(the saves of its prefill). Every policy replays the same trace in one run, on an engine
whose CPU pool holds ``--pool-fraction`` of the trace's distinct prefix chunks. The layout is
a tiny 1-layer cache: bytes do not matter here, only which chunks the pool keeps. vLLM's own
prefix cache is left out (it would absorb some hits before the connector is asked).

Workloads (prompt = shared prefix + a unique suffix, as in ``vllm bench serve
--dataset-name prefix_repetition``):

- ``cyclic``: the issue's small-pool case: 10 prefixes of 2.5K tokens requested in turn,
  80 requests, pool smaller than the working set (LRU evicts each prefix just before use).
- ``shuffled``: the same prefixes, each round in a random order.
- ``zipf``: 200 prefixes of 1-16 chunks, popularity Zipf(``--zipf-alpha``), 4000 requests.
- ``zipf+scan``: the Zipf trace with every 8th request a long unique document (32 chunks,
  never asked again): a scan that must not flush the popular prefixes.

Reported per policy: token hit ratio (tokens loaded / prompt tokens), requests that loaded
anything, evictions. Run: python benchmarks/eviction.py [--policies s3fifo,2q,lru]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvconnect import Config, GroupSpec, KVCacheEngine, KVLayout
from kvconnect.storage.eviction import POLICIES

CHUNK = 256
BLOCK = 16


@dataclass(frozen=True)
class Trace:
    name: str
    prompts: list  # np.int64 token arrays, in request order
    prefix_chunks: int  # distinct shared-prefix chunks (the working set)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 32000, n, dtype=np.int64)


def prefix_trace(name: str, rng, num_prefixes: int, prefix_tokens: int, suffix_tokens: int, rounds: int, shuffle: bool) -> Trace:
    prefixes = [_tokens(rng, prefix_tokens) for _ in range(num_prefixes)]
    order = []
    for _ in range(rounds):
        ids = list(range(num_prefixes))
        if shuffle:
            rng.shuffle(ids)
        order += ids
    prompts = [np.concatenate([prefixes[i], _tokens(rng, suffix_tokens)]) for i in order]
    return Trace(name, prompts, num_prefixes * (prefix_tokens // CHUNK))


def zipf_trace(name: str, rng, num_prefixes: int, requests: int, alpha: float, suffix_tokens: int, scan_every: int = 0,
               scan_tokens: int = 32 * CHUNK) -> Trace:
    lengths = rng.integers(1, 17, num_prefixes) * CHUNK
    prefixes = [_tokens(rng, int(n)) for n in lengths]
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** alpha
    picks = rng.choice(num_prefixes, size=requests, p=weights / weights.sum())
    prompts = []
    for r, i in enumerate(picks):
        if scan_every and r % scan_every == scan_every - 1:
            prompts.append(_tokens(rng, scan_tokens))
        prompts.append(np.concatenate([prefixes[i], _tokens(rng, suffix_tokens)]))
    return Trace(name, prompts, int(lengths.sum()) // CHUNK)


def two_turn_trace(name: str, rng, conversations: int, turn_tokens: int, pool_prompts: int) -> Trace:
    """Each conversation's first turn, then its second turn (first turn + a reply) after a
    random number of other requests, up to 0.8x what the pool holds: every reuse distance a
    pool of this size can serve with LRU, which keeps everything until it is full."""
    firsts = [_tokens(rng, turn_tokens) for _ in range(conversations)]
    events = []  # (time, order, prompt)
    for i, first in enumerate(firsts):
        t = float(i)
        events.append((t, 0, first))
        events.append((t + rng.uniform(1, 0.8 * pool_prompts), 1, np.concatenate([first, _tokens(rng, 256)])))
    events.sort(key=lambda e: (e[0], e[1]))
    return Trace(name, [p for _, _, p in events], conversations * (turn_tokens // CHUNK))


def tiny_layout(max_tokens: int) -> KVLayout:
    nb = max_tokens // BLOCK + 1
    kv = {"layers.0": torch.zeros(2, nb, BLOCK, 1, 8, dtype=torch.bfloat16)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=BLOCK)], model_name="eviction-replay")


def replay(trace: Trace, policy: str, pool_chunks: int) -> dict:
    max_tokens = max(len(p) for p in trace.prompts)
    layout = tiny_layout(max_tokens)
    chunk_bytes = sum(p.row_bytes for p in layout.planes) * CHUNK
    config = Config(chunk_size=CHUNK, max_local_cpu_size=pool_chunks * chunk_bytes / (1 << 30), num_threads=1, eviction=policy)
    engine = KVCacheEngine(layout, config)
    assert engine.pool.num_slots == pool_chunks, (engine.pool.num_slots, pool_chunks)
    tables = [list(range(max_tokens // BLOCK + 1))]
    hit_tokens = prompt_tokens = loads = 0
    start = time.perf_counter()
    for prompt in trace.prompts:
        hit = engine.lookup(prompt)
        if hit:
            hit = engine.retrieve(prompt, tables)
            loads += hit > 0
        mask = None
        if hit:
            mask = np.ones(len(prompt), dtype=bool)
            mask[:hit] = False
        engine.store(prompt, tables, mask=mask)
        hit_tokens += hit
        prompt_tokens += len(prompt)
    seconds = time.perf_counter() - start
    stats = engine.pool.stats()
    engine.close()
    return {"hit_ratio": hit_tokens / prompt_tokens, "loads": loads, "requests": len(trace.prompts),
            "evictions": stats.evictions, "us_per_request": seconds / len(trace.prompts) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--pool-fraction", type=float, default=0.6, help="pool size / distinct prefix chunks")
    ap.add_argument("--zipf-alpha", type=float, default=0.9)
    ap.add_argument("--suffix-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    policies = args.policies.split(",")
    rng = np.random.default_rng(args.seed)
    traces = [
        prefix_trace("cyclic", rng, 10, 2560, args.suffix_tokens, 8, shuffle=False),
        prefix_trace("shuffled", rng, 10, 2560, args.suffix_tokens, 8, shuffle=True),
        zipf_trace("zipf", rng, 200, 4000, args.zipf_alpha, args.suffix_tokens),
        zipf_trace("zipf+scan", rng, 200, 4000, args.zipf_alpha, args.suffix_tokens, scan_every=8),
        two_turn_trace("two-turn", rng, 400, 2048, pool_prompts=int(400 * args.pool_fraction)),
    ]
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, {platform.platform()}; chunk {CHUNK} tokens; "
          f"pool = {args.pool_fraction:.2f} x the distinct prefix chunks")
    print(f"{'workload':<10} {'pool':>5} {'policy':<7} {'hit ratio':>9} {'loads':>11} {'evictions':>9} {'us/req':>7}")
    for trace in traces:
        pool_chunks = max(1, int(trace.prefix_chunks * args.pool_fraction))
        for policy in policies:
            r = replay(trace, policy, pool_chunks)
            print(f"{trace.name:<10} {pool_chunks:>5} {policy:<7} {r['hit_ratio']:>9.3f} {r['loads']:>5}/{r['requests']:<5} "
                  f"{r['evictions']:>9} {r['us_per_request']:>7.0f}")


if __name__ == "__main__":
    main()
