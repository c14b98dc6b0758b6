"""Device ops of the torch transfer path per batch: an 8K-token DeepSeek-V4-Flash store and retrieve.

The torch path is what an NPU user gets where Triton is unavailable; each aten op it issues on the
planes' device is one kernel launch (plus its host overhead) there. This counts them on CPU tensors
(the count does not depend on the device) with a TorchDispatchMode: every aten op the call issues,
and the subset that launches work (view and metadata ops - view, slice, as_strided, set_, ... -
launch nothing). Layout: benchmarks/gpu_transfer.py's ``dsv4_flash`` (examples/dsv4_cache.py
geometry, 44 layers, 168 planes), padded and per-block packed; tables: the planner's own store and
retrieve tables of 8192 tokens in 256-token chunks (32 chunks).

    python3 benchmarks/torch_path_ops.py [--tokens 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvconnect
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_transfer as gt  # noqa: E402

from kvconnect.transfer import dispatch  # noqa: E402

gt.DEVICE = "cpu"

_NO_LAUNCH = {"view", "_unsafe_view", "slice", "as_strided", "set_", "select", "reshape", "alias", "unsqueeze",
              "expand", "t", "detach", "lift_fresh", "empty", "empty_strided", "_reshape_alias", "split", "split_with_sizes",
              "unbind", "narrow", "squeeze", "permute", "transpose"}


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launches(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in _NO_LAUNCH)


def count(fn) -> tuple[OpCount, float]:
    fn()  # first call builds per-layout caches (byte views), as an engine's first store does
    with OpCount() as c:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    return c, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {}
    for packed in (False, True):
        layout = gt.dsv4_flash(args.tokens + gt.CHUNK, packed=packed)
        gt.randomize(layout)
        ids = gt.block_ids(layout, args.tokens, torch.Generator().manual_seed(0))
        job = gt.Job(layout, args.tokens, ids, 0)
        buf = torch.zeros(job.span_bytes, dtype=torch.uint8)
        name = "dsv4_packed" if packed else "dsv4_flash"
        for direction, tables in (("store", job.store), ("retrieve", job.load)):
            fn = (lambda t=tables: dispatch.gather(layout, t, buf, backend="torch")) if direction == "store" else \
                 (lambda t=tables: dispatch.scatter(layout, t, buf, backend="torch"))
            c, seconds = count(fn)
            key = f"{name} {direction}"
            results[key] = {"planes": len(layout.planes), "segments": int(len(tables.segments)),
                            "rows": int(tables.num_rows), "aten_ops": sum(c.ops.values()), "launches": c.launches(),
                            "seconds_cpu": round(seconds, 4), "top_ops": dict(c.ops.most_common(6))}
            r = results[key]
            print(f"{key:22s} planes={r['planes']} segments={r['segments']:6d} rows={r['rows']:7d} "
                  f"aten_ops={r['aten_ops']:6d} launches={r['launches']:6d} cpu={r['seconds_cpu']:.3f}s  {r['top_ops']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
