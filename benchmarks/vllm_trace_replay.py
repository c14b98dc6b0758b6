"""Replay public request traces through vLLM's own scheduler and kvconnect's connector, at
several chunked-prefill step sizes, beside the engine-API replay of the same requests.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_trace_replay.py [--trace synthetic|conversation]
        [--steps 256,2048,8192] [--limit N] [--restore-interval 4096] [--pool-gb 3] [--peer]
        [--step-end-parts] [--layout dsv4|dsv41] [--json]

The vLLM path is tests/integration/vllm_scheduler_rig.py: vLLM's VllmConfig, Scheduler and
KVConnectorFactory, KV tensors from vLLM's allocate_kv_cache, the connector's scheduler and
worker halves; only the forward is faked (it writes nothing: this measures what is stored and
served, not values; the rig's tests check values). vLLM's prefix cache is off, so every hit is
the connector's. A step size is vLLM's ``max_num_batched_tokens`` and
``long_prefill_token_threshold``: a prompt is prefilled in steps of that many tokens and the
connector saves at every step end, as it does in a served engine.

The model is a DeepSeek V4-like hybrid scaled down: full-attention layers (the prefix part)
and sliding-window layers of window 128 (the window part; DeepSeek V4's windows are <= 128),
64-token blocks, 256-token chunks. Token ids come from the trace's hash ids as in
benchmarks/trace_replay.py. The engine-API replay stores each prompt once beyond its hit, on
the same layout and configuration. One request at a time, in arrival order.

Reported per step size: the share of prompt tokens served from the cache, that share over the
infinite-cache ideal (trace_replay.ideal_share), bytes written per cached prefix token (all
objects: prefix parts and window parts), window parts and objects written.

``--peer``: vLLM's OffloadingConnector in the same rig at each step size, the same requests,
layout and pool size (``peer_rig``: vLLM's offloading scheduler, manager and worker; only its
CUDA copy worker is replaced, benchmarks/offloading_cpu_shim.py). Its bytes are those its copy
worker moved to the host; its cached tokens, the full-attention blocks it stored.

``--layout dsv41``: DeepSeek V4.1's group structure instead (tests/integration/vllm_rebuilt_rig.py's
``deepseek_v41``, as vLLM 0.33's registering code builds it, through that rig's hand-built
``KVCacheConfig``): a compress-ratio-1 and a ratio-2 MLA compressed cache (prefix-cacheable), the
ratio-2 compressor's ``CircularBufferSpec`` ring and a ``SlidingWindowMLASpec`` window of 128 with
``bounded_replay`` (engine-rebuilt: vLLM keeps them out of ``prefix_cacheable_group_ids``, claims a
fresh ring after any hit and recomputes the hit's last 128 tokens). Scaled down: one layer per
compressed kind and two window layers (the real model has tens), rows of 32 float32 (128 B; the
real rows are 512-wide packed fp8), a ring of 8 slots. A hit of H tokens is counted as H served
tokens although vLLM recomputes [H - 128, H) of it (both connectors alike; ``replayed_tokens``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: the tiny models
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the scheduler rig

from trace_replay import CHUNK, ideal_share, load_trace, prompt_tokens, serve_request  # noqa: E402

from kvconnect import Config, KVCacheEngine  # noqa: E402

BLOCK = 64
WINDOW = 128
HEADS, HEAD_SIZE = 1, 8  # 64 bytes per token and layer: a replay of millions of tokens fits a few GB
FULL_LAYERS, WINDOW_LAYERS = 1, 10  # window part / prefix part = 10 * 128 / 256 = 5.0: DeepSeek V4-Flash's 5.1 (4.78 / 0.94 MiB)
POOL_GB = 3.0  # no eviction at 200 requests (check the evictions column); --pool-gb smaller to replay under pressure
LAYOUTS = ("dsv4", "dsv41")  # dsv4: layer_specs() below; dsv41: vllm_rebuilt_rig.deepseek_v41 (module doc)


def layer_specs() -> dict:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32,
                            sliding_window=WINDOW)
    specs = {f"model.layers.{i}.self_attn.attn": full for i in range(FULL_LAYERS)}
    specs.update({f"model.layers.{FULL_LAYERS + i}.self_attn.attn": swa for i in range(WINDOW_LAYERS)})
    return specs


def _no_write_forward(rig):
    """The rig's forward without its row writes and checks: sample once a prompt is prefilled."""

    def forward(out):
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = rig.scheduler.requests[req_id]
            sampled[req_id] = [7] if req.num_computed_tokens >= req.num_tokens else []
        return sampled

    return forward


def vllm_replay(model_dir: str, trace: list[dict], step: int, interval: int, max_len: int, step_end_parts: bool,
                pool_gb: float = POOL_GB, specs: Optional[dict] = None, layout: str = "dsv4",
                hits: Optional[list] = None) -> dict:
    """``hits``: if a list, each request's cache hit (tokens) is appended to it."""
    extra = {"restore_interval_tokens": interval, "max_local_cpu_size": pool_gb, "pool_prefault": False,
             "step_end_window_parts": step_end_parts}
    if layout == "dsv41":
        rig = _rebuilt_rig(model_dir, step, max_len, chunk_size=CHUNK, extra=extra)
    else:
        rig = _stepped_rig(model_dir, step, max_len, specs or layer_specs(), chunk_size=CHUNK, extra=extra)
    rig._forward = _no_write_forward(rig)
    start = time.perf_counter()
    try:
        served, total, steps, hit_requests = _drive(
            rig, trace, step, lambda before, n: rig.run(max_steps=n, before_worker=before), hits)
        s = rig.engine.stats
        row = _row("vllm", step, served, total, s, rig.engine.pool.stats().evictions, steps, time.perf_counter() - start)
        return _with_replay(row, rig, hit_requests, layout)
    finally:
        rig.close()


def _with_replay(row: dict, rig, hit_requests: int, layout: str) -> dict:
    """dsv41 rows: the requests that hit and the tokens vLLM recomputed of their hits (its bounded
    replay: the hit's last prefix_replay_tokens each)."""
    if layout == "dsv41":
        row["hit_requests"] = hit_requests
        row["replayed_tokens"] = rig.scheduler.prefix_replay_tokens * hit_requests
    return row


def _stepped_rig(model_dir: str, step: int, max_len: int, specs: Optional[dict], **connector):
    """The scheduler rig prefilling in ``step``-token steps, vLLM's prefix cache off, blocks for
    two of the longest prompts; ``connector``: make_rig's connector arguments."""
    from vllm_scheduler_rig import make_rig

    rig = make_rig(model_dir, block_size=BLOCK, num_blocks=2 * (max_len // BLOCK + 2), max_num_batched_tokens=step,
                   enable_prefix_caching=False, layer_specs=specs, max_model_len=max_len, **connector)
    rig.vllm_config.scheduler_config.long_prefill_token_threshold = step
    return rig


def _rebuilt_rig(model_dir: str, step: int, max_len: int, **connector):
    """As ``_stepped_rig`` over DeepSeek V4.1's group structure (vllm_rebuilt_rig: its hand-built
    KVCacheConfig, one KV tensor per layer); ``connector``: make_rebuilt_rig's connector arguments.
    Its groups share one block pool: blocks for two of the longest prompts in every group."""
    from vllm_rebuilt_rig import deepseek_v41, make_rebuilt_rig

    structure = deepseek_v41(block=BLOCK)
    rig = make_rebuilt_rig(model_dir, structure, num_blocks=2 * len(structure) * (max_len // BLOCK + 2),
                           max_num_batched_tokens=step, enable_prefix_caching=False, max_model_len=max_len,
                           **connector)
    rig.vllm_config.scheduler_config.long_prefill_token_threshold = step
    return rig


def _drive(rig, trace: list[dict], step: int, run, hits: Optional[list] = None) -> tuple[int, int, int, int]:
    """Each request of ``trace`` in turn, one output token, run to its end by ``run(before_worker,
    max_steps)``: (prompt tokens served from the cache, prompt tokens, engine steps, requests that
    hit); ``hits``: if a list, each request's hit is appended to it. Every hit is
    the connector's (vLLM's prefix cache is off): what a request starts from when first scheduled,
    plus, under bounded replay, the window vLLM recomputes below the hit (``replay_start`` =
    hit - prefix_replay_tokens, the request's first scheduled position)."""
    served = total = steps = hit_requests = 0
    replay = getattr(rig.scheduler, "prefix_replay_tokens", 0)

    def count_hits(out):
        nonlocal served, hit_requests
        for r in out.scheduled_new_reqs:
            hit = r.num_computed_tokens + (replay if r.num_computed_tokens else 0)
            served += hit
            hit_requests += bool(hit)
            if hits is not None:
                hits.append(hit)

    for req in trace:
        tok = prompt_tokens(req)
        total += len(tok)
        rig.add(tok, max_tokens=1)
        steps += run(count_hits, len(tok) // step + 20)
    return served, total, steps, hit_requests


def peer_rig(model_dir: str, *, step: int, max_len: int, pool_gb: float, specs: Optional[dict] = None,
             layout: str = "dsv4"):
    """The scheduler rig with vLLM's OffloadingConnector in kvconnect's place: vLLM's CPU
    offloading spec with the copy worker of benchmarks/offloading_cpu_shim.py (vLLM's refuses a
    CPU device), offloaded chunks of CHUNK tokens, a host pool of ``pool_gb``; ``specs`` None:
    the rig's own full-attention layers (its forward then writes and checks every row);
    ``layout`` dsv41: DeepSeek V4.1's groups (``specs`` unused)."""
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"spec_name": "CPUCopyOffloadingSpec",
                                                           "spec_module_path": "offloading_cpu_shim",
                                                           "block_size": CHUNK, "cpu_bytes_to_use": int(pool_gb * 1e9)})
    if layout == "dsv41":
        return _rebuilt_rig(model_dir, step, max_len, transfer=transfer)
    return _stepped_rig(model_dir, step, max_len, specs, transfer=transfer)


def run_peer(rig, before_worker=None, max_steps: int = 200) -> int:
    """Step until every request's blocks are freed: the OffloadingConnector holds them until
    the worker reported their stores done, and the manager counts a store only then, so the
    next request can hit (kvconnect's rig drains its worker instead)."""
    steps = 0
    while rig.scheduler.has_unfinished_requests() or rig.scheduler.requests:
        rig.step(before_worker)
        steps += 1
        assert steps < max_steps, "the peer did not drain"
    return steps


def peer_replay(model_dir: str, trace: list[dict], step: int, max_len: int, pool_gb: float,
                specs: Optional[dict] = None, layout: str = "dsv4", hits: Optional[list] = None) -> dict:
    """vLLM's OffloadingConnector on the same requests, steps and layout as ``vllm_replay``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    rig = peer_rig(model_dir, step=step, max_len=max_len, pool_gb=pool_gb, specs=specs or layer_specs(), layout=layout)
    rig._forward = _no_write_forward(rig)
    copier = rig.worker.connector_worker.worker
    groups = rig.kv_cache_config.kv_cache_groups
    offloaded = get_offloading_group_ids(rig.kv_cache_config)  # the copier counts per offloaded group, in this order
    full = [i for i, g in enumerate(offloaded) if isinstance(groups[g].kv_cache_spec, FullAttentionSpec)]
    start = time.perf_counter()
    try:
        served, total, steps, hit_requests = _drive(rig, trace, step, lambda before, n: run_peer(rig, before, n), hits)
        stored = sum(copier.bytes_stored)
        cached = min(copier.blocks_stored[g] for g in full) * BLOCK  # tokens whose prefix rows were offloaded
        row = {"path": "OffloadingConnector", "step_tokens": step, "served": served / total,
               "bytes_per_cached_token": stored / max(1, cached), "stored_bytes": stored,
               "window_bytes": stored - sum(copier.bytes_stored[g] for g in full), "prefix_parts": cached // CHUNK,
               "window_parts": None, "window_pieces": None, "restore_point_hits": None, "evictions": None,
               "engine_steps": steps, "seconds": time.perf_counter() - start}
        if layout == "dsv41":
            row["offloaded_groups"] = [type(groups[g].kv_cache_spec).__name__ for g in offloaded]
        return _with_replay(row, rig, hit_requests, layout)
    finally:
        rig.close()


def rig_layout(model_dir: str, max_len: int, layout: str = "dsv4"):
    """kvconnect's layout of the rig's KV tensors (the engine-API replay's), as its worker builds it."""
    from vllm_rebuilt_rig import deepseek_v41, make_rebuilt_rig
    from vllm_scheduler_rig import make_rig

    extra = {"max_local_cpu_size": 0.01, "pool_prefault": False}
    if layout == "dsv41":  # the rebuilt groups are in the layout (its identity and resume_every), without planes
        rig = make_rebuilt_rig(model_dir, deepseek_v41(block=BLOCK), num_blocks=max_len // BLOCK + 2, chunk_size=CHUNK,
                               enable_prefix_caching=False, max_model_len=max_len, extra=extra)
    else:
        rig = make_rig(model_dir, block_size=BLOCK, num_blocks=max_len // BLOCK + 2, chunk_size=CHUNK,
                       enable_prefix_caching=False, layer_specs=layer_specs(), max_model_len=max_len, extra=extra)
    try:
        return rig.engine.layout
    finally:
        rig.close()


def api_replay(layout, trace: list[dict], interval: int, max_len: int, pool_gb: float = POOL_GB) -> dict:
    """The engine-API replay (benchmarks/trace_replay.py's loop) on the rig's own layout."""
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=pool_gb, num_threads=1, pool_prefault=False,
                 restore_interval_tokens=interval, log_interval_s=0)
    eng = KVCacheEngine(layout, cfg)
    block_ids = [np.arange(max_len // BLOCK + 2, dtype=np.int64) for _ in layout.groups]
    served = total = 0
    start = time.perf_counter()
    try:
        for req in trace:
            tok = prompt_tokens(req)
            total += len(tok)
            served += serve_request(eng, tok, block_ids)
        return _row("engine API", 0, served, total, eng.stats, eng.pool.stats().evictions, 0, time.perf_counter() - start)
    finally:
        eng.close()


def _row(path: str, step: int, served: int, total: int, s, evictions: int, steps: int, seconds: float) -> dict:
    cached = s.stored_chunks * CHUNK
    return {"path": path, "step_tokens": step, "served": served / total, "bytes_per_cached_token": s.stored_bytes / max(1, cached),
            "stored_bytes": s.stored_bytes, "window_bytes": s.window_bytes_stored, "prefix_parts": s.stored_chunks,
            "window_parts": s.window_parts_stored, "window_pieces": s.window_pieces_stored,
            "restore_point_hits": s.restore_point_hits, "evictions": evictions, "engine_steps": steps, "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="synthetic")
    p.add_argument("--steps", default="256,2048,8192")
    p.add_argument("--limit", type=int, default=20, help="replay only the first N requests")
    p.add_argument("--restore-interval", type=int, default=Config().restore_interval_tokens)
    p.add_argument("--step-end-parts", action="store_true",
                   help="keep a short-lived window part at every prefill step end (step_end_window_parts)")
    p.add_argument("--pool-gb", type=float, default=POOL_GB, help="host pool of every path, GB")
    p.add_argument("--peer", action="store_true",
                   help="also replay through vLLM's OffloadingConnector (benchmarks/offloading_cpu_shim.py) at each step size")
    p.add_argument("--layout", default="dsv4", choices=LAYOUTS,
                   help="dsv4: full + sliding-window layers; dsv41: DeepSeek V4.1's groups (module doc)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from support import tiny_models

    trace = load_trace(args.trace, args.limit)
    max_len = (max(r["input_length"] for r in trace) // BLOCK + 2) * BLOCK
    ideal = ideal_share(trace)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_models.make_llama(str(Path(tmp) / "llama"))
        conf = Path(model_dir) / "config.json"  # only the forward is faked: the model's length cap is vLLM's check
        conf.write_text(json.dumps({**json.loads(conf.read_text()), "max_position_embeddings": max_len}))
        for step in [int(x) for x in args.steps.split(",")]:
            rows.append(vllm_replay(model_dir, trace, step, args.restore_interval, max_len, args.step_end_parts,
                                    args.pool_gb, layout=args.layout))
            if args.peer:
                rows.append(peer_replay(model_dir, trace, step, max_len, args.pool_gb, layout=args.layout))
        rows.append(api_replay(rig_layout(model_dir, max_len, args.layout), trace, args.restore_interval, max_len,
                               args.pool_gb))
    api = rows[-1]
    for row in rows:
        row["of_ideal"] = row["served"] / ideal if ideal else 0.0
        row["bytes_vs_api"] = row["bytes_per_cached_token"] / max(1e-9, api["bytes_per_cached_token"])
        if not args.json:
            name = {"vllm": f"vLLM steps {row['step_tokens']:>5}", "engine API": "engine API       "}.get(
                row["path"], f"peer steps {row['step_tokens']:>5}")
            line = (f"{args.trace} {len(trace)} requests, {name}: served {row['served']:.3f} ({row['of_ideal']:.2f} of ideal "
                    f"{ideal:.3f}), {row['bytes_per_cached_token']:.0f} B per cached token ({row['bytes_vs_api']:.2f}x API), "
                    f"{row['prefix_parts']} prefix chunks, ")
            if row["path"] == "OffloadingConnector":
                line += f"{row['window_bytes'] / 1e6:.1f} MB of window rows (vLLM's OffloadingConnector), "
            else:
                line += (f"{row['window_parts']} window parts ({row['window_pieces']} pieces), "
                         f"{row['restore_point_hits']} restore-point hits, {row['evictions']} evictions, ")
            if "replayed_tokens" in row:
                line += f"{row['hit_requests']} hits ({row['replayed_tokens']} of their tokens replayed by vLLM), "
            print(line + f"{row['seconds']:.0f} s", flush=True)
    if args.json:
        head = {"trace": args.trace, "requests": len(trace), "ideal": ideal, "step_end_parts": args.step_end_parts,
                "pool_gb": args.pool_gb}
        if args.layout != "dsv4":
            head["layout"] = args.layout
        print(json.dumps({**head, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
