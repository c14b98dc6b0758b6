"""Layouts for benchmarks: Llama-8B-like GQA, DeepSeek-V3 MLA, DeepSeek-V4-Flash (CPU or any device)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import dsv4_cache  # noqa: E402

from kvconnect import GroupSpec, KVLayout  # noqa: E402


def llama8b(num_tokens: int, device: str = "cpu", block_size: int = 16) -> KVLayout:
    """32 layers, 8 KV heads x 128, bf16, vLLM flash-attn [2, NB, BS, H, D]."""
    nb = num_tokens // block_size + 1
    kv = {f"layers.{i}": torch.empty(2, nb, block_size, 8, 128, dtype=torch.bfloat16, device=device) for i in range(32)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=block_size)], model_name="llama-8b-like")


def dsv3_mla(num_tokens: int, device: str = "cpu", block_size: int = 64) -> KVLayout:
    """61 layers, 576-wide latent, bf16, [NB, BS, 576]."""
    nb = num_tokens // block_size + 1
    kv = {f"layers.{i}": torch.empty(nb, block_size, 576, dtype=torch.bfloat16, device=device) for i in range(61)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=block_size)], model_name="dsv3-like")


def dsv4_flash(num_tokens: int, device: str = "cpu", num_layers: int = 44) -> KVLayout:
    """DeepSeek-V4-Flash: 43 layers + MTP, seven caches, padded pages (168 planes at 44 layers)."""
    kv, groups, layer_groups = dsv4_cache.build(num_layers, num_tokens)
    if device != "cpu":
        kv = {k: _to_device(v, device) for k, v in kv.items()}
    return KVLayout.from_tensors(kv, groups=groups, layer_groups=layer_groups, model_name="dsv4-flash-like")


def _to_device(view: torch.Tensor, device: str) -> torch.Tensor:
    backing = view.as_strided((view.untyped_storage().nbytes() // view.element_size(),), (1,), 0).to(device)
    return torch.as_strided(backing, view.shape, view.stride(), view.storage_offset())


LAYOUTS = {"llama8b": llama8b, "dsv3_mla": dsv3_mla, "dsv4_flash": dsv4_flash}


def full_block_tables(layout: KVLayout, num_tokens: int, shuffle: bool = True) -> list[list[int]]:
    """A block table per group covering ``num_tokens``, in random block order."""
    tables = []
    for g, group in enumerate(layout.groups):
        n = -(-num_tokens // group.block_size)
        ids = torch.randperm(layout.group_num_blocks(g))[:n] if shuffle else torch.arange(n)
        tables.append(ids.tolist())
    return tables


def mla_prompt_setup(num_tokens: int, num_prompts: int, num_threads: int, chunk_tokens: int, device: str = "cpu"):
    """A DSv3-MLA layout filled with random bytes, and a Config whose pool holds ``num_prompts``
    prompts of ``num_tokens``: returns (layout, chunk_bytes, prompt_gb, config)."""
    from kvconnect import Config

    layout = dsv3_mla(num_tokens, device=device)
    for t in layout.tensors:
        t.view(torch.uint8).random_()
    chunk_bytes = sum(p.row_bytes for p in layout.planes) * chunk_tokens
    prompt_gb = chunk_bytes * (num_tokens // chunk_tokens) / 1e9
    pool_gb = 1.2 * prompt_gb * num_prompts + 0.1
    return layout, chunk_bytes, prompt_gb, Config(chunk_size=chunk_tokens, max_local_cpu_size=pool_gb, num_threads=num_threads)
