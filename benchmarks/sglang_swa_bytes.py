"""Bytes per cached token kvconnect stores for a real SGLang hybrid sliding-window model.

    flock /tmp/engine.lock .venv-sglang/bin/python benchmarks/sglang_swa_bytes.py

Builds a tiny random ``MellumForCausalLM`` (SGLang 0.5.23 treats it as hybrid SWA: one
sliding-window layer, window 32 tokens = 2 pages of 16, and one full-attention layer; dense
MLPs) and runs the real SGLang engine on CPU twice: without HiCache (reference outputs) and
with HiCache + kvconnect as L3 (``sglang_timed_backend`` logs the pages of each pool SGLang
hands over). Phases: two prompts (200 and 130 tokens), settle, ``flush_cache``, the same
prompts again (served from kvconnect). Prints outputs equal or not, the storage hits, the
pages SGLang handed over per pool, and bytes per cached token: stored as handed over, and
what storing a SWA page for every KV page would cost.
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "sglang"))

PAGE = 16
WINDOW = 32


def make_model(out: Path) -> str:
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    from support import tiny_models

    torch.manual_seed(0)
    cfg = MellumConfig(vocab_size=tiny_models.VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                       sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                       mlp_layer_types=["dense", "dense"], moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                       initializer_range=0.08, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype="float32")
    MellumForCausalLM(cfg).eval().save_pretrained(str(out), safe_serialization=True)
    return str(out)


def run(spec: dict, work: Path) -> dict:
    from engine_runs import harness_env

    env = harness_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), env["PYTHONPATH"]])
    path = work / f"spec{len(list(work.glob('spec*.json')))}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sglang" / "sglang_run.py"), str(path)],
                          capture_output=True, text=True, env=env, cwd=str(work), timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("KVCONNECT_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise SystemExit(f"engine run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")


def main() -> None:
    from support import tiny_models

    work = Path(tempfile.mkdtemp(prefix="kvc-swa-bytes-"))
    model = make_model(work / "mellum")
    rng = random.Random(1)
    prompts = [tiny_models.random_tokens(rng, n) for n in (200, 130)]
    gen = {"op": "generate", "prompts": prompts, "max_new_tokens": 8}
    ref = run({"model": model, "page_size": PAGE, "phases": [gen]}, work)
    log = work / "timing.jsonl"
    extra = {"backend_name": "kvconnect", "module_path": "sglang_timed_backend", "class_name": "TimedKVConnectStorage",
             "interface_v1": 1, "prefetch_threshold": PAGE, "max_local_cpu_size": 0.1, "local_disk": str(work / "disk"),
             "max_local_disk_size": 0.5, "timing_log": str(log)}
    kvc = run({"model": model, "page_size": PAGE, "hicache": True, "layout": "page_first_direct", "hicache_ratio": 2,
               "backend": "dynamic", "extra": extra,
               "phases": [gen, {"op": "settle", "seconds": 4}, {"op": "flush"}, gen]}, work)
    first, _, flush, second = kvc["phases"]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    page_bytes = next(e["page_bytes"] for e in events if e["ev"] == "pools")
    pages = collections.Counter()
    for e in events:
        if e["ev"] == "call" and e["name"] == "batch_set_v1":
            pages["kv"] += e["pages"]
        elif e["ev"] == "call" and e["name"] == "batch_set_v2":
            pages.update(e["pools"])
    tokens = pages["kv"] * PAGE
    stored = sum(pages[p] * page_bytes[p] for p in pages)
    every = sum(pages["kv"] * page_bytes[p] for p in page_bytes)
    ref_out = ref["phases"][0]["outputs"]
    print(f"outputs equal to the reference: first {first['outputs'] == ref_out}, from kvconnect {second['outputs'] == ref_out}")
    print(f"flush ok {flush['flushed']}; served from kvconnect (tokens): {[c.get('storage', 0) for c in second['cached']]}")
    print(f"page bytes per pool {page_bytes}; pages handed over per pool {dict(pages)} for {tokens} tokens")
    print(f"bytes per cached token: {stored / tokens:.0f} as handed over (KV {pages['kv'] * page_bytes['kv'] / tokens:.0f}"
          f" + SWA {stored / tokens - pages['kv'] * page_bytes['kv'] / tokens:.0f}); a SWA page for every page: {every / tokens:.0f}")


if __name__ == "__main__":
    main()
