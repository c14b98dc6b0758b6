"""Decode context parallel: each rank stores and loads only its own tokens' rows.

Global token t lives on rank (t // interleave) % size. Rank-local tables cover only local
tokens; a chunk [s, e) of rank r holds local rows [local(s), local(e)). The end-to-end
test writes each global token's bytes into the row of the rank that owns it, stores every
rank's shard, restores each rank into a fresh cache and checks that every rank holds
exactly the bytes of its own tokens, and nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from support import zoo
from kvconnect import CorruptChunkError, DCPSpec, KVCacheEngine


@st.composite
def shards(draw):
    size = draw(st.integers(1, 8))
    return DCPSpec(rank=draw(st.integers(0, size - 1)), size=size, interleave_tokens=draw(st.sampled_from([1, 2, 3, 8, 64])))


@given(shards(), st.integers(0, 5000))
def test_local_tokens_before_matches_enumeration(dcp, t):
    assert dcp.local_tokens_before(t) == zoo.local_tokens(dcp, t)


@given(st.integers(1, 8), st.sampled_from([1, 2, 8, 64]), st.integers(0, 3000))
def test_ranks_partition_the_tokens(size, interleave, t):
    counts = [DCPSpec(rank=r, size=size, interleave_tokens=interleave).local_tokens_before(t) for r in range(size)]
    assert sum(counts) == t
    assert max(counts) - min(counts) <= interleave  # balanced to within one run


@given(shards(), st.integers(0, 2000), st.integers(0, 2000))
def test_local_tokens_before_is_monotone(dcp, a, b):
    lo, hi = sorted((a, b))
    assert dcp.local_tokens_before(lo) <= dcp.local_tokens_before(hi) <= dcp.local_tokens_before(lo) + (hi - lo)


def _owner_tokens(dcp: DCPSpec, n: int) -> np.ndarray:
    t = np.arange(n)
    return t[(t // dcp.interleave_tokens) % dcp.size == dcp.rank]


SHARDS = [(2, 1), (2, 8), (4, 16), (4, 1)]


@pytest.mark.parametrize("size,interleave", SHARDS)
@pytest.mark.parametrize("builder", ["mla", "mla_swa"])
def test_every_rank_restores_exactly_its_tokens(size, interleave, builder, rng):
    chunk = 64
    n = 3 * chunk + 16  # a partial tail, not stored
    boundary = 3 * chunk
    global_rows = torch.from_numpy(rng.integers(0, 256, (2, n, 1152), dtype=np.uint8))  # [layer, token, bytes]
    tokens = zoo.random_tokens(rng, n)
    for rank in range(size):
        dcp = DCPSpec(rank=rank, size=size, interleave_tokens=interleave)
        case = getattr(zoo, builder)(max_tokens=n, dcp=dcp)
        case.backings[0].zero_()
        case.backings[1].zero_()
        tables = zoo.random_tables(case, n, rng)
        mine = _owner_tokens(dcp, n)
        local = torch.arange(len(mine))
        bs = case.groups[0].block_size
        planes = zoo.reference_planes(case)
        for layer, plane in enumerate(planes):
            blocks = torch.as_tensor(tables[plane.group])[local // bs]
            plane.put(blocks, local % bs, global_rows[layer, torch.from_numpy(mine)])
        engine = KVCacheEngine(case.layout(), zoo.small_config(chunk))
        assert engine.store(tokens, tables) == boundary
        for c in engine.chunks(tokens, include_partial=False):
            # the chunk's prefix part and window pieces merged (kvconnect/restore/parts.py)
            _, _, _, plane_rows, _ = zoo.export_logical_chunk(engine, c)
            lo, hi = zoo.local_tokens(dcp, c.start), zoo.local_tokens(dcp, c.end)
            assert plane_rows[0] == (lo, hi - lo)  # the full layer: this rank's rows of the chunk
            w = case.window(1) if builder == "mla_swa" else None
            if w:
                wlo = zoo.local_tokens(dcp, max(c.start, c.end - w))
                assert plane_rows[1] == (wlo, hi - wlo)

        dst = case.clone(fill=0)
        dst_engine = KVCacheEngine(dst.layout(), zoo.small_config(chunk))
        zoo.transplant(engine, dst_engine, tokens)
        dst_tables = zoo.random_tables(case, n, rng)
        expected = zoo.expected_restore(case, dst.clone(), tables, dst_tables, boundary)
        assert dst_engine.retrieve(tokens, dst_tables) == boundary
        assert dst.first_difference(expected) is None
        # and, independently: the rank's rows hold exactly the global bytes of its tokens
        dst_planes = zoo.reference_planes(dst)
        for layer, plane in enumerate(dst_planes):
            w = case.window(plane.group)
            owned = mine[(mine < boundary) & (mine >= (0 if w is None else boundary - w))]
            rows = torch.from_numpy(np.searchsorted(mine, owned))
            blocks = torch.as_tensor(dst_tables[plane.group])[rows // bs]
            assert torch.equal(plane.get(blocks, rows % bs), global_rows[layer, torch.from_numpy(owned)])


def test_shards_do_not_mix(rng):
    """Rank 0's chunk is refused by rank 1, by a deployment with another DCP size, and by TP."""
    n, chunk = 128, 64
    tokens = zoo.random_tokens(rng, n)
    r0 = zoo.mla(max_tokens=n, dcp=DCPSpec(rank=0, size=2))
    engine = KVCacheEngine(r0.layout(), zoo.small_config(chunk))
    assert engine.store(tokens, zoo.random_tables(r0, n, rng)) == n
    key = engine.chunks(tokens, include_partial=False)[0].key
    data = engine.storage.export_chunk(key)
    for dcp in (DCPSpec(rank=1, size=2), DCPSpec(rank=0, size=4), DCPSpec(), DCPSpec(rank=0, size=2, interleave_tokens=4)):
        other = KVCacheEngine(zoo.mla(max_tokens=n, dcp=dcp).layout(), zoo.small_config(chunk))
        other_key = other.chunks(tokens, include_partial=False)[0].key
        assert other_key != key
        assert other.lookup(tokens) == 0
        with pytest.raises(CorruptChunkError):
            other.storage.import_chunk(data, key)
        assert len(other.pool) == 0


def test_window_restore_needs_only_local_window_rows(rng):
    """A rank's window group at P needs only its rows among [P - W, P): blocks before are -1."""
    dcp = DCPSpec(rank=1, size=2, interleave_tokens=8)
    n, chunk = 256, 64
    case = zoo.mla_swa(max_tokens=n, dcp=dcp, window=40, block_size=8)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, bounds))
    assert -1 in tables[1]
    engine = KVCacheEngine(case.layout(), zoo.small_config(chunk))
    assert engine.store(tokens, tables) == n
    dst = case.clone(fill=0)
    dst_engine = KVCacheEngine(dst.layout(), zoo.small_config(chunk))
    zoo.transplant(engine, dst_engine, tokens)
    dst_tables = zoo.random_tables(case, n, rng, keep=zoo.restore_keep(case, n))
    assert zoo.needed_rows(case, 1, n) == (zoo.local_tokens(dcp, n - 40), 128)
    expected = zoo.expected_restore(case, dst.clone(), tables, dst_tables, n)
    assert dst_engine.retrieve(tokens, dst_tables) == n
    assert dst.first_difference(expected) is None
