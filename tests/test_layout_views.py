"""Aliased views of one allocation, given to the public API (KVLayout.from_tensors), are
stored once: the same bytes per chunk as without the alias, byte-exact restores, and a
partial overlap refused. (The vLLM translator de-duplicates the same way; tests/ascend runs
vLLM-Ascend A5's real three-view indexer through it.)

The blob below is a synthetic fixture shaped like vLLM-Ascend A5's C4 indexer page (K fp8
rows then fp32 scales, plus a byte view over both): no runnable engine code on CPU produces
an aliased pair through the public API.
"""

from __future__ import annotations

import pytest
import torch

from kvconnect import Config, GroupSpec, KVCacheEngine, KVLayout, LayoutError

NB, ROWS = 24, 16


def indexer_views(seed: int = 0):
    """(K [NB, ROWS, 1, 128] uint8, scale [NB, ROWS, 1, 1] fp32, whole [NB, ROWS, 1, 132] uint8) over one blob."""
    g = torch.Generator().manual_seed(seed)
    page = ROWS * 132
    blob = torch.randint(0, 256, (NB * page,), dtype=torch.uint8, generator=g)
    k = torch.as_strided(blob, (NB, ROWS, 1, 128), (page, 128, 128, 1))
    scale = torch.as_strided(blob.view(torch.float32),
                             (NB, ROWS, 1, 1), (page // 4, 1, 1, 1), (ROWS * 128) // 4)
    whole = torch.as_strided(blob, (NB, ROWS, 1, 132), (page, 132, 132, 1))
    return blob, k, scale, whole


def engine_for(kv, **kw) -> KVCacheEngine:
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=ROWS)], **kw)
    return KVCacheEngine(layout, Config(chunk_size=64, max_local_cpu_size=0.01, pool_prefault=False))


@pytest.mark.parametrize("order", ["k_scale_whole", "whole_k_scale"])
def test_aliased_views_are_stored_once_and_restored_exactly(order):
    blob, k, scale, whole = indexer_views()
    views = (k, scale, whole) if order == "k_scale_whole" else (whole, k, scale)
    eng = engine_for({"layers.0.indexer": views}, layer_groups={"layers.0.indexer": (0, 0, 0)})
    plain = engine_for({"layers.0.indexer": (k, scale)})
    try:
        assert len(eng.layout.planes) == (2 if order == "k_scale_whole" else 1)
        assert eng.max_chunk_bytes == plain.max_chunk_bytes == 4 * ROWS * 132  # 64 tokens = 4 blocks, each byte once
        tokens = list(range(128))
        before = blob.clone()
        assert eng.store(tokens, block_ids=[list(range(8))]) == 128
        blob.zero_()
        assert eng.retrieve(tokens, block_ids=[list(range(10, 18))]) == 128
        page = ROWS * 132
        assert torch.equal(blob[10 * page:18 * page], before[0:8 * page])  # every byte of each page, once
        assert not blob[:10 * page].any() and not blob[18 * page:].any()  # nothing outside the target blocks
    finally:
        eng.close()
        plain.close()


def test_a_partial_overlap_is_refused():
    blob, k, _, _ = indexer_views()
    shifted = torch.as_strided(blob, (NB, ROWS, 1, 128), (ROWS * 132, 128, 128, 1), 64)  # half inside K's rows
    with pytest.raises(LayoutError, match="overlaps another tensor of the layer without being covered"):
        KVLayout.from_tensors({"layers.0": (k, shifted)}, groups=[GroupSpec(block_size=ROWS)])


def test_a_dropped_view_must_share_a_group_with_what_covers_it():
    _, k, scale, whole = indexer_views()
    groups = [GroupSpec(block_size=ROWS), GroupSpec(block_size=ROWS, sliding_window=32)]
    with pytest.raises(LayoutError, match="same group"):
        KVLayout.from_tensors({"layers.0": (k, scale, whole)}, groups=groups, layer_groups={"layers.0": (0, 0, 1)})


def test_views_of_distinct_bytes_are_all_kept():
    kv = torch.zeros(2, NB, ROWS, 2, 8)
    layout = KVLayout.from_tensors({"layers.0": (kv[0], kv[1])}, groups=[GroupSpec(block_size=ROWS)])
    assert len(layout.planes) == 2
