"""LMCache's Python calls, one by one, in kvconnect (docs/migrating.md, "From LMCache's Python API").

    python3 examples/from_lmcache.py

A paged cache of 4 layers on CPU (vLLM's flash layout: [2, num_blocks, block_size, heads,
head_dim] per layer), addressed by a slot mapping as LMCache's callers address it. Stores a
prompt, wipes the paged memory, restores it into other blocks and checks every byte.
"""

from __future__ import annotations

import torch

from kvconnect import Config, GroupSpec, KVCacheEngine, KVLayout, block_ids_from_slot_mapping

BLOCK = 16


def slot_mapping_of(block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """What an engine hands LMCache: slot = block * block_size + offset, one per token."""
    blocks = torch.tensor(block_ids).repeat_interleave(BLOCK)[:num_tokens]
    return blocks * BLOCK + torch.arange(num_tokens) % BLOCK


def main() -> None:
    torch.manual_seed(0)
    kv_caches = {f"model.layers.{i}.self_attn": torch.randn(2, 256, BLOCK, 2, 64, dtype=torch.bfloat16) for i in range(4)}

    # LMCache:   metadata = LMCacheEngineMetadata(...); connector = CreateGPUConnector(...)
    #            engine = LMCacheEngineBuilder.get_or_create("id", LMCacheEngineConfig.from_env(), metadata, connector)
    # kvconnect: the layout is read from the cache tensors themselves; the config from the same LMCACHE_* names
    layout = KVLayout.from_tensors(kv_caches, groups=[GroupSpec(block_size=BLOCK)])
    engine = KVCacheEngine(layout, Config(max_local_cpu_size=0.05))  # Config.from_env() reads LMCACHE_* as LMCache does

    tokens = torch.randint(0, 32000, (1000,))
    first_blocks = list(range(3, 3 + 63))
    slot_mapping = slot_mapping_of(first_blocks, len(tokens))

    # LMCache:   engine.store(tokens, kvcaches=kv_caches, slot_mapping=slot_mapping)
    stored = engine.store(tokens, block_ids=[block_ids_from_slot_mapping(slot_mapping, BLOCK)])

    # LMCache:   engine.lookup(tokens) -> prefix length       (same here: tokens restorable from token 0)
    hit = engine.lookup(tokens)

    expected = {name: t[:, first_blocks].clone() for name, t in kv_caches.items()}
    for t in kv_caches.values():
        t.zero_()  # the engine's paged memory is gone

    # LMCache:   ret_mask = engine.retrieve(tokens, kvcaches=kv_caches, slot_mapping=new_slots)   # bool [num_tokens]
    new_blocks = list(range(100, 100 + 63))
    loaded = engine.retrieve(tokens, block_ids=[block_ids_from_slot_mapping(slot_mapping_of(new_blocks, len(tokens)), BLOCK)])
    ret_mask = torch.arange(len(tokens)) < loaded  # kvconnect returns the count; LMCache's mask is its prefix

    full = loaded // BLOCK
    exact = all(torch.equal(kv_caches[n][:, new_blocks[:full]], expected[n][:, :full]) for n in kv_caches)
    # LMCache:   LMCacheEngineBuilder.destroy("id")
    engine.close()
    print(f"stored {stored} tokens, lookup hit {hit}, retrieved {int(ret_mask.sum())} tokens, byte-exact: {exact}")
    if not (stored == hit == loaded == 768 and exact):  # 3 full 256-token chunks; the partial chunk is not stored
        raise SystemExit("from_lmcache: unexpected result")


if __name__ == "__main__":
    main()
