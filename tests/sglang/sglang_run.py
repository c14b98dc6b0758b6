"""Runs one real SGLang engine (CPU) through a list of phases; prints one JSON line of results.

    python sglang_run.py spec.json      # spec: see run() below; used by test_sglang_e2e.py

Needs the test harness on PYTHONPATH (tests/sglang/harness) with KVCONNECT_SGLANG_CPU_HARNESS=1.
Every phase's result also has "began": the wall-clock time (time.time()) it started. Phases:
  {"op": "generate", "prompts": [[ids...], ...], "max_new_tokens": N, "logprobs": bool}
      -> {"outputs": [[ids...]], "cached": [cached_tokens_details, ...]}
         (+ "logprobs": [[chosen token's logprob, ...], ...] when asked); a prompt may be
         {"follow": [phase, i], "extra": [ids...]}: phase's prompt i + its outputs + extra (a next turn)
  {"op": "list", "dir": D, "stable_s": S}
                                   the files under D once their listing stayed the same for S
                                   seconds (default 0: now; at most 60 s): {"files": {relative path: bytes}}
  {"op": "settle", "seconds": S}   wait for write-through backups to reach L3
  {"op": "flush"}                  engine.flush_cache(): device and host caches dropped
                                   -> {"flushed": bool, "seconds": s}
  {"op": "clear"}                  SGLang's clear_hicache_storage (HTTP: POST /clear_hicache_storage_backend):
                                   the storage backend's clear()
"""

from __future__ import annotations

import json
import os
import sys
import time


def listing(root: str) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


def stable_listing(root: str, stable_s: float) -> dict:
    """The files under ``root`` once the listing stayed the same for ``stable_s`` (writes that
    SGLang's backup thread and kvconnect's disk writer still have in flight land first)."""
    files, since, deadline = listing(root), time.monotonic(), time.monotonic() + 60
    while time.monotonic() - since < stable_s and time.monotonic() < deadline:
        time.sleep(0.25)
        now = listing(root)
        if now != files:
            files, since = now, time.monotonic()
    return files


def run(spec: dict) -> dict:
    import sglang as sgl

    # On CPU SGLang profiles free host memory before and after loading the weights; another
    # process allocating meanwhile looks like weights. max_total_tokens caps the pool whatever
    # the fraction, so a generous fraction only widens that tolerance (0.05 failed when other
    # engines started beside it: "Loaded weights leave no GPU memory ... above 0.123").
    kwargs = dict(
        model_path=spec["model"], device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
        mem_fraction_static=0.3, max_total_tokens=4096, page_size=spec.get("page_size", 16),
        skip_tokenizer_init=True, enable_cache_report=True, log_level="warning", random_seed=0,
        dtype="float32",
    )
    kwargs.update(spec.get("engine_args", {}))  # e.g. a hybrid model's Mamba radix-cache settings
    if spec.get("revision"):  # the model's revision (a local path ignores it; kvconnect's identity does not)
        kwargs["revision"] = spec["revision"]
    if spec.get("hicache"):
        kwargs.update(
            enable_hierarchical_cache=True, hicache_io_backend="direct",
            hicache_mem_layout=spec.get("layout", "layer_first"), hicache_write_policy="write_through",
            hicache_size=spec.get("hicache_size_gb", 0) or 0,
        )
        if spec.get("hicache_ratio"):
            kwargs["hicache_ratio"] = spec["hicache_ratio"]
        if spec.get("prefetch_policy"):  # best_effort (SGLang's default), wait_complete or timeout
            kwargs["hicache_storage_prefetch_policy"] = spec["prefetch_policy"]
        backend = spec.get("backend")
        if backend:
            kwargs["hicache_storage_backend"] = backend
            kwargs["hicache_storage_backend_extra_config"] = json.dumps(spec.get("extra", {}))
    engine = sgl.Engine(**kwargs)
    results = []
    try:
        for phase in spec["phases"]:
            op = phase["op"]
            began = time.time()
            if op == "generate":
                logprobs = bool(phase.get("logprobs"))
                prompts = [p if isinstance(p, list) else
                           spec["phases"][p["follow"][0]]["prompts"][p["follow"][1]] + results[p["follow"][0]]["outputs"][p["follow"][1]] + p["extra"]
                           for p in phase["prompts"]]
                phase["prompts"] = prompts  # resolved: a later follow of this phase reads token ids
                outs = engine.generate(
                    input_ids=prompts,
                    sampling_params={"temperature": 0.0, "max_new_tokens": phase.get("max_new_tokens", 8), "ignore_eos": True},
                    return_logprob=logprobs,
                )
                results.append({
                    "outputs": [o["output_ids"] for o in outs],
                    "cached": [o["meta_info"].get("cached_tokens_details") or {"total": o["meta_info"].get("cached_tokens", 0)} for o in outs],
                })
                if logprobs:  # (logprob, token id, text) per output token
                    results[-1]["logprobs"] = [[t[0] for t in o["meta_info"]["output_token_logprobs"]] for o in outs]
            elif op == "settle":
                time.sleep(phase.get("seconds", 3))
                results.append({})
            elif op == "flush":
                start = time.monotonic()
                ok = engine.flush_cache()
                results.append({"flushed": bool(getattr(ok, "success", ok) if ok is not None else True),
                                "seconds": round(time.monotonic() - start, 3)})
            elif op == "list":
                results.append({"files": stable_listing(phase["dir"], phase.get("stable_s", 0))})
            elif op == "clear":
                out = engine.loop.run_until_complete(engine.tokenizer_manager.clear_hicache_storage())
                results.append({"cleared": bool(getattr(out, "success", False))})
            else:
                raise ValueError(f"unknown phase {op!r}")
            results[-1]["began"] = began  # wall clock, for tests that order engine events
    finally:
        engine.shutdown()
    return {"phases": results}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print("KVCONNECT_RESULT " + json.dumps(run(spec)), flush=True)
