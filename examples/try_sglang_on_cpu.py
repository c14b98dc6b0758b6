"""Try kvconnect as SGLang's HiCache L3 storage on a CPU, with nothing to download.

    bash .ci/install_sglang.sh                                # SGLang 0.5.23 + kvconnect in .venv-sglang
    .venv-sglang/bin/python examples/try_sglang_on_cpu.py     # ~2 min on 2 cores

What it does, printing what it runs:
1. writes a tiny Llama with random weights (2 layers, 1000-token vocabulary) to --dir: no
   download, no tokenizer (prompts are token ids);
2. starts SGLang's offline engine (``sglang.Engine``, the same server arguments as
   ``python -m sglang.launch_server``) with HiCache on and kvconnect as its L3 backend
   (``--hicache-storage-backend dynamic`` plus kvconnect's module in the extra config);
3. sends one prompt, waits for HiCache's write-through to reach kvconnect, drops SGLang's
   device and host caches (``flush_cache``) and sends the same prompt again;
4. prints SGLang's own report of where the second request's cached tokens came from
   (``cached_tokens_details``: ``storage`` is kvconnect) and checks the output is the same.
Exit status 0 when the second request was served from kvconnect with the same output.

SGLang 0.5.23 has no CPU build of its ``sgl_kernel`` on PyPI: on a machine without a GPU this
script runs SGLang with the repository's TEST HARNESS stand-ins (``tests/sglang/harness``, pure
torch versions of four CPU kernels and CPU gaps of HiCache's host pool; docs/sglang.md,
"Testing on CPU"), as the SGLang tests do. They patch SGLang, never kvconnect; on a GPU
machine run SGLang as usual with the extra config printed below.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "sglang" / "harness"
PAGE = 16  # tokens per SGLang page: one kvconnect object each
PROMPT = [(7 * i + 3) % 997 + 1 for i in range(80)]  # 5 full pages
NEW_TOKENS = 8
BACKEND = {"backend_name": "kvconnect", "module_path": "kvconnect.integrations.sglang", "class_name": "KVConnectStorage",
           "interface_v1": 1, "prefetch_threshold": PAGE, "max_local_cpu_size": 0.05}


def under_harness() -> bool:
    return os.environ.get("KVCONNECT_SGLANG_CPU_HARNESS") == "1"


def rerun_under_harness() -> int:
    """This script again, in a process that starts with the CPU stand-ins (they apply at
    interpreter start, so SGLang's scheduler subprocess gets them too)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HARNESS), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(KVCONNECT_SGLANG_CPU_HARNESS="1", SGLANG_USE_CPU_ENGINE="1", TOKENIZERS_PARALLELISM="false")
    print(f"no GPU: running SGLang with the test-harness CPU stand-ins\n  PYTHONPATH={HARNESS} "
          "KVCONNECT_SGLANG_CPU_HARNESS=1 SGLANG_USE_CPU_ENGINE=1", flush=True)
    return subprocess.call([sys.executable, *sys.argv], env=env)


def generate(engine, prompt: list[int]) -> tuple[list[int], dict]:
    (out,) = engine.generate(input_ids=[prompt], sampling_params={"temperature": 0.0, "max_new_tokens": NEW_TOKENS,
                                                                   "ignore_eos": True})
    meta = out["meta_info"]
    return out["output_ids"], meta.get("cached_tokens_details") or {"total": meta.get("cached_tokens", 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where to write the tiny model (default: a temporary directory)")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait for HiCache's write-through to reach L3")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available() and not under_harness():
        return rerun_under_harness()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from try_on_cpu import write_tiny_model

    import sglang as sgl

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvconnect-sglang-"))
    model = write_tiny_model(work / "tiny-llama")
    print(f"[1/4] tiny Llama (random weights) in {model}")
    extra = json.dumps(BACKEND)
    print("[2/4] SGLang with HiCache and kvconnect as L3; as a server that is:\n"
          f"  python -m sglang.launch_server --model-path {model} --page-size {PAGE} --enable-hierarchical-cache "
          f"--hicache-write-policy write_through --hicache-storage-backend dynamic "
          f"--hicache-storage-backend-extra-config '{extra}'", flush=True)
    engine = sgl.Engine(
        model_path=str(model), device="cuda" if torch.cuda.is_available() else "cpu",
        attention_backend=None if torch.cuda.is_available() else "torch_native", disable_cuda_graph=True,
        mem_fraction_static=0.3, max_total_tokens=4096, page_size=PAGE, skip_tokenizer_init=True,
        enable_cache_report=True, log_level="warning", random_seed=0, dtype="float32",
        enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout="layer_first",
        hicache_write_policy="write_through", hicache_ratio=2, hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=extra,
    )
    try:
        first, _ = generate(engine, PROMPT)
        print(f"[3/4] prompt of {len(PROMPT)} tokens -> {first}; waiting {args.settle_s:g} s for the write-through, "
              "then flush_cache() (SGLang's device and host caches dropped)", flush=True)
        time.sleep(args.settle_s)
        engine.flush_cache()
        second, cached = generate(engine, PROMPT)
    finally:
        engine.shutdown()
    storage = cached.get("storage", 0)
    print(f"[4/4] the same prompt again -> {second}\n  cached_tokens_details {json.dumps(cached)}   "
          f"(storage: tokens SGLang loaded from kvconnect)")
    ok = storage > 0 and storage % PAGE == 0 and first == second
    print("OK: the repeated prompt was served from kvconnect" if ok else "unexpected figures: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
