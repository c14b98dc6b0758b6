"""What verified restores cost (issue 39 item 4; kvconnect/restore/verify.py, docs/performance.md).

    python benchmarks/verify_cost.py [--layout llama8b] [--tokens 4096] [--rate 0.01] [--repeats 5]

On one layout (benchmarks/layouts.py) a prompt of ``--tokens`` is
stored; then, each the best of ``--repeats``:

- *lookup*: ``engine.lookup(verify=True)`` with verification off (rate 0) and at ``--rate``
  with every draw declined (what 99 % of lookups pay at 0.01: one random draw);
- *retrieve*: loading the prompt's hit (what a served hit costs the engine's step);
- *plain re-store*: the store of an already stored prompt (its objects found present and skipped:
  what the save of a served-then-recomputed tail costs);
- *verifying store*: the same store when the prompt was sampled: its chunks gathered again into a
  scratch buffer and compared with the stored objects (bit-exact here: the same bytes).

A sampled request also gives up its hit: the engine computes the prefix instead of loading it.
That cost is the engine's prefill time of the hit tokens minus the retrieve, per sampled request;
at rate r it is r of that, averaged over hits. The script prints the figures kvconnect adds
(lookup, verifying store) per hit at ``--rate``; the prefill is the engine's and the model's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from layouts import LAYOUTS, full_block_tables

from kvconnect import Config, KVCacheEngine


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="llama8b", choices=sorted(LAYOUTS))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rate", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    layout = LAYOUTS[args.layout](args.tokens + 256)  # torch.empty: whatever bytes; compared as bytes first
    tables = full_block_tables(layout, args.tokens)
    tokens = np.random.default_rng(0).integers(0, 150000, args.tokens, dtype=np.int64)
    config = dict(chunk_size=256, max_local_cpu_size=4.0, num_threads=args.threads, pool_prefault=False)
    engine = KVCacheEngine(layout, Config(**config, verify_rate=args.rate, verify_first=0))
    assert engine.store(tokens, tables) > 0
    hit = engine.lookup(tokens)
    nbytes = engine.stats.stored_bytes

    engine.verifier.rate = 0.0
    lookup_off = best_of(lambda: engine.lookup(tokens, verify=True), args.repeats * 4)
    engine.verifier.rate = args.rate
    engine.verifier._rng.random = lambda: 1.0  # every draw declined: the price of the draw alone
    lookup_declined = best_of(lambda: engine.lookup(tokens, verify=True), args.repeats * 4)
    del engine.verifier._rng.random
    retrieve = best_of(lambda: engine.retrieve(tokens, tables), args.repeats)
    restore_plain = best_of(lambda: engine.store(tokens, tables), args.repeats)

    def verifying() -> None:
        engine.verifier.rate = 1.0
        assert engine.lookup(tokens, verify=True) == 0
        engine.store(tokens, tables)

    verify_store = best_of(verifying, args.repeats)
    checks, requests, retired = engine.verifier.snapshot()
    assert not retired and all(result == "exact" for _, result in checks), checks
    engine.close()

    added = args.rate * (verify_store - restore_plain) + (lookup_declined - lookup_off)
    print(f"layout {args.layout}: {args.tokens} tokens, hit {hit}, {nbytes / 2**20:.1f} MiB stored, {args.threads} threads")
    print(f"lookup (verify off)            {lookup_off * 1e3:8.3f} ms")
    print(f"lookup (rate {args.rate:g}, not drawn)  {lookup_declined * 1e3:8.3f} ms")
    print(f"retrieve of the hit            {retrieve * 1e3:8.3f} ms")
    print(f"plain re-store (skipped)       {restore_plain * 1e3:8.3f} ms")
    print(f"verifying store (gather+cmp)   {verify_store * 1e3:8.3f} ms  ({nbytes / verify_store / 1e9:.2f} GB/s compared)")
    print(f"kvconnect's own added cost per hit at rate {args.rate:g}: {added * 1e3:.3f} ms "
          f"({100 * added / retrieve:.2f} % of a retrieve); plus {args.rate:g} x (prefill of {hit} tokens - retrieve)")


if __name__ == "__main__":
    main()
