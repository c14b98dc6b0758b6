"""The restore gate: a hit P is reported only when every group can resume at P.

Hand-computed cases first (window crossing chunks, compressed floor, nulled blocks, a
missing middle chunk, recurrent state), then a randomized comparison of lookup/retrieve
with the brute-force reference in ``zoo.expected_boundary`` under random block nulling
and chunk removal.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import zoo
from kvconnect import KVCacheEngine

SWA = 1  # gemma3-swa: group 0 full, group 1 sliding window 80, block 16


def _engine(case, chunk, **kw):
    return KVCacheEngine(case.layout(), zoo.small_config(chunk, **kw))


def _restore_and_check(case, engine, tokens, src_tables, boundary, rng, dst_tables=None):
    """Move chunks to a fresh cache, retrieve, and compare every byte with the reference."""
    chunk = engine.config.chunk_size
    dst = case.clone(fill=0)
    dst_engine = _engine(dst, chunk, save_unfull_chunk=engine.config.save_unfull_chunk)
    zoo.transplant(engine, dst_engine, tokens)
    if dst_tables is None:
        dst_tables = zoo.random_tables(case, len(tokens), rng, keep=zoo.restore_keep(case, max(boundary, 1)))
    expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, boundary)
    assert dst_engine.lookup(tokens) == boundary
    assert dst_engine.retrieve(tokens, dst_tables) == boundary
    assert dst.first_difference(expected) is None
    return dst, dst_tables


def test_window_crossing_chunks(rng):
    """W=80 over 64-token chunks: resuming at P needs the window's rows from up to two chunks.
    Null one block that only chunk 0's window rows use: boundaries whose window reaches
    into chunk 0 are not restorable, later ones are."""
    chunk, n = 64, 256
    case = zoo.gemma_swa(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    tables[SWA][1] = -1  # tokens [16, 32): chunk 0 stores rows [0, 64) of the window group
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    masks = zoo.stored_masks(engine, engine.chunks(tokens, include_partial=False))
    assert masks == [0b01, 0b11, 0b11, 0b11]
    assert engine.lookup(tokens[:64]) == 0  # needs window rows [0, 64): chunk 0 lacks them
    assert engine.lookup(tokens[:128]) == 0  # needs [48, 128): crosses into chunk 0
    assert engine.lookup(tokens[:192]) == 192  # needs [112, 192): chunks 1 and 2
    assert engine.lookup(tokens) == 256
    # retrieve at 192 writes window rows [112, 192) only, with the earlier window blocks absent
    dst_tables = zoo.random_tables(case, 192, rng)
    dst_tables[SWA][:7] = [-1] * 7  # blocks of tokens [0, 112): outside the window, engine freed them
    _restore_and_check(case, engine, tokens[:192], tables, 192, rng, dst_tables)


def test_nulled_full_block_stops_the_hit(rng):
    """A full-attention block absent at store time: that chunk lacks the group, the hit stops before it."""
    chunk, n = 64, 256
    case = zoo.gemma_swa(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    tables[0][5] = -1  # tokens [80, 96) of the full group: chunk 1
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    masks = zoo.stored_masks(engine, engine.chunks(tokens, include_partial=False))
    assert masks == [0b11, 0b10, 0b11, 0b11]
    _restore_and_check(case, engine, tokens, tables, 64, rng)


def test_nulled_window_blocks_outside_every_stored_window(rng):
    """Blocks the window group freed long ago cost nothing: each chunk's window rows are present."""
    chunk, n = 128, 512
    case = zoo.gemma_swa(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, bounds))
    assert tables[SWA].count(-1) == 12  # per chunk only the last 80 tokens (5 of 8 blocks) are kept
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    assert zoo.stored_masks(engine, engine.chunks(tokens, include_partial=False)) == [0b11] * 4
    _restore_and_check(case, engine, tokens, tables, n, rng)


def test_missing_middle_chunk(rng):
    """A chunk evicted from the middle: the hit is the prefix before it, and retrieve loads only that."""
    chunk, n = 256, 1024
    case = zoo.dsv4(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, bounds))
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
    assert engine.lookup(tokens) == n
    assert engine.pool.remove(keys[2])
    assert engine.lookup(tokens) == 512
    _restore_and_check(case, engine, tokens, tables, 512, rng)
    assert engine.pool.remove(keys[0])
    assert engine.lookup(tokens) == 0


def test_compressed_floor(rng):
    """Rows of a compressed group are floor(P / cr): a partial chunk ending at 642 restores
    160 rows of C4 and 5 rows of C128; row 5 of C128 (tokens 640..767) is not loaded."""
    chunk, n = 256, 642
    case = zoo.dsv4(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, True)
    tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, bounds))
    engine = _engine(case, chunk, save_unfull_chunk=True)
    assert engine.store(tokens, tables) == n
    c4, c128 = zoo.DSV4_NAMES.index("c4"), zoo.DSV4_NAMES.index("c128")
    assert zoo.needed_rows(case, c4, n) == (0, 160) and zoo.needed_rows(case, c128, n) == (0, 5)
    dst, dst_tables = _restore_and_check(case, engine, tokens, tables, n, rng)
    # [NB, 2 rows, 584], each block written split by vLLM: [2 x 576 data][2 x 8 scales]
    block = dst.kv_caches["layers.2.c128"][dst_tables[c128][2]].reshape(-1)
    assert block[:576].any() and block[1152:1160].any()  # row 4: data and scales loaded
    assert not block[576:1152].any() and not block[1160:1168].any()  # row 5: would need tokens up to 768
    # one token fewer: C4 floor drops a row, C128 keeps 5 rows; the partial chunk is a new key
    assert engine.lookup(tokens[:641]) == 512


def test_state_snapshot_absent_gives_no_hit(rng):
    """A recurrent-state group needs its snapshot at exactly P."""
    chunk, n = 64, 256
    case = zoo.state_hybrid(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    no_state = [tables[0], [-1] * len(tables[1])]
    engine = _engine(case, chunk)
    assert engine.store(tokens, no_state) == n  # attention rows are stored...
    assert engine.lookup(tokens) == 0  # ...but no boundary has its state
    dst = case.clone(fill=0)
    before = dst.snapshot()
    dst_engine = _engine(dst, chunk)
    zoo.transplant(engine, dst_engine, tokens)
    assert dst_engine.retrieve(tokens, zoo.random_tables(case, n, rng)) == 0
    assert dst.same_bytes(before)


def test_state_snapshot_only_at_the_end(rng):
    """Engines keep the state of the latest block only: the full prompt is restorable, its prefixes are not."""
    chunk, n = 64, 256
    case = zoo.state_hybrid(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    tables[1] = [-1] * (len(tables[1]) - 1) + [tables[1][-1]]
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    assert engine.lookup(tokens) == n
    assert engine.lookup(tokens[:192]) == 0
    dst_tables = zoo.random_tables(case, n, rng)
    dst_tables[1] = [-1] * (len(dst_tables[1]) - 1) + [dst_tables[1][-1]]
    _restore_and_check(case, engine, tokens, tables, n, rng, dst_tables)


def test_state_boundary_on_page_edge(rng):
    """State pages of 64 tokens with 32-token chunks: only boundaries on a page edge restore."""
    chunk, n = 32, 96
    case = zoo.state_hybrid(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    assert engine.lookup(tokens) == 64
    assert engine.lookup(tokens[:64]) == 64
    assert engine.lookup(tokens[:32]) == 0
    _restore_and_check(case, engine, tokens, tables, 64, rng)


def test_all_window_model_needs_only_the_last_window(rng):
    """A model whose every layer is sliding-window (W=48 < chunk 64): resuming at P needs only
    the chunk that holds [P-48, P), so earlier chunks may be misses."""
    import dataclasses

    from kvconnect import GroupSpec

    chunk, n = 64, 256
    case = dataclasses.replace(zoo.llama("flash", max_tokens=n), groups=[GroupSpec(block_size=16, sliding_window=48)])
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    chunks = engine.chunks(tokens, include_partial=False)
    zoo.remove_chunk(engine, chunks[0])
    zoo.remove_chunk(engine, chunks[1])
    assert engine.lookup(tokens) == n
    assert engine.lookup(tokens[:128]) == 0
    dst_tables = zoo.random_tables(case, n, rng)
    dst_tables[0][:13] = [-1] * 13  # tokens [0, 208) are outside the window at 256
    _restore_and_check(case, engine, tokens, tables, n, rng, dst_tables)


def test_lookup_never_exceeds_stored(rng):
    """k chunks + r tokens stored without the tail: lookup of any extension is at most k chunks."""
    chunk = 64
    case = zoo.llama("flash", max_tokens=1024)
    engine = _engine(case, chunk)
    for k, r in [(0, 10), (1, 0), (1, 63), (3, 1), (5, 33)]:
        n = k * chunk + r
        tokens = zoo.random_tokens(rng, n)
        assert engine.store(tokens, zoo.random_tables(case, n, rng)) == k * chunk
        assert engine.lookup(tokens) == k * chunk
        longer = np.concatenate([tokens, zoo.random_tokens(rng, 200)])
        assert engine.lookup(longer) == k * chunk
        assert engine.lookup(tokens[: max(0, k * chunk - 1)]) == max(0, (k - 1) * chunk)


RANDOM_CASES = {
    "gemma3-swa": (64, 6),
    "dsv4-flash": (256, 3),
    "state-hybrid": (64, 5),
    "dsv3-mla-dcp": (64, 4),
    "dsv32-ascend": (64, 4),
    "mla-swa-dcp": (64, 4),
}
_BUILT: dict = {}


def _case(name):
    if name not in _BUILT:
        chunk, k = RANDOM_CASES[name]
        _BUILT[name] = zoo.build(name, max_tokens=k * chunk + chunk)
    return _BUILT[name]


@settings(max_examples=25)
@given(
    name=st.sampled_from(sorted(RANDOM_CASES)),
    extra=st.integers(0, 1),
    tail=st.integers(0, 63),
    unfull=st.booleans(),
    null_fraction=st.sampled_from([0.0, 0.1, 0.3]),
    removals=st.lists(st.integers(0, 6), max_size=2),
    seed=st.integers(0, 2**32 - 1),
)
def test_gate_matches_reference(name, extra, tail, unfull, null_fraction, removals, seed):
    """Random nulled blocks at store time and random chunks removed: lookup equals the
    brute-force gate, and retrieve writes exactly the reference rows."""
    rng = np.random.default_rng(seed)
    chunk, k = RANDOM_CASES[name]
    case = _case(name)
    n = (k - extra) * chunk + (tail // 8) * 8
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, unfull)
    keep = zoo.window_keep(case, bounds) if name == "dsv4-flash" else None
    tables = zoo.random_tables(case, n, rng, keep=keep)
    for g, table in enumerate(tables):
        for i in range(len(table)):
            if rng.random() < null_fraction:
                table[i] = -1
    for g, src in case.tied_groups.items():
        tables[g] = list(tables[src])
    engine = _engine(case, chunk, save_unfull_chunk=unfull)
    engine.store(tokens, tables)
    masks = zoo.store_masks(case, tables, bounds)
    chunks = engine.chunks(tokens, include_partial=unfull)
    for i in removals:
        if i < len(chunks):
            zoo.remove_chunk(engine, chunks[i])
            masks[i] = None
    masks = [m or None for m in masks]
    assert zoo.stored_masks(engine, chunks) == masks
    boundary = zoo.expected_boundary(case, bounds, masks)
    assert engine.lookup(tokens) == boundary
    assert boundary <= sum(e - s for (s, e), m in zip(bounds, masks) if m)  # never more than stored
    if boundary:
        _restore_and_check(case, engine, tokens, tables, boundary, rng)


def test_restore_with_fewer_groups_never_shrinks_an_entry(rng):
    """A later store of the same chunk after its window blocks were freed keeps the fuller entry;
    a store that adds a missing group replaces it."""
    chunk, n = 64, 128
    case = zoo.gemma_swa(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    full_tables = zoo.random_tables(case, n, rng)
    freed = [list(t) for t in full_tables]
    freed[SWA] = [-1] * len(freed[SWA])  # the window group's blocks are gone
    engine = _engine(case, chunk)
    keys = engine.chunks(tokens, include_partial=False)  # chunks: stored_masks merges their two parts
    assert engine.store(tokens, full_tables) == n
    assert zoo.stored_masks(engine, keys) == [0b11, 0b11]
    engine.store(tokens, freed)  # group 1 absent now: must not replace the complete entries
    assert zoo.stored_masks(engine, keys) == [0b11, 0b11]
    assert engine.lookup(tokens) == n

    engine2 = _engine(case, chunk)
    assert engine2.store(tokens, freed) == n  # full group only
    assert zoo.stored_masks(engine2, keys) == [0b01, 0b01]
    assert engine2.lookup(tokens) == 0
    engine2.store(tokens, full_tables)  # now both groups: replaces
    assert zoo.stored_masks(engine2, keys) == [0b11, 0b11]
    assert engine2.lookup(tokens) == n


def test_an_inconsistent_chunk_drops_only_itself(rng):
    """A pool entry whose header claims rows it does not hold is dropped alone: the prompt's
    other chunks stay and serve the prefix before it."""
    import dataclasses

    chunk, n = 64, 256
    case = zoo.gemma_swa(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    engine = _engine(case, chunk)
    assert engine.store(tokens, tables) == n
    keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
    (entry,) = engine.pool.acquire([keys[2]])
    rows = list(entry.header.plane_rows)
    rows[0] = (rows[0][0], rows[0][1] + 1)  # one row more than the payload holds
    entry.header = dataclasses.replace(entry.header, plane_rows=tuple(rows))
    engine.pool.release([entry])
    before = case.clone()
    assert engine.retrieve(tokens, zoo.random_tables(case, n, rng)) == 0  # nothing is loaded
    assert case.first_difference(before) is None
    # only the bad object is dropped: chunk 2's prefix part; its window rows stay (kvconnect/restore/parts.py)
    assert zoo.stored_masks(engine, engine.chunks(tokens, include_partial=False)) == [0b11, 0b11, 0b10, 0b11]
    assert engine.lookup(tokens) == 128
