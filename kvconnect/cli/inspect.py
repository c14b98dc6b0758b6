"""``kvconnect inspect``: a model's KV layout as kvconnect sees it, and what it costs to keep.

Builds the real ``KVLayout`` over the engine's tensors (a couple of blocks each) and reads
every figure from ``kvconnect.sizing``: groups and planes, bytes per chunk and per token,
what a restore at P loads, and the pool, disk and remote bytes for N tokens (with restore
points, the default on a layout with window or state groups, those the parts take: the
whole-chunk figures stand beside them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional

from .. import sizing
from ..config import Config
from .model_args import add_model_args, human_bytes, model_of, parse_tokens, settle_chunk_size


DEFAULT_RESTORE_CAP = "128k"  # read as --restore-at reads it (k = 1,000)


def add_parser(sub, config: Config) -> None:
    p = sub.add_parser("inspect", help="describe a model's KV layout and size kvconnect's storage for it")
    add_model_args(p, config)
    p.add_argument("--tokens", default="1M", help="tokens to size the pool for (e.g. 1M, 32k; default 1M)")
    p.add_argument("--restore-at", default=None, help="prefix length P of a restore (default: --tokens, capped at 128k = 128,000)")
    p.add_argument("--restore-interval", type=int, default=config.restore_interval_tokens,
                   help="restore interval in tokens for the restore-point figures (default KVCONNECT_RESTORE_INTERVAL_TOKENS)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def report(args: argparse.Namespace) -> dict:
    model = model_of(args)
    tokens = parse_tokens(args.tokens)
    layout = model.layout(0)
    chunk_reason = settle_chunk_size(args, layout)
    asked = parse_tokens(args.restore_at) if args.restore_at else min(tokens, parse_tokens(DEFAULT_RESTORE_CAP))
    restore_at = asked - asked % args.chunk_size  # a hit ends on a chunk boundary (whole chunks are stored)
    s = sizing.of(layout, args.chunk_size)
    supported = not model.state_layers or model.snapshots_served
    per_group_restore = [s._group_bytes(g, geo.needed_rows(restore_at)) for g, geo in enumerate(layout.geometries)]
    rp = sizing.restore_point_sizing(layout, args.chunk_size, args.restore_interval)
    # what the engine keeps for N tokens: with restore points (the default on a layout with window or
    # state groups) prefix parts plus a window part per restore point, in slots of the largest part
    kept = (lambda per_token: int(per_token * tokens)) if rp.split else None
    stored = (kept(rp.bytes_per_token) if kept else s.stored_bytes(tokens)) if supported else 0
    pool = (kept(rp.pool_bytes_per_token) if kept else s.pool_bytes(tokens)) if supported else 0
    tier = (stored + (s.encoded_bytes(tokens) - s.stored_bytes(tokens)) if kept else s.encoded_bytes(tokens)) if supported else 0
    return {
        "model": model.name, "engine": model.engine, "tp": model.tp_size, "dcp": model.dcp.size,
        "chunk_tokens": args.chunk_size, "chunk_reason": chunk_reason, "num_planes": len(layout.planes), "fingerprint": bytes(layout.fingerprint).hex(),
        "supported": supported, "notes": list(model.notes),
        "state_layers": len(model.state_layers), "state_bytes_per_layer": model.state_bytes_per_layer,
        "snapshot": {"bytes": len(model.state_layers) * model.state_bytes_per_layer,
                     "parts_per_layer": [{"what": w, "bytes": b} for w, b in model.state_parts],
                     "stored": model.snapshots_served} if model.state_layers else None,
        "groups": [
            {"group": g.index, "name": model.group_names[g.index], "kind": g.kind, "block_size": g.block_size,
             "compress_ratio": g.compress_ratio, "window_tokens": g.window_tokens, "num_planes": g.num_planes,
             "row_bytes": g.row_bytes, "rows_per_chunk": g.rows_per_chunk, "bytes_per_chunk": g.bytes_per_chunk,
             "restore_bytes": per_group_restore[g.index]}
            for g in s.groups
        ],
        "bytes_per_chunk": s.bytes_per_chunk,
        "bytes_per_token": s.bytes_per_chunk / args.chunk_size,
        "pool_slot_bytes": s.slot_bytes,
        "tokens": tokens,
        "chunks": s.num_chunks(tokens),
        "stored_bytes": stored,
        "pool_bytes": pool,
        "tier_bytes": tier,
        "restore_points_sized": bool(kept) and supported,  # the three above: restore points, steady state
        "whole_chunk_stored_bytes": s.stored_bytes(tokens) if supported else 0,
        "whole_chunk_pool_bytes": s.pool_bytes(tokens) if supported else 0,
        # every figure above is one rank's; a shared tier holds the chunks of these many ranks
        "tp_replicated": model.tp_replicated and model.tp_size > 1,
        "shared_tier_writers": model.shared_writers,
        "shared_tier_bytes": tier * model.shared_writers,
        "restore_asked": asked,
        "restore_at": restore_at,
        "restore_bytes": s.restore_bytes(restore_at) if supported else 0,
        "restore_chunks": s.num_chunks(restore_at),
        "restore_points": dataclasses.asdict(rp),
    }


def mooncake_report(config: Config, tier_bytes: int) -> Optional[dict]:
    """Who holds the Mooncake segment and how much, for a ``mooncakestore://`` remote_url."""
    from ..storage.mooncake.config import is_mooncake_url, make_spec

    if not is_mooncake_url(config.remote_url):
        return None
    spec = make_spec(config.remote_url, config.mooncake_config_path, has_node_server=bool(config.server_url))
    if spec.global_segment_bytes:
        holder = "this engine process: its share leaves with it"
    elif config.server_url:
        holder = "the node server (kvconnect server --mooncake-segment-gb)"
    else:
        holder = "another process (kvconnect server --mooncake-segment-gb or mooncake_client)"
    return {"master": spec.master_address, "protocol": spec.protocol, "local_hostname": spec.local_hostname,
            "engine_segment_bytes": spec.global_segment_bytes, "holder": holder,
            "segments_needed_bytes": int(tier_bytes * 1.1)}


def run(args: argparse.Namespace, config: Config) -> int:
    r = report(args)
    r["mooncake"] = mooncake_report(config, r["tier_bytes"])
    print(json.dumps(r, indent=2) if args.json else human(r))
    return 0


def human(r: dict) -> str:
    lines = [f"{r['model']} on {r['engine']}  TP {r['tp']}  DCP {r['dcp']}  chunk {r['chunk_tokens']} tokens"
             f"{'' if r['chunk_reason'] == 'set' else ' (' + r['chunk_reason'] + ')'}  "
             f"{r['num_planes']} planes in {len(r['groups'])} groups  fingerprint {r['fingerprint'][:12]}"]
    head = ("group", "name", "block", "ratio", "window", "planes", "row bytes", "rows/chunk", "bytes/chunk", f"restore@{r['restore_at']}")
    rows = [(str(g["group"]), g["name"], str(g["block_size"]), str(g["compress_ratio"]), str(g["window_tokens"] or "-"),
             str(g["num_planes"]), str(g["row_bytes"]), str(g["rows_per_chunk"]), human_bytes(g["bytes_per_chunk"]),
             human_bytes(g["restore_bytes"])) for g in r["groups"]]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        lines.append("  ".join(x.rjust(w) if i >= 2 else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths))))
    lines.append(f"per chunk   {human_bytes(r['bytes_per_chunk'])} ({human_bytes(r['bytes_per_token'])} per token); "
                 f"one CPU pool slot {human_bytes(r['pool_slot_bytes'])}")
    snap = r.get("snapshot")
    if snap:
        parts = " + ".join(f"{p['what']} {human_bytes(p['bytes'])}" for p in snap["parts_per_layer"])
        lines.append(f"snapshot    {human_bytes(snap['bytes'])} per restore point: {r['state_layers']} recurrent-state layers x "
                     f"{human_bytes(r['state_bytes_per_layer'])} ({parts}); " + ("stored" if snap["stored"] else "not stored"))
    for note in r["notes"]:
        lines.append(f"note        {note}")
    if not r["supported"]:
        rp = r["restore_points"]
        if snap and rp["split"]:
            lines.append(f"would take  restore points every {rp['interval_tokens']:,} tokens: prefix part "
                         f"{human_bytes(rp['prefix_bytes_per_chunk'])} per chunk + one snapshot per restore point: "
                         f"{human_bytes(rp['bytes_per_token'])} per cached token")
        lines.append(f"stored      nothing: for {r['tokens']:,} tokens kvconnect keeps 0 bytes and every lookup hits 0")
        return "\n".join(lines)
    how = (f" with restore points every {r['restore_points']['interval_tokens']:,} tokens (steady state; as whole "
           f"chunks: payload {human_bytes(r['whole_chunk_stored_bytes'])}, CPU pool {human_bytes(r['whole_chunk_pool_bytes'])})"
           if r["restore_points_sized"] else "")
    lines.append(f"{r['tokens']:,} tokens  {r['chunks']:,} chunks: payload {human_bytes(r['stored_bytes'])}; "
                 f"CPU pool {human_bytes(r['pool_bytes'])} (LMCACHE_MAX_LOCAL_CPU_SIZE={r['pool_bytes'] / (1 << 30):.2f}); "
                 f"disk / remote {human_bytes(r['tier_bytes'])}{how}")
    if r["tp"] > 1 or r["dcp"] > 1:
        how = ("KV replicated over TP: one copy per DCP shard, written by one rank and read by all" if r["tp_replicated"]
               else "every TP rank stores its own shard")
        lines.append(f"all ranks   the figures above are one rank's; a shared tier (disk dir, remote, node server) holds "
                     f"{r['shared_tier_writers']} rank(s)' chunks, {human_bytes(r['shared_tier_bytes'])} ({how})")
    mc = r.get("mooncake")
    if mc:
        lines.append(f"mooncake    master {mc['master']} ({mc['protocol']}, as {mc['local_hostname']}); this engine contributes "
                     f"{human_bytes(mc['engine_segment_bytes'])}; holder: {mc['holder']}; segments for these tokens: "
                     f"{human_bytes(mc['segments_needed_bytes'])} (payload + headers + 10% for the master's eviction)")
    aligned = "" if r["restore_asked"] == r["restore_at"] else f" (asked {r['restore_asked']:,}; a hit covers whole chunks)"
    lines.append(f"restore at P={r['restore_at']:,}{aligned}: loads {human_bytes(r['restore_bytes'])} from {r['restore_chunks']:,} chunks")
    rp = r["restore_points"]
    if rp["split"]:
        lines.append(f"restore points every {rp['interval_tokens']:,} tokens (and at each stored prompt's end and branch point): "
                     f"prefix part {human_bytes(rp['prefix_bytes_per_chunk'])} per chunk; window part "
                     f"{human_bytes(rp['window_part_bytes'])} per restore point ({rp['window_part_chunks']} chunk(s) x "
                     f"{rp['pieces_per_chunk']} pieces); {human_bytes(rp['bytes_per_token'])} per cached token "
                     f"({rp['bytes_per_token'] / rp['whole_bytes_per_token']:.2f} of whole chunks' "
                     f"{human_bytes(rp['whole_bytes_per_token'])}); CPU pool {human_bytes(rp['pool_bytes_per_token'])} per token "
                     f"in {human_bytes(rp['slot_bytes'])} slots")
        if rp["window_free_groups"]:
            lines.append(f"window-free   {human_bytes(rp['window_free_bytes_per_chunk'])} per chunk in no part: group(s) "
                         f"{', '.join(str(g) for g in rp['window_free_groups'])} have restore window 0 at every chunk end "
                         f"(the engine adapter's rule, GroupSpec.window_free_every)")
    return "\n".join(lines)
