"""One vLLM run of the tiny Qwen3.5 (Gated DeltaNet hybrid), in its own process.

    python tests/integration/qwen35_forward.py --model DIR --prompts P.json --out R.json \
        [--prefix-caching true] [--connector none|kvconnect|recorder] ...

``tests/integration/qwen35_harness`` must be on PYTHONPATH (the ``torchvision`` import stub
and the recording connector). Prompts: JSON list of phases, each a list of token-id lists.
Requests run one at a time (batching changes logprobs), greedily, with the chosen token's
logprob; with ``--reset-between-phases true`` vLLM's own prefix cache is emptied before
every phase but the first. Writes ``{"outputs": [[ids]], "logprobs": [[float]],
"cached_tokens": [vLLM's own prefix hit per request], "stats": [kvconnect worker stats per
phase], "resets": [bool], "config": {...}, "seconds": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _bool(s: str) -> bool:
    return s.lower() in ("1", "true", "yes")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefix-caching", type=_bool, default=False,
                        help="vLLM's own prefix cache (mamba_cache_mode 'align' when on)")
    parser.add_argument("--reset-between-phases", type=_bool, default=False)
    parser.add_argument("--connector", choices=("none", "kvconnect", "recorder"), default="none")
    parser.add_argument("--lookup-url", default=None, help="kvconnect's lookup channel (kvconnect only)")
    parser.add_argument("--record-path", default=None, help="recorder's JSONL output (recorder only)")
    parser.add_argument("--claim-tokens", type=int, default=0, help="recorder: external tokens to claim")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=64, help="kvconnect's chunk size")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # connectors run in this process
    start = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if args.connector == "kvconnect":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVConnectConnector", kv_role="kv_both",
            kv_connector_module_path="kvconnect.integrations.vllm", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"lookup_url": args.lookup_url, "chunk_size": args.chunk_size,
                                       "max_local_cpu_size": 0.25, "lookup_timeout_s": 10.0})
    elif args.connector == "recorder":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RecordingConnector", kv_role="kv_both", kv_connector_module_path="qwen35_recorder",
            kv_connector_extra_config={"record_path": args.record_path, "claim_tokens": args.claim_tokens})
    if args.prefix_caching:
        kwargs.update(enable_prefix_caching=True, mamba_cache_mode="align")
    else:
        kwargs.update(enable_prefix_caching=False)
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1, enforce_eager=True, seed=0,
              distributed_executor_backend="uni", **kwargs)
    started = time.monotonic()
    cache = llm.llm_engine.vllm_config.cache_config
    config = {"block_size": cache.block_size, "enable_prefix_caching": cache.enable_prefix_caching,
              "mamba_cache_mode": str(cache.mamba_cache_mode),
              "conv_state_layout": os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")}
    with open(args.prompts) as f:
        phases = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True, logprobs=0)
    client = None
    if args.connector == "kvconnect":
        from kvconnect.integrations.vllm.lookup_channel import LookupClient, rank_address

        client = LookupClient([rank_address(args.lookup_url, 0)], timeout_s=10.0)
    outputs, logprobs, cached, stats, resets = [], [], [], [], []
    for i, prompts in enumerate(phases):
        if i and args.reset_between_phases:
            resets.append(bool(llm.reset_prefix_cache()))
        for prompt in prompts:  # one request at a time: bit-deterministic
            (r,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            out = r.outputs[0]
            outputs.append(list(out.token_ids))
            logprobs.append([step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs)])
            cached.append(r.num_cached_tokens)
        if client is not None:
            stats.append(client.stats())
    if client is not None:
        client.close()
    with open(args.out, "w") as f:
        json.dump({"outputs": outputs, "logprobs": logprobs, "cached_tokens": cached, "stats": stats,
                   "resets": resets, "config": config,
                   "seconds": {"start": started - start, "generate": time.monotonic() - started}}, f)
    del llm


if __name__ == "__main__":
    main()
