"""Replay public request traces through kvconnect's engine API with a model's byte proportions.

    python3 benchmarks/trace_replay.py [--trace synthetic|conversation|PATH] [--preset deepseek-v4-flash]
        [--pool-gb 50,100,300] [--configs today,0,4096,16384] [--tensors per-layer,per-group] [--limit N] [--json]

Per request, in arrival order: ``lookup(prompt)``, ``retrieve`` of the hit (what an engine
would load), then ``store`` of the prompt beyond the hit (as the vLLM connector saves what
it computed). Token ids come from the trace's block hash ids (``id * 512 + j + 1``), so
equal ids give equal tokens and prompts share prefixes exactly as the trace says.

Byte proportions, scaled so a run takes minutes on 2 cores: a CPU pool holds a number of
fixed slots, one object per slot, so a pool of G GB of the real model holds
``G / real slot bytes`` objects. The replay builds a tiny layout with the same object
structure as the preset's (one full group = the prefix part; one window group with as many
planes as the real window part has pieces, window 128 tokens: DeepSeek V4's windows are
<= 128), gives its pool exactly that many slots, and reports bytes in the real model's
units. ``today`` is the per-chunk format before restore points (``window_parts=False``:
every group's rows in one object per chunk, slots of a whole chunk); a number is a restore
interval in tokens (0: a restore point at every chunk end).

``--tensors``: how the engine registers the preset's caches: ``per-layer`` (one tensor per
layer, as vLLM does) or ``per-group`` (one tensor per cache group, all its layers in one row, as
an engine with one buffer per cache type or a Python API user would). The engine cuts a window
plane wider than a slot into column slices (``restore.parts.slice_wide_planes``), so both give
the same slots; the replay checks it by serving the same share.

Reported per pool size and configuration: the share of prompt tokens served from the cache,
that share over the infinite-cache ideal (the share of prompt tokens in full chunks whose
prefix an earlier request had: what an unbounded cache of whole chunks serves), the real
bytes written per cached prefix token, and the objects evicted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvconnect import Config, GroupSpec, KVCacheEngine, KVLayout  # noqa: E402
from kvconnect.errors import ConfigError  # noqa: E402
from kvconnect.integrations import presets  # noqa: E402
from kvconnect.restore.parts import PartLayout, slice_wide_planes  # noqa: E402
from kvconnect.restore.plan import max_chunk_payload_bytes  # noqa: E402
from kvconnect.restore.points import splits_window_groups  # noqa: E402
from kvconnect.storage import host_memory  # noqa: E402

TRACES = Path(__file__).resolve().parent / "data" / "traces"  # shipped with the repository (README there: source, licence)
BLOCK_TOKENS = 512  # one trace hash id
CHUNK = 256
GB = 1 << 30


def load_trace(name: str, limit: int = 0) -> list[dict]:
    path = Path(name) if os.path.sep in name or name.endswith(".jsonl") else TRACES / f"{name}_trace.jsonl"
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if limit and len(out) >= limit:
                break
    return out


def prompt_tokens(req: dict) -> np.ndarray:
    ids = np.asarray(req["hash_ids"], np.int64)
    tok = (ids[:, None] * BLOCK_TOKENS + np.arange(BLOCK_TOKENS, dtype=np.int64)[None, :] + 1).reshape(-1)
    return tok[: req["input_length"]]


def ideal_share(trace: list[dict]) -> float:
    """Infinite cache of whole chunks: prompt tokens in full chunks whose prefix an earlier
    request had (the trace's hash ids are chained: a block's id names its whole prefix), capped
    as the replay caps a hit (an engine computes at least one token)."""
    seen: set = set()
    served = total = 0
    for req in trace:
        n, ids = req["input_length"], req["hash_ids"]
        keys = [(ids[((i + 1) * CHUNK - 1) // BLOCK_TOKENS], (i + 1) * CHUNK) for i in range(n // CHUNK)]
        hit = 0
        for key in keys[: (n - 1) // CHUNK]:
            if key not in seen:
                break
            hit += 1
        seen.update(keys)
        served += hit * CHUNK
        total += n
    return served / total


def _interval(config: str) -> int:
    """The restore interval a replay configuration names ("today": whole chunks, interval 0)."""
    return 0 if config == "today" else int(config)


def per_group_tensors(layout: KVLayout) -> KVLayout:
    """The same caches registered one tensor per group: each group's planes side by side in one
    row (their bytes per row summed), as an engine with one buffer per cache type would."""
    kv, layer_groups, hints = {}, {}, {}
    for g in range(layout.num_groups):
        members = [layout.planes[i] for i in layout.planes_of_group(g)]
        first = members[0]
        name = f"group{g}"
        kv[name] = torch.zeros(first.num_blocks, first.rows_per_block, sum(p.row_bytes for p in members), dtype=torch.uint8)
        layer_groups[name] = g
        hints[name] = "page" if first.is_page else None
    return KVLayout.from_tensors(kv, groups=list(layout.groups), layer_groups=layer_groups, layout_hints=hints,
                                 model_name=layout.model_name)


class Model:
    """The preset's real object sizes and a tiny layout with the same object structure."""

    def __init__(self, preset: str, max_tokens: int, tensors: str = "per-layer") -> None:
        real = presets.preset(preset).layout(0)
        if tensors == "per-group":
            real = per_group_tensors(real)
        elif tensors != "per-layer":
            raise ValueError(f"--tensors is per-layer or per-group, got {tensors!r}")
        real = slice_wide_planes(real, CHUNK)  # as the engine stores it
        self.name = preset
        self.tensors = tensors
        self.parts = PartLayout.of(real, CHUNK)
        self.whole_bytes = max_chunk_payload_bytes(real, CHUNK)
        pieces = max(1, len(self.parts.pieces))
        nb = max_tokens // CHUNK + 2
        kv = {"full": torch.zeros(nb, CHUNK, 4, dtype=torch.uint8)}
        groups = [GroupSpec(block_size=CHUNK)]
        layer_groups = {"full": 0}
        if self.parts.split:
            groups.append(GroupSpec(block_size=CHUNK, sliding_window=128))
            for i in range(pieces):
                kv[f"window.{i}"] = torch.zeros(nb, CHUNK, 8, dtype=torch.uint8)
                layer_groups[f"window.{i}"] = 1
        self.kv = kv
        self.layout = KVLayout.from_tensors(kv, groups=groups, layer_groups=layer_groups, model_name=f"replay-{preset}")
        self.block_ids = [np.arange(nb, dtype=np.int64) for _ in groups]
        self.scaled_split = PartLayout.of(self.layout, CHUNK)
        self.scaled_whole = PartLayout.of(self.layout, CHUNK, split=False)
        assert len(self.scaled_split.pieces) == len(self.parts.pieces)

    def scaled_pool(self, config: str, pool_gb: float) -> tuple[int, int]:
        """(slots, bytes) of the scaled pool standing for ``pool_gb`` of the real model's."""
        split = splits_window_groups(_interval(config))  # the engine's own rule: interval 0 keeps chunks whole
        real_slot = self.parts.slot_bytes if split else self.whole_bytes
        slots = int(pool_gb * GB // real_slot)
        scaled = self.scaled_split if split else self.scaled_whole
        return slots, slots * scaled.slot_bytes

    def engine(self, config: str, pool_gb: float) -> KVCacheEngine:
        interval = _interval(config)
        split = splits_window_groups(interval)
        slots, _ = self.scaled_pool(config, pool_gb)
        scaled = self.scaled_split if split else self.scaled_whole
        cfg = Config(chunk_size=CHUNK, max_local_cpu_size=slots * scaled.slot_bytes / GB + 1e-9, num_threads=1,
                     pool_prefault=False, restore_interval_tokens=interval, log_interval_s=0)
        eng = KVCacheEngine(self.layout, cfg, window_parts=split)
        assert eng.pool.num_slots == slots, (eng.pool.num_slots, slots)
        return eng

    def real_bytes(self, eng: KVCacheEngine) -> int:
        s = eng.stats
        if not eng.parts.split:
            return s.stored_chunks * self.whole_bytes
        pieces = len(eng.parts.pieces)
        return s.stored_chunks * self.parts.prefix_bytes + s.window_pieces_stored * self.parts.window_bytes // pieces


def serve_request(eng: KVCacheEngine, tok: np.ndarray, block_ids) -> int:
    """One request through the engine API, as an engine would: look up, load the hit (at least one
    token is computed), store the prompt beyond it. Returns the tokens loaded."""
    hit = min(eng.lookup(tok), (len(tok) - 1) // CHUNK * CHUNK)
    loaded = eng.retrieve(tok[:hit], block_ids) if hit else 0
    mask = None
    if loaded:
        mask = np.ones(len(tok), np.bool_)
        mask[:loaded] = False
    eng.store(tok, block_ids, mask)
    return loaded


def replay(model: Model, trace: list[dict], config: str, pool_gb: float) -> dict:
    eng = model.engine(config, pool_gb)
    served = total = 0
    start = time.perf_counter()
    try:
        for req in trace:
            tok = prompt_tokens(req)
            total += len(tok)
            served += serve_request(eng, tok, model.block_ids)
        s = eng.stats
        cached_tokens = s.stored_chunks * CHUNK
        return {
            "config": config, "pool_gb": pool_gb, "slots": eng.pool.num_slots, "served": served / total,
            "bytes_per_cached_token": model.real_bytes(eng) / max(1, cached_tokens),
            "window_parts_stored": s.window_parts_stored, "restore_point_hits": s.restore_point_hits,
            "evictions": eng.pool.stats().evictions, "seconds": time.perf_counter() - start,
        }
    finally:
        eng.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="synthetic")
    p.add_argument("--preset", default="deepseek-v4-flash")
    p.add_argument("--pool-gb", default="50,100,300")
    p.add_argument("--configs", default="today,0,4096,16384")
    p.add_argument("--tensors", default="per-layer", help="per-layer, per-group, or both (comma-separated)")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    trace = load_trace(args.trace, args.limit)
    models = [Model(args.preset, max(r["input_length"] for r in trace), t) for t in args.tensors.split(",")]
    model = models[0]
    sizes = [float(x) for x in args.pool_gb.split(",")]
    try:  # the largest scaled pool, before any is allocated: past free memory the OOM killer ends the run
        gb, config = max(((gb, c) for gb in sizes for c in args.configs.split(",")), key=lambda x: model.scaled_pool(*reversed(x))[1])
        slots, nbytes = model.scaled_pool(config, gb)
        host_memory.check_fits_host(nbytes, f"--pool-gb {gb:g} ({config}: {slots:,} slots of the scaled layout)",
                                    advice="pass a smaller --pool-gb")
    except ConfigError as exc:
        print(f"trace replay: {exc}", file=sys.stderr)
        return 2
    ideal = ideal_share(trace)
    rows = []
    for gb in sizes:
        for config in args.configs.split(","):
            for model in models:
                row = replay(model, trace, config, gb)
                row["of_ideal"] = row["served"] / ideal if ideal else 0.0
                row["tensors"] = model.tensors
                rows.append(row)
                if not args.json:
                    print(f"{args.trace} {args.preset} {model.tensors} pool {gb:g} GB {config:>6}: served {row['served']:.3f} "
                          f"({row['of_ideal']:.2f} of ideal {ideal:.3f}), {row['bytes_per_cached_token'] / 1024:.1f} KiB "
                          f"per cached token, {row['window_parts_stored']} window parts, {row['evictions']} evictions, "
                          f"{row['slots']} slots, {row['seconds']:.0f} s", flush=True)
    if args.json:
        print(json.dumps({"trace": args.trace, "preset": args.preset, "requests": len(trace), "ideal": ideal,
                          "real_prefix_bytes": model.parts.prefix_bytes, "real_window_bytes": model.parts.window_bytes,
                          "real_slot_bytes": {m.tensors: m.parts.slot_bytes for m in models},
                          "real_whole_chunk_bytes": model.whole_bytes,
                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
