"""``kvconnect bench``: the transfer benchmark on one model's layout, on this machine's device.

Builds the model's caches (random bytes) with blocks for ``--tokens`` tokens, then times
through the engine API, side by side in one run: ``store`` (gather: paged cache -> CPU pool)
and ``retrieve`` (scatter: pool -> paged cache, the rows a restore at the prompt's end needs),
plus a plain copy of the same bytes on the same device (the memory's limit). The bytes are
those the engine wrote and read (with restore points: prefix parts and window parts, not whole
chunks). A run that would not fit this machine's free memory is refused before anything is
allocated, with the bytes it needs and the ``--layers`` that fit; figures scale with layers.
Results: a table (or ``--json``), then where the time goes: the transfer kernel's share
(its rows and their average size: a paged layout is many short rows, each its own copy) and
the rest, which is per-chunk work (keys, planning over the layout's planes, the pool's
bookkeeping), against the plain copy's one contiguous run (cache-hot when it fits the
CPU's last-level cache).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from .. import sizing
from ..config import GB, Config
from ..errors import ConfigError
from ..storage import host_memory
from ..transfer.tables import plane_table
from .model_args import add_model_args, human_bytes, model_of, parse_tokens, settle_chunk_size

FIT_FRACTION = 0.8  # of the memory free now: the rest stays for the OS and what else runs
# ``--markdown``: the columns of docs/performance.md's bench table (tools/doc_figures.py checks the table has them)
MARKDOWN_COLUMNS = ("preset (layers, tokens)", "planes", "store bytes", "store GB/s", "retrieve bytes", "retrieve GB/s",
                    "plain copy GB/s", "rows (average bytes)", "store CPU ms: copying + per-chunk work",
                    "retrieve CPU ms: copying + per-chunk work")


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
    p.add_argument("--markdown", action="store_true", help="a row of docs/performance.md's bench table (with its header)")


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", leave=False, disable=disable)


def _timed_runs(fn, device: str, repeats: int, bar, *, setup=None, cpu_seconds=None) -> tuple:
    """(the last run's result, seconds of each run after the first): ``repeats + 1`` runs of
    ``fn`` (``setup`` before each, untimed), the first a warm-up (page faults, threads).
    ``cpu_seconds``: a list that gets the calling thread's CPU seconds of each timed run (what a
    shared machine's other jobs do not add to)."""
    result, seconds = None, []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t0, c0 = time.perf_counter(), time.thread_time()
        result = fn()
        _sync(device)
        if i:
            seconds.append(time.perf_counter() - t0)
            if cpu_seconds is not None:
                cpu_seconds.append(time.thread_time() - c0)
        bar.update()
    return result, seconds


class _KernelClock:
    """Wraps the engine's gather or scatter: the calling thread's CPU seconds in it per run, and
    the rows of the last call (how many, and their bytes), so a run splits into copying and the rest."""

    def __init__(self, layout, fn) -> None:
        self.layout, self.fn = layout, fn
        self.cpu_s, self.laps, self.rows, self.row_bytes = 0.0, [], 0, 0

    def __call__(self, tables) -> None:
        c0 = time.thread_time()
        self.fn(tables)
        self.cpu_s += time.thread_time() - c0
        seg = tables.segments
        self.rows = int(seg[:, 1].sum()) if len(seg) else 0
        self.row_bytes = int((plane_table(self.layout)[seg[:, 0], 3] * seg[:, 1]).sum()) if len(seg) else 0

    def lap(self) -> None:
        self.laps.append(self.cpu_s)
        self.cpu_s = 0.0

    def timed_laps(self, repeats: int) -> list:
        """The CPU seconds of the last ``repeats`` runs (call ``lap`` after every run first)."""
        return self.laps[-repeats:]


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
    quiet = args.no_progress or args.json or args.markdown
    layout = model.layout(num_tokens, device=device, fill=True)
    s = sizing.of(layout, args.chunk_size)
    engine = KVCacheEngine(layout, Config(chunk_size=args.chunk_size, max_local_cpu_size=need["pool"] / GB,
                                          num_threads=args.threads, restore_interval_tokens=config.restore_interval_tokens))
    try:
        tokens = np.arange(num_tokens, dtype=np.int64)
        tables = [list(range(n - 1)) for n in model.blocks_for(num_tokens)]  # blocks_for keeps one spare block
        with _progress(3 * (args.repeats + 1), f"{model.name} x{num_tokens}", quiet) as bar:
            # every store goes into an empty pool (cleared outside the timing)
            # the engine's own write and read paths call these: the kernels' share of each run
            gather = engine.restore.writer.gather = _KernelClock(engine.layout, engine.restore.writer.gather)
            scatter = engine.restore.loader.scatter = _KernelClock(engine.layout, engine.restore.loader.scatter)
            store_cpu, retrieve_cpu = [], []
            before = engine.stats_snapshot()
            stored, store_s = _timed_runs(lambda: (engine.store(tokens, tables), gather.lap())[0], device, args.repeats, bar,
                                          setup=engine.pool.clear, cpu_seconds=store_cpu)
            middle = engine.stats_snapshot()
            retrieved, retrieve_s = _timed_runs(lambda: (engine.retrieve(tokens, tables), scatter.lap())[0], device,
                                                args.repeats, bar, cpu_seconds=retrieve_cpu)
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
            "planes": len(engine.layout.planes), "groups": layout.num_groups, "repeats": args.repeats,
            "restore_interval_tokens": config.restore_interval_tokens,
            "whole_chunk_bytes": s.stored_bytes(num_tokens), "whole_chunk_restore_bytes": s.restore_bytes(num_tokens),
            "ops": [
                _op("store (gather)", written, s.num_chunks(num_tokens), store_s),
                _op("retrieve (scatter)", loaded, s.num_chunks(num_tokens), retrieve_s),
                _op("plain copy, same bytes", written, 0, copy_s),
            ],
            "where": [
                _where("store", store_cpu, gather.timed_laps(args.repeats), gather, s.num_chunks(num_tokens)),
                _where("retrieve", retrieve_cpu, scatter.timed_laps(args.repeats), scatter, s.num_chunks(num_tokens)),
            ] if device == "cpu" else [],
            "last_level_cache_bytes": _last_level_cache_bytes() if device == "cpu" else None,
        }
    finally:
        engine.close()
    print(json.dumps(result, indent=2) if args.json else markdown(result) if args.markdown else human(result))
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


def _where(name: str, cpu_s: list, kernel_cpu_s: list, clock: _KernelClock, chunks: int) -> dict:
    """One operation's runs in the calling thread's CPU seconds (medians), split into the
    transfer kernel and the rest (per chunk). CPU time, not wall time: on a shared machine the
    other jobs' time slices are not the operation's."""
    other = [max(t - k, 0.0) for t, k in zip(cpu_s, kernel_cpu_s)]
    return {"op": name, "cpu_s": statistics.median(cpu_s), "kernel_cpu_s": statistics.median(kernel_cpu_s),
            "other_cpu_s": statistics.median(other), "other_per_chunk_s": statistics.median(other) / max(chunks, 1),
            "rows": clock.rows, "avg_row_bytes": clock.row_bytes / clock.rows if clock.rows else 0.0}


def _last_level_cache_bytes():
    """The largest CPU cache of cpu0 in bytes (sysfs), None when the host does not say."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(e for e in os.listdir(base) if e.startswith("index")):
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            size = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = size if best is None else max(best, size)
    except (OSError, ValueError):
        return best
    return best


def markdown(r: dict) -> str:
    """The header of docs/performance.md's bench table and this run's row (MARKDOWN_COLUMNS)."""
    store, retrieve, copy = r["ops"]
    where = {w["op"]: w for w in r.get("where", [])}

    def split(name: str) -> str:
        w = where.get(name)
        return f"{w['kernel_cpu_s'] * 1e3:.2f} + {w['other_per_chunk_s'] * 1e3:.3f} x {store['chunks']}" if w else "-"

    rows = where.get("store")
    cells = (f"{r['model']} ({r['layers']}, {r['tokens']})", str(r["planes"]), human_bytes(store["bytes"]),
             f"{store['gb_per_s']:.2f}", human_bytes(retrieve["bytes"]), f"{retrieve['gb_per_s']:.2f}", f"{copy['gb_per_s']:.2f}",
             f"{rows['rows']:,} ({rows['avg_row_bytes']:,.0f})" if rows else "-", split("store"), split("retrieve"))
    return "\n".join(["| " + " | ".join(MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(MARKDOWN_COLUMNS),
                      "| " + " | ".join(cells) + " |"])


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
    copy = r["ops"][2]
    for w in r.get("where", []):
        lines.append(f"{w['op']}: {w['cpu_s'] * 1e3:.2f} ms of CPU (median) = copying {w['kernel_cpu_s'] * 1e3:.2f} ms "
                     f"({w['rows']:,} rows of {w['avg_row_bytes']:,.0f} bytes on average) + "
                     f"{w['other_cpu_s'] * 1e3:.2f} ms of per-chunk work ({w['other_per_chunk_s'] * 1e3:.3f} ms per chunk: "
                     f"keys, planning over {r['planes']} planes, the pool's bookkeeping)")
    if r.get("where"):
        llc = r.get("last_level_cache_bytes")
        hot = (f"; {human_bytes(copy['bytes'])} fit this CPU's {human_bytes(llc)} last-level cache, so it runs cache-hot"
               if llc and 2 * copy["bytes"] <= llc else "")
        lines.append(f"plain copy: the same bytes as one contiguous run, the memory's limit{hot}")
    if r["whole_chunk_bytes"] != r["ops"][0]["bytes"]:
        lines.append(f"bytes are those written and read: restore points every {r['restore_interval_tokens']:,} tokens store "
                     f"prefix parts and window parts; as whole chunks the prompt is {human_bytes(r['whole_chunk_bytes'])} "
                     f"(a restore {human_bytes(r['whole_chunk_restore_bytes'])})")
    return "\n".join(lines)
