"""One vLLM engine run with images, for the multimodal end-to-end test (its own process).

    python tests/integration/vllm_mm_run.py --model DIR --prompts phases.json --out result.json \
        --connector URL [--chunk-size 32 --block-size 32]

``phases.json``: a list of phases, each a list of prompts ``{"tokens": [...], "image": seed}``
(``tokens`` holds one ``<image>`` token where the image goes, which vLLM expands to its
placeholder run; ``image``: the seed of a random image, ``tiny_vlm.random_image``). vLLM's
own prefix caching is off, so a prompt's KV can only come back through kvconnect (its CPU
pool). Greedy, with logprobs. Writes ``{"outputs", "logprobs", "cached_tokens",
"prompt_tokens", "stats"}``, one entry per prompt in order (stats: per phase, per worker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--connector", required=True)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--logprobs", type=int, default=3)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvconnect.integrations.vllm.lookup_channel import LookupClient, rank_address
    from support.tiny_vlm import random_image

    transfer = KVTransferConfig(
        kv_connector="KVConnectConnector", kv_role="kv_both", kv_connector_module_path="kvconnect.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"lookup_url": args.connector, "chunk_size": args.chunk_size, "lookup_timeout_s": 10.0,
                                   "max_local_cpu_size": 0.25})
    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size, max_model_len=1024,
              max_num_batched_tokens=512, enforce_eager=True, seed=0, enable_prefix_caching=False,
              limit_mm_per_prompt={"image": 1}, kv_transfer_config=transfer,
              # the PIL image processor: transformers would take the torchvision one, seeing the import stub
              mm_processor_kwargs={"backend": "pil"})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True,
                            logprobs=args.logprobs)
    client = LookupClient([rank_address(args.connector, 0)], timeout_s=10.0)
    with open(args.prompts) as f:
        phases = json.load(f)
    result = {"outputs": [], "logprobs": [], "cached_tokens": [], "prompt_tokens": [], "stats": []}
    for prompts in phases:
        inputs = []
        for p in prompts:
            prompt = TokensPrompt(prompt_token_ids=p["tokens"])
            if p.get("image") is not None:
                prompt["multi_modal_data"] = {"image": random_image(p["image"])}
            inputs.append(prompt)
        for r in llm.generate(inputs, params, use_tqdm=False):
            result["outputs"].append(list(r.outputs[0].token_ids))
            result["logprobs"].append([[[int(t), float(lp.logprob)] for t, lp in sorted(step.items())]
                                       for step in r.outputs[0].logprobs])
            result["cached_tokens"].append(r.num_cached_tokens)
            result["prompt_tokens"].append(list(r.prompt_token_ids))
        result["stats"].append(client.stats())
    client.close()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
