"""Runs one real SGLang engine (CPU) through a list of phases; prints one JSON line of results.

    python sglang_run.py spec.json      # spec: see run() below; used by test_sglang_e2e.py

Needs the test harness on PYTHONPATH (tests/sglang/harness) with KVCONNECT_SGLANG_CPU_HARNESS=1.
Every phase's result also has "began": the wall-clock time (time.time()) it started. Phases:
  {"op": "generate", "prompts": [[ids...], ...], "max_new_tokens": N}
      -> {"outputs": [[ids...]], "cached": [cached_tokens_details, ...]}
  {"op": "settle", "seconds": S}   wait for write-through backups to reach L3
  {"op": "flush"}                  engine.flush_cache(): device and host caches dropped
                                   -> {"flushed": bool, "seconds": s}
  {"op": "clear"}                  SGLang's clear_hicache_storage (HTTP: POST /clear_hicache_storage_backend):
                                   the storage backend's clear()
"""

from __future__ import annotations

import json
import sys
import time


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
                outs = engine.generate(
                    input_ids=phase["prompts"],
                    sampling_params={"temperature": 0.0, "max_new_tokens": phase.get("max_new_tokens", 8), "ignore_eos": True},
                )
                results.append({
                    "outputs": [o["output_ids"] for o in outs],
                    "cached": [o["meta_info"].get("cached_tokens_details") or {"total": o["meta_info"].get("cached_tokens", 0)} for o in outs],
                })
            elif op == "settle":
                time.sleep(phase.get("seconds", 3))
                results.append({})
            elif op == "flush":
                start = time.monotonic()
                ok = engine.flush_cache()
                results.append({"flushed": bool(getattr(ok, "success", ok) if ok is not None else True),
                                "seconds": round(time.monotonic() - start, 3)})
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
