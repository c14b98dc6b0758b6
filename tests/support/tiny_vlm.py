"""A tiny random LLaVA (CLIP vision tower + Llama) written locally for the multimodal vLLM test.

    make_llava(out_dir) -> out_dir

Nothing is downloaded: the config, the seeded random weights (transformers' own
``LlavaForConditionalGeneration``, its exact tensor names, float32 safetensors), a word-level
tokenizer built with ``tokenizers`` (ids ``t0``..``t999`` plus ``<s>``, ``</s>``, ``<unk>`` and
the image token) and the processor (transformers' ``LlavaProcessor`` over a ``CLIPImageProcessorPil``,
numpy / PIL only: no torchvision op) are made here. An image of ``IMAGE_SIZE`` pixels is
``IMAGE_TOKENS`` placeholder tokens (patch 14, the CLS feature dropped: vLLM's and transformers'
"default" feature strategy). vLLM runs it on CPU as ``LlavaForConditionalGeneration``.
"""

from __future__ import annotations

import os

import torch

TEXT_VOCAB = 1000  # ids 0..999 are words t0..t999; the special tokens follow
BOS, EOS, UNK, IMAGE_TOKEN_ID = 1000, 1001, 1002, 1003
VOCAB = 1024
IMAGE_SIZE, PATCH = 112, 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # 64


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TEXT_VOCAB)}
    vocab.update({"<s>": BOS, "</s>": EOS, "<unk>": UNK, "<image>": IMAGE_TOKEN_ID})
    for i in range(IMAGE_TOKEN_ID + 1, VOCAB):
        vocab[f"<extra{i}>"] = i
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tok


def make_llava(out_dir: str, *, seed: int = 0) -> str:
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=64)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                       initializer_range=0.08, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_select_strategy="default", vision_feature_layer=-2,
                         projector_hidden_act="gelu", tie_word_embeddings=False)
    config.initializer_range = 0.08
    model = LlavaForConditionalGeneration(config).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _classic_vision_names(os.path.join(out_dir, "model.safetensors"))
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=_tokenizer(), patch_size=PATCH,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1,
                               chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    processor.save_pretrained(out_dir)
    return out_dir


def _classic_vision_names(path: str) -> None:
    """transformers 5 saves the tower as ``vision_tower.embeddings...``; published LLaVA checkpoints
    (llava-hf) and vLLM's loader name it ``vision_tower.vision_model.embeddings...``: renamed, bytes kept."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):]
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def random_image(seed: int):
    """A seeded random RGB image of IMAGE_SIZE pixels (PIL)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")
