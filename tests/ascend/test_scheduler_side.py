"""DeepSeek V4's scheduler side on vLLM 0.23's and vLLM-Ascend's real single-type managers.

vLLM-Ascend's scheduler config (``generate_scheduler_kv_cache_config``) gives one
``CompressAttentionManager`` per compressed group and ``SlidingWindowManager``s for the SWA and
compressor-state groups, all drawing on one ``BlockPool``. The block ids they hand out while a
prompt spanning several compressed blocks is prefilled (freed window blocks as the null block)
are what the connector's worker receives; the ids a new request gets for a connector hit
(null blocks for what lies outside each window) are where it loads. Both go through the
connector's translation and engine; the rows the model reads at the hit are compared by
vLLM-Ascend's own addressing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harness
import reference as ref
from reference import CHUNK, gather, needed_rows, randomize
from kvconnect import Config, KVCacheEngine
from kvconnect.integrations.vllm import translate


def _manager(case):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    config = generate_scheduler_kv_cache_config([case.kv_cache_config])
    manager = KVCacheManager(config, max_model_len=8192, scheduler_block_size=128, hash_block_size=128,
                             enable_caching=False)
    return manager, [type(m).__name__ for m in manager.coordinator.single_type_managers]


def _request(req_id, tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, [int(t) for t in tokens], SamplingParams(max_tokens=1), None)


@pytest.mark.parametrize("num_tokens, step", [(1300, 512), (2100, 384)])
def test_deepseek_v4_block_ids_from_the_real_managers_round_trip(num_tokens, step):
    case = harness.deepseek_v4(device="A3", num_blocks=400)
    manager, kinds = _manager(case)
    assert kinds == ["CompressAttentionManager", "CompressAttentionManager", "SlidingWindowManager",
                     "SlidingWindowManager", "SlidingWindowManager", "SlidingWindowManager"]
    rules = ref.group_rules(case)
    gen = torch.Generator().manual_seed(num_tokens)
    randomize(case, gen)
    translation = translate.translate_kv_caches(case.kv_cache_config, case.kv_caches)
    engine = KVCacheEngine(translation.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.2))
    try:
        tokens = np.random.default_rng(num_tokens).integers(0, 32000, num_tokens).astype(np.int64)
        req = _request("a", tokens)
        stored = 0
        mirror = ref.RequestBlocks(rules, ref.BlockPool(case.num_blocks, np.random.default_rng(0)))
        while req.num_computed_tokens < num_tokens:
            n = min(step, num_tokens - req.num_computed_tokens)
            assert manager.allocate_slots(req, n) is not None
            ids = manager.get_block_ids("a")
            # the reference's idea of which blocks exist and which are null agrees with the managers
            mirror.advance(req.num_computed_tokens, req.num_computed_tokens + n)
            assert [len(g) for g in ids] == [len(g) for g in mirror.ids]
            assert [[b == 0 for b in g] for g in ids] == [[b == 0 for b in g] for g in mirror.ids]
            req.num_computed_tokens += n
            end = req.num_computed_tokens // CHUNK * CHUNK
            if end > stored:  # the worker's save of the chunks this step completed
                mask = np.ones(end, dtype=bool)
                mask[:stored] = False
                engine.store(tokens[:end], translation.block_tables(ids), mask=mask)
                stored = end
        boundary = num_tokens // CHUNK * CHUNK
        assert engine.lookup(tokens) == boundary
        expected = gather(case, needed_rows(case, rules, manager.get_block_ids("a"), boundary))
        manager.free(req)

        randomize(case, gen)
        hit = _request("b", tokens)
        assert manager.allocate_slots(hit, 0, num_external_computed_tokens=boundary, delay_cache_blocks=True) is not None
        ids = manager.get_block_ids("b")
        for g, rule in enumerate(rules):  # every row needed at the hit has a real block; the rest are null
            assert len(ids[g]) == rule.blocks_for(boundary)
            live = {r // rule.rows_per_block for r in rule.needed_rows(boundary)}
            assert all((b != 0) == (i in live) for i, b in enumerate(ids[g])), (g, ids[g])
        assert engine.retrieve(tokens[:boundary], translation.block_tables(ids)) == boundary
        got = gather(case, needed_rows(case, rules, ids, boundary))
        for key, rows in expected.items():
            assert all(torch.equal(a, b) for a, b in zip(rows, got[key])), key
    finally:
        engine.close()
