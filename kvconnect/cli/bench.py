"""``kvconnect bench``: the transfer benchmark on one model's layout, on this machine's device.

Builds the model's caches (random bytes) with blocks for ``--tokens`` tokens, then times
through the engine API, side by side in one run: ``store`` (gather: paged cache -> CPU pool)
and ``retrieve`` (scatter: pool -> paged cache, the rows a restore at the prompt's end needs),
plus a plain copy of the same bytes on the same device (the memory's limit). The bytes are
those the engine wrote and read (with restore points: prefix parts and window parts, not whole
chunks). A run that would not fit this machine's free memory is refused before anything is
allocated, with the bytes it needs and the ``--layers`` that fit; figures scale with layers.
Results: a table (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from .. import sizing
from ..config import GB, Config
from ..errors import ConfigError
from ..storage import host_memory
from .model_args import add_model_args, human_bytes, model_of, parse_tokens, settle_chunk_size

FIT_FRACTION = 0.8  # of the memory free now: the rest stays for the OS and what else runs


def add_parser(sub, config: Config) -> None:
    p = sub.add_parser("bench", help="benchmark store / retrieve on a model's layout on this machine")
    add_model_args(p, config)
    p.add_argument("--layers", type=int, default=None, help="build only the first N layers (default: all)")
    p.add_argument("--tokens", default="4096", help="prompt length stored and restored (default 4096)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per operation (default 5; the best is reported)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=config.num_threads, help="CPU kernel threads (default KVCONNECT_NUM_THREADS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", leave=False, disable=disable)


def _timed_runs(fn, device: str, repeats: int, bar, *, setup=None) -> tuple:
    """(the last run's result, seconds of each run after the first): ``repeats + 1`` runs of
    ``fn`` (``setup`` before each, untimed), the first a warm-up (page faults, threads)."""
    result, seconds = None, []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        if i:
            seconds.append(time.perf_counter() - t0)
        bar.update()
    return result, seconds


def needed_bytes(model, num_tokens: int, chunk_tokens: int) -> dict[str, int]:
    """What a bench run allocates, by purpose, before allocating any of it: the engine's caches
    (blocks for ``num_tokens``), the CPU pool (whole chunks, an upper bound with restore points)
    and the two buffers of the plain copy (at most the whole chunks' bytes)."""
    s = sizing.of(model.layout(0), chunk_tokens)
    return {"caches": model.cache_bytes(num_tokens), "pool": s.pool_bytes(num_tokens) + s.slot_bytes,
            "copy": 2 * s.stored_bytes(num_tokens)}


def check_fits(model, num_tokens: int, chunk_tokens: int, device: str, *, with_layers=None, host_room=None) -> dict[str, int]:
    """The bytes the run needs (``needed_bytes``); ConfigError naming them and the ``--layers`` that
    fit when this run cannot fit this machine now. ``with_layers(n)``: the model cut to n layers
    (the advice is checked, not extrapolated: layer kinds differ in size); ``host_room``: (bytes,
    what bounds them), default the host's now.

    A run past the host's memory does not fail cleanly: the kernel's OOM killer ends it (and may
    take other processes first), so the check comes before the first allocation."""
    room, why = host_room or host_memory.host_room()
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else None

    def short(need: dict[str, int]):  # (asked, have, what) of the first budget ``need`` exceeds, or None
        on_host = need["pool"] + (0 if device == "cuda" else need["caches"] + need["copy"])
        checks = [(on_host, room, f"host memory ({why})")]
        if free is not None:
            checks.append((need["caches"] + need["copy"], free, "free device memory"))
        return next(((a, h, w) for a, h, w in checks if h is not None and a > h * FIT_FRACTION), None)

    need = needed_bytes(model, num_tokens, chunk_tokens)
    over = short(need)
    if over is None:
        return need
    asked, have, what = over
    layers = _num_layers(model)
    fit = min(layers - 1, int(layers * have * FIT_FRACTION // asked))
    while with_layers is not None and fit >= 1 and short(needed_bytes(with_layers(fit), num_tokens, chunk_tokens)):
        fit -= 1
    hint = f"pass --layers {fit} (figures scale with layers) or fewer --tokens" if fit >= 1 else "pass fewer --tokens"
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need.items())
    raise ConfigError(f"bench of {model.name} ({layers} layers, {num_tokens:,} tokens) needs {human_bytes(asked)} of "
                      f"{what.split(' (')[0]} ({parts}); this machine has {human_bytes(have)} of {what}: {hint}")


def _num_layers(model) -> int:
    return len({c.layer.split(".")[1] for c in model.caches})


def run(args: argparse.Namespace, config: Config) -> int:
    from ..engine import KVCacheEngine

    if args.repeats < 1 or args.threads < 1 or (args.layers is not None and args.layers < 1):
        raise ConfigError("--repeats, --threads and --layers must be >= 1")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device must be cpu or an available cuda, got {device!r}")
    num_tokens = parse_tokens(args.tokens)
    model = model_of(args, layers=args.layers)
    if model.state_layers and not model.snapshots_served:
        raise ConfigError(f"{model.name}: kvconnect's {args.engine} adapter does not store recurrent state "
                          "(see `kvconnect inspect`, docs/recurrent.md); nothing to benchmark")
    chunk_reason = settle_chunk_size(args, model.layout(0))
    if num_tokens < args.chunk_size:
        raise ConfigError(f"--tokens ({num_tokens}) must hold at least one chunk of {args.chunk_size}")
    num_tokens -= num_tokens % args.chunk_size
    need = check_fits(model, num_tokens, args.chunk_size, device, with_layers=lambda n: model_of(args, layers=n))
    quiet = args.no_progress or args.json
    layout = model.layout(num_tokens, device=device, fill=True)
    s = sizing.of(layout, args.chunk_size)
    engine = KVCacheEngine(layout, Config(chunk_size=args.chunk_size, max_local_cpu_size=need["pool"] / GB,
                                          num_threads=args.threads, restore_interval_tokens=config.restore_interval_tokens))
    try:
        tokens = np.arange(num_tokens, dtype=np.int64)
        tables = [list(range(n - 1)) for n in model.blocks_for(num_tokens)]  # blocks_for keeps one spare block
        with _progress(3 * (args.repeats + 1), f"{model.name} x{num_tokens}", quiet) as bar:
            # every store goes into an empty pool (cleared outside the timing)
            before = engine.stats_snapshot()
            stored, store_s = _timed_runs(lambda: engine.store(tokens, tables), device, args.repeats, bar,
                                          setup=engine.pool.clear)
            middle = engine.stats_snapshot()
            retrieved, retrieve_s = _timed_runs(lambda: engine.retrieve(tokens, tables), device, args.repeats, bar)
            after = engine.stats_snapshot()
            # the bytes each run moved, as the engine counted them: with restore points a store
            # writes prefix parts and window parts, not whole chunks
            runs = args.repeats + 1
            written = (middle["stored_bytes"] - before["stored_bytes"]) // runs
            loaded = (after["retrieved_bytes"] - middle["retrieved_bytes"]) // runs
            src = torch.empty(max(written, 1), dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            _, copy_s = _timed_runs(lambda: dst.copy_(src), device, args.repeats, bar)
        if stored != num_tokens or retrieved != num_tokens:
            raise RuntimeError(f"benchmark run stored {stored} and restored {retrieved} of {num_tokens} tokens")
        result = {
            "model": model.name, "engine": model.engine, "device": device, "machine": _machine(device),
            "threads": args.threads, "tokens": num_tokens, "chunk_tokens": args.chunk_size, "chunk_reason": chunk_reason, "layers": _num_layers(model),
            "planes": len(layout.planes), "groups": layout.num_groups, "repeats": args.repeats,
            "restore_interval_tokens": config.restore_interval_tokens,
            "whole_chunk_bytes": s.stored_bytes(num_tokens), "whole_chunk_restore_bytes": s.restore_bytes(num_tokens),
            "ops": [
                _op("store (gather)", written, s.num_chunks(num_tokens), store_s),
                _op("retrieve (scatter)", loaded, s.num_chunks(num_tokens), retrieve_s),
                _op("plain copy, same bytes", written, 0, copy_s),
            ],
        }
    finally:
        engine.close()
    print(json.dumps(result, indent=2) if args.json else human(result))
    return 0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def _op(name: str, nbytes: int, chunks: int, times: list) -> dict:
    best = min(times)
    return {"op": name, "bytes": nbytes, "chunks": chunks, "best_s": best, "median_s": statistics.median(times),
            "gb_per_s": nbytes / best / 1e9 if best > 0 else 0.0}


def human(r: dict) -> str:
    lines = [f"{r['model']} ({r['layers']} layers, {r['planes']} planes, {r['groups']} groups) on {r['engine']}'s layout; "
             f"{r['tokens']:,} tokens, chunk {r['chunk_tokens']}; {r['device']} ({r['machine']}), {r['threads']} threads, "
             f"best of {r['repeats']}"]
    head = ("operation", "bytes", "chunks", "best ms", "median ms", "GB/s")
    rows = [(o["op"], human_bytes(o["bytes"]), str(o["chunks"] or "-"), f"{o['best_s'] * 1e3:.2f}", f"{o['median_s'] * 1e3:.2f}",
             f"{o['gb_per_s']:.2f}") for o in r["ops"]]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        lines.append("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    if r["whole_chunk_bytes"] != r["ops"][0]["bytes"]:
        lines.append(f"bytes are those written and read: restore points every {r['restore_interval_tokens']:,} tokens store "
                     f"prefix parts and window parts; as whole chunks the prompt is {human_bytes(r['whole_chunk_bytes'])} "
                     f"(a restore {human_bytes(r['whole_chunk_restore_bytes'])})")
    return "\n".join(lines)
