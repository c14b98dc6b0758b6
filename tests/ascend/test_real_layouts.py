"""Round trips through kvconnect on exactly what vLLM-Ascend 0.23.0.post1 registers.

Each case is built by vLLM-Ascend's own code (``harness``); the connector's translation
(``translate_kv_caches``, as ``register_kv_caches`` calls it) and engine store a multi-chunk
prompt the way the worker does in each prefill step (block ids per group from one shared
pool, windows' blocks freed to the null block as the prompt advances). The memory is then
re-randomised, the prefix is retrieved into other blocks, and every row the model reads to
resume is compared, addressed by vLLM-Ascend's semantics (``reference``), not kvconnect's.
Blocks no group of the new request owns must not change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harness
import reference as ref
from reference import CHUNK, as_bytes, gather, needed_rows, randomize
from kvconnect import Config, KVCacheEngine
from kvconnect.integrations.vllm import translate

CASES = {
    "llama-gqa": lambda: harness.gqa(num_blocks=24),
    "gqa-swa-bs128": lambda: harness.gqa(window=256, num_blocks=40),
    "gqa-swa-bs256": lambda: harness.gqa(window=512, block_size=256, num_blocks=30),
    "deepseek-v3": lambda: harness.deepseek_mla(num_blocks=24),
    "deepseek-v32": lambda: harness.deepseek_mla(variant="v32", num_blocks=24),
    "deepseek-v32-li-c8": lambda: harness.deepseek_mla(variant="v32-c8", num_blocks=24),
    "deepseek-v4-a3": lambda: harness.deepseek_v4(device="A3", num_blocks=260),
    "deepseek-v4-a5": lambda: harness.deepseek_v4(device="A5", num_blocks=260),
    # seed 001: the compressed block size is configurable (64: C4 blocks of 256 tokens, state blocks of 4)
    "deepseek-v4-a3-bs64": lambda: harness.deepseek_v4(device="A3", block_size=64, num_blocks=520),
}

_BUILT: dict = {}


def build(name):
    if name not in _BUILT:
        _BUILT[name] = CASES[name]()
    return _BUILT[name]


def prefill(case, engine, translation, rules, tokens, pool, gen, step, *, drop_last_window=False):
    """Compute ``tokens`` in steps; after each, save the chunks it completed (the worker's
    save: current block ids, chunks already stored masked). Returns the request's blocks."""
    req = ref.RequestBlocks(rules, pool)  # memory is random from the start: every row distinct
    stored = 0
    computed = 0
    while computed < len(tokens):
        end = min(len(tokens), computed + step)
        req.advance(computed, end)
        computed = end
        chunk_end = computed // CHUNK * CHUNK
        if chunk_end > stored:
            table = req.table()
            if drop_last_window and chunk_end == len(tokens) // CHUNK * CHUNK:
                # the last chunk is saved after its window / state blocks were freed
                table = tuple(ids if r.window is None else tuple(0 for _ in ids) for r, ids in zip(rules, table))
            mask = np.ones(chunk_end, dtype=bool)
            mask[:stored] = False
            engine.store(tokens[:chunk_end], translation.block_tables(table), mask=mask)
            stored = chunk_end
    return req


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("num_tokens, step", [(700, 256), (1300, 512), (1800, 768)])
def test_round_trip_on_real_allocation(name, num_tokens, step):
    case = build(name)
    rng = np.random.default_rng(num_tokens * 31 + len(name))
    gen = torch.Generator().manual_seed(num_tokens)
    randomize(case, gen)
    translation = translate.translate_kv_caches(case.kv_cache_config, case.kv_caches, model_name=name)
    assert translation.release == "vllm-ascend-0.23"
    rules = ref.group_rules(case)
    engine = KVCacheEngine(translation.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.2))
    try:
        tokens = rng.integers(0, 32000, size=num_tokens).astype(np.int64)
        pool = ref.BlockPool(case.num_blocks, rng)
        src = prefill(case, engine, translation, rules, tokens, pool, gen, step)
        boundary = num_tokens // CHUNK * CHUNK
        assert engine.lookup(tokens) == boundary
        expected = gather(case, needed_rows(case, rules, src.table(), boundary))

        # a new request with the same prompt: other blocks, memory re-randomised
        for ids in src.ids:
            for b in ids:
                if b:
                    pool.give(b)
        randomize(case, gen)
        dst = ref.RequestBlocks(rules, pool)
        dst.advance(boundary, boundary)
        before = {k: as_bytes(t).clone() for k, t in _all_views(case).items()}
        assert engine.retrieve(tokens[:boundary], translation.block_tables(dst.table())) == boundary
        got = gather(case, needed_rows(case, rules, dst.table(), boundary))
        for key, rows in expected.items():
            assert len(rows) == len(got[key])
            for i, (a, b) in enumerate(zip(rows, got[key])):
                assert torch.equal(a, b), f"{name}: {key} needed row {i} differs after retrieve"
        _assert_only_owned_blocks_changed(case, rules, dst, before)
    finally:
        engine.close()


def _all_views(case) -> dict:
    return {(layer, i): t for layer, value in case.kv_caches.items() for i, t in enumerate(ref.tensors_of(value))}


def _assert_only_owned_blocks_changed(case, rules, dst, before) -> None:
    owned = {b for ids in dst.ids for b in ids if b}
    for key, t in _all_views(case).items():
        changed = (as_bytes(t) != before[key]).flatten(1).any(1).nonzero().flatten().tolist()
        split = t.shape[0] // case.num_blocks if t.shape[0] >= case.num_blocks else 1
        outside = [kb for kb in changed if kb // split not in owned]
        assert not outside, f"{key}: blocks {outside[:5]} changed but the request owns none of them"


def test_a5_indexer_third_view_is_stored_once():
    """A5 registers the C4 indexer as (K fp8 [.,128], scale fp32 [.,1], K+scale [.,132]) over one
    page; the third is the fused scatter kernel's byte handle. kvconnect stores K and scale only."""
    case = build("deepseek-v4-a5")
    translation = translate.translate_kv_caches(case.kv_cache_config, case.kv_caches)
    layer = "model.layers.1.self_attn.indexer.k_cache"
    assert len(ref.tensors_of(case.kv_caches[layer])) == 3
    planes = [p for p in translation.layout.planes if p.layer_name == layer]
    assert [p.row_bytes for p in planes] == [128, 4]
    k, scale, full = ref.tensors_of(case.kv_caches[layer])
    assert full.data_ptr() == k.data_ptr() and full.stride(0) * full.element_size() == k.stride(0) * k.element_size()


@pytest.mark.parametrize("name", ["deepseek-v4-a3", "gqa-swa-bs256"])
def test_lookup_stops_at_last_restorable_chunk_when_window_blocks_were_freed(name):
    case = build(name)
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    randomize(case, gen)
    translation = translate.translate_kv_caches(case.kv_cache_config, case.kv_caches)
    rules = ref.group_rules(case)
    engine = KVCacheEngine(translation.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.2))
    try:
        tokens = rng.integers(0, 32000, size=1300).astype(np.int64)
        prefill(case, engine, translation, rules, tokens, ref.BlockPool(case.num_blocks, rng), gen, 256,
                drop_last_window=True)
        # the last chunk (ending at 1280) lacks its window rows: the hit is the chunk before it
        assert engine.lookup(tokens) == 1024
    finally:
        engine.close()


def test_deepseek_v4_chunks_do_not_depend_on_the_configured_block_size():
    """Seed 001: vLLM-Ascend's compressed block size is configurable (32/64/128); a chunk a
    deployment at block 128 stored must be found and restored by one at block 64."""
    big, small = build("deepseek-v4-a3"), build("deepseek-v4-a3-bs64")
    t_big = translate.translate_kv_caches(big.kv_cache_config, big.kv_caches, model_name="v4")
    t_small = translate.translate_kv_caches(small.kv_cache_config, small.kv_caches, model_name="v4")
    assert t_big.layout.fingerprint == t_small.layout.fingerprint
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(11)
    randomize(big, gen)
    randomize(small, gen)
    src = KVCacheEngine(t_big.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.2))
    dst = KVCacheEngine(t_small.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.2))
    try:
        tokens = rng.integers(0, 32000, size=1300).astype(np.int64)
        big_rules, small_rules = ref.group_rules(big), ref.group_rules(small)
        req = prefill(big, src, t_big, big_rules, tokens, ref.BlockPool(big.num_blocks, rng), gen, 256)
        boundary = 1280
        expected = gather(big, needed_rows(big, big_rules, req.table(), boundary))
        moved = zoo_transplant(src, dst, tokens)
        assert moved > 0 and dst.lookup(tokens) == boundary
        target = ref.RequestBlocks(small_rules, ref.BlockPool(small.num_blocks, rng))
        target.advance(boundary, boundary)
        assert dst.retrieve(tokens[:boundary], t_small.block_tables(target.table())) == boundary
        got = gather(small, needed_rows(small, small_rules, target.table(), boundary))
        for key, rows in expected.items():
            assert all(torch.equal(a, b) for a, b in zip(rows, got[key])), key
    finally:
        src.close()
        dst.close()


def zoo_transplant(src, dst, tokens) -> int:
    from support import zoo

    return zoo.transplant(src, dst, tokens)
