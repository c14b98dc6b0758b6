"""Byte-exact restores on vLLM-Ascend 0.13.0rc3's DeepSeek V4 caches, addressed by that release.

Block ids come from the release's own allocator (``KVCacheCoordinatorWithMultiPool``: per-group
pools of num_blocks / ratio, ``CompressAttentionManager``); rows are written and read at the
slots its ``BlockTable.compute_slot_mapping`` gives for the compressed positions of
``get_compressed_pos_and_indices`` (harness013), never by kvconnect's row model. A prompt is
prefilled in steps (each step's rows written at the release's slots, each completed chunk
stored as the worker does); then the request is freed, all memory re-randomised, a new
request with the same prompt gets other blocks, and the prefix is retrieved into them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harness013 as h
from kvconnect import Config, KVCacheEngine
from kvconnect.integrations.vllm import translate

CHUNK = 256


def _storages(case) -> list[torch.Tensor]:
    seen, out = set(), []
    for value in case.kv_caches.values():
        for t in value:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out.append(torch.empty(0, dtype=torch.uint8).set_(storage))
    return out


def _randomize(case, gen) -> None:
    for flat in _storages(case):
        flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))


def _group_of(case) -> dict:
    return {layer: g for g, group in enumerate(case.groups) for layer in group.layer_names}


def _width(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[2:])) if t.dim() > 2 else 1


def _ids(coordinator, request_id) -> list[list[int]]:
    return [[b.block_id for b in blocks] for blocks in coordinator.get_blocks(request_id)]


def _write_step(case, ids, start, end, gen, written) -> None:
    """What the forward writes for tokens [start, end): each layer's new compressed rows."""
    groups = _group_of(case)
    for layer, value in case.kv_caches.items():
        g = groups[layer]
        slots = case.slots(g, ids[g], start, end)
        for i, t in enumerate(value):
            rows = torch.randint(0, 256, (len(slots), _width(t) * t.element_size()), generator=gen,
                                 dtype=torch.uint8).view(t.dtype).view(len(slots), _width(t))
            h.write_rows(t, slots, rows)
            written.setdefault((layer, i), []).append(rows.clone())


@pytest.mark.parametrize("num_tokens, step", [(1300, 256), (2700, 512), (40961, 8192)])
def test_round_trip_on_the_release_allocation_and_slots(num_tokens, step):
    case = h.deepseek_v4()
    gen = torch.Generator().manual_seed(num_tokens)
    rng = np.random.default_rng(num_tokens)
    _randomize(case, gen)
    t = translate.translate_kv_caches(case.kv_cache_config, case.kv_caches, model_name="dsv4-013")
    assert t.release == "vllm-ascend-0.13"
    engine = KVCacheEngine(t.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.5))
    coordinator = case.coordinator()
    try:
        tokens = rng.integers(0, 32000, size=num_tokens).astype(np.int64)
        # another request first: the prompt's blocks are not the pools' first ids
        coordinator.allocate_new_blocks("other", 3 * 16384)
        written: dict = {}
        computed = stored = 0
        while computed < num_tokens:
            end = min(num_tokens, computed + step)
            coordinator.allocate_new_blocks("src", end)
            ids = _ids(coordinator, "src")
            _write_step(case, ids, computed, end, gen, written)
            computed = end
            chunk_end = computed // CHUNK * CHUNK
            if chunk_end > stored:
                mask = np.ones(chunk_end, dtype=bool)
                mask[:stored] = False
                engine.store(tokens[:chunk_end], t.block_tables(tuple(tuple(x) for x in ids)), mask=mask)
                stored = chunk_end
        boundary = num_tokens // CHUNK * CHUNK
        assert engine.lookup(tokens) == boundary
        expected = {key: torch.cat(rows) for key, rows in written.items()}

        coordinator.free("src")
        coordinator.allocate_new_blocks("filler", 16384)  # the new request gets other blocks
        _randomize(case, gen)
        coordinator.allocate_new_blocks("dst", boundary)
        dst = _ids(coordinator, "dst")
        before = {(layer, i): x.clone() for layer, value in case.kv_caches.items() for i, x in enumerate(value)}
        assert engine.retrieve(tokens[:boundary], t.block_tables(tuple(tuple(x) for x in dst))) == boundary

        groups = _group_of(case)
        checked = 0
        for layer, value in case.kv_caches.items():
            g = groups[layer]
            slots = case.slots(g, dst[g], 0, boundary)
            ratio = case.groups[g].kv_cache_spec.compress_ratio
            assert len(slots) == boundary // ratio
            for i, x in enumerate(value):
                got = h.read_rows(x, slots, _width(x))
                want = expected[(layer, i)][: len(slots)]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{layer}[{i}] differs"
                checked += len(slots)
                # nothing outside the new request's blocks changed
                changed = (x.view(torch.uint8) != before[(layer, i)].view(torch.uint8)).flatten(1).any(1)
                outside = set(changed.nonzero().flatten().tolist()) - set(dst[g])
                assert not outside, f"{layer}[{i}]: blocks {sorted(outside)[:5]} changed outside the request"
        assert checked > 0
    finally:
        engine.close()
