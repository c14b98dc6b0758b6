"""Byte-exact store -> retrieve round trips over the model zoo.

Each test stores a prompt from a randomly filled cache with random block tables, moves the
chunks to a fresh zeroed cache (through the canonical encoded form, as a lower tier would),
retrieves them with *different* random block tables, and compares the whole destination
memory (padding and unused blocks included) with ``zoo.expected_restore``: the bytes
before, plus exactly the rows each group needs at the restored boundary.
"""

from __future__ import annotations

import numpy as np
import pytest

from support import zoo
from kvconnect import KVCacheEngine, TokenError

ZOO_CHUNKS = [(name, chunk) for name, (_, sizes) in zoo.ZOO.items() for chunk in sizes]
SPARSE_WINDOWS = {"dsv4-flash", "dsv4-flash-packed"}  # too few blocks for dense windowed tables


def _engine(case, chunk, backend=None, **config):
    return KVCacheEngine(case.layout(), zoo.small_config(chunk, **config), backend=backend)


def _src_tables(case, name, n, bounds, rng, **kw):
    keep = zoo.window_keep(case, bounds) if name in SPARSE_WINDOWS else None
    return zoo.random_tables(case, n, rng, keep=keep, **kw)


def _dst_tables(case, name, n, boundary, rng, **kw):
    keep = zoo.restore_keep(case, boundary) if name in SPARSE_WINDOWS else None
    return zoo.random_tables(case, n, rng, keep=keep, **kw)


def _check_stored_chunks(engine, case, tokens, tables, bounds):
    """Every stored chunk holds exactly the reference rows, no more (no padding, no pages)."""
    masks = zoo.store_masks(case, tables, bounds)
    chunks = engine.chunks(tokens, include_partial=True)[: len(bounds)]
    assert zoo.stored_masks(engine, chunks) == [m or None for m in masks]
    for chunk, (s, e), m in zip(chunks, bounds, masks):
        if not m:
            continue
        # a hybrid layout's chunk is a prefix part plus window pieces (kvconnect/restore/parts.py):
        # merged, they must be exactly the reference chunk
        start, end, mask, rows, data = zoo.export_logical_chunk(engine, chunk)
        plane_rows, payload = zoo.expected_chunk(case, tables, s, e)
        assert (start, end, mask) == (s, e, m)
        assert list(rows) == plane_rows
        assert data == payload
    return masks


@pytest.mark.parametrize("name,chunk", ZOO_CHUNKS)
def test_roundtrip_cpu_and_torch(name, chunk, rng):
    """Store with both backends (identical chunks), retrieve with both (identical, exact)."""
    case = zoo.build(name, max_tokens=2 * chunk + chunk // 2 + 3, seed=len(name) + chunk)
    n = 2 * chunk + chunk // 2 + 3
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = _src_tables(case, name, n, bounds, rng)
    src_before = case.snapshot()

    engines = {backend: _engine(case, chunk, backend) for backend in ("cpu", "torch")}
    for engine in engines.values():
        assert engine.store(tokens, src_tables) == 2 * chunk
    assert case.same_bytes(src_before), "store wrote into the engine's memory"
    masks = _check_stored_chunks(engines["cpu"], case, tokens, src_tables, bounds)
    for c in engines["cpu"].chunks(tokens, include_partial=False):
        assert engines["cpu"].storage.export_chunk(c.key) == engines["torch"].storage.export_chunk(c.key)

    boundary = zoo.expected_boundary(case, bounds, masks)
    assert boundary == 2 * chunk
    for backend, fill in (("cpu", 0), ("torch", 0), ("cpu", 0xC3)):
        dst = case.clone(fill=fill)
        dst_engine = _engine(dst, chunk, backend)
        assert zoo.transplant(engines["cpu"], dst_engine, tokens) == 2
        assert dst_engine.lookup(tokens) == boundary
        dst_tables = _dst_tables(case, name, n, boundary, rng)
        expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, boundary)
        assert dst_engine.retrieve(tokens, dst_tables) == boundary
        assert dst.first_difference(expected) is None, f"{backend} retrieve into fill {fill:#x}"
        assert dst_engine.pool.stats().extra["pinned"] == 0


PARTIAL_CASES = ["llama-flash", "dsv3-mla-ascend", "dsv32-ascend", "dsv4-flash", "gemma3-swa", "state-hybrid", "vllm-cpu", "dsv3-mla-dcp"]


@pytest.mark.parametrize("save_unfull", [False, True])
@pytest.mark.parametrize("name", PARTIAL_CASES)
def test_partial_last_chunk(name, save_unfull, rng):
    """k chunks + r tokens: the tail is stored only with save_unfull_chunk; hits never exceed
    what was stored, and page/state groups never restore to a boundary inside a page."""
    chunk = zoo.ZOO[name][1][0]
    n = 2 * chunk + (40 if chunk > 40 else 24)  # a tail inside a page, but a multiple of cr 4 and of 8
    case = zoo.build(name, max_tokens=n, seed=7)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, save_unfull)
    src_tables = _src_tables(case, name, n, bounds, rng)
    engine = _engine(case, chunk, save_unfull_chunk=save_unfull)
    assert engine.store(tokens, src_tables) == (n if save_unfull else 2 * chunk)
    masks = _check_stored_chunks(engine, case, tokens, src_tables, bounds)

    boundary = zoo.expected_boundary(case, bounds, masks)
    page_like = any(case.is_page(g) for g in range(len(case.groups)))
    assert boundary == (2 * chunk if (page_like or not save_unfull) else n)
    assert engine.lookup(tokens) == boundary
    # a longer prompt sharing the stored prefix never reports more than was stored
    longer = np.concatenate([tokens, zoo.random_tokens(rng, chunk)])
    assert engine.lookup(longer) == 2 * chunk
    # a shorter prompt ending inside the stored tail cannot use it
    assert engine.lookup(tokens[: n - 1]) == 2 * chunk

    dst = case.clone(fill=0)
    dst_engine = _engine(dst, chunk, save_unfull_chunk=save_unfull)
    zoo.transplant(engine, dst_engine, tokens)
    dst_tables = _dst_tables(case, name, n, boundary, rng)
    expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, boundary)
    assert dst_engine.retrieve(tokens, dst_tables) == boundary
    assert dst.first_difference(expected) is None


MASK_CASES = ["llama-hnd", "dsv32", "dsv4-flash", "gemma3-swa", "dsv3-mla-dcp"]


@pytest.mark.parametrize("name", MASK_CASES)
def test_retrieve_with_mask_skips_prefix(name, rng):
    """retrieve(mask=False*C + True*...) leaves the engine's first chunk alone and loads the rest."""
    chunk = zoo.ZOO[name][1][0]
    n = 3 * chunk
    case = zoo.build(name, max_tokens=n, seed=3)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = _src_tables(case, name, n, bounds, rng)
    engine = _engine(case, chunk)
    assert engine.store(tokens, src_tables) == n

    dst = case.clone(fill=0x5A)  # the engine's own prefix: must survive
    dst_engine = _engine(dst, chunk)
    zoo.transplant(engine, dst_engine, tokens)
    dst_tables = _dst_tables(case, name, n, n, rng)
    mask = np.ones(n, bool)
    mask[:chunk] = False
    expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, n, skip=chunk)
    assert dst_engine.retrieve(tokens, dst_tables, mask=mask) == n - chunk
    assert dst.first_difference(expected) is None
    # everything masked: nothing to load, nothing written
    assert dst_engine.retrieve(tokens, dst_tables, mask=np.zeros(n, bool)) == 0
    assert dst.first_difference(expected) is None


@pytest.mark.parametrize("name", MASK_CASES)
def test_store_with_mask_then_masked_retrieve(name, rng):
    """store(mask) skips the prefix chunks: a cold lookup misses, a retrieve whose mask says
    the engine holds that prefix loads the remainder."""
    chunk = zoo.ZOO[name][1][0]
    n = 3 * chunk
    case = zoo.build(name, max_tokens=n, seed=4)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = _src_tables(case, name, n, bounds, rng)
    mask = np.ones(n, bool)
    mask[:chunk] = False
    engine = _engine(case, chunk)
    assert engine.store(tokens, src_tables, mask=mask) == n - chunk
    keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
    assert engine.storage.masks(keys)[0] is None and None not in engine.storage.masks(keys)[1:]
    assert engine.lookup(tokens) == 0

    masks = [None] + zoo.store_masks(case, src_tables, bounds[1:])
    boundary = zoo.expected_boundary(case, bounds, masks, present_below=chunk)
    assert boundary == n
    dst = case.clone(fill=0)
    dst_engine = _engine(dst, chunk)
    zoo.transplant(engine, dst_engine, tokens)
    dst_tables = _dst_tables(case, name, n, n, rng)
    expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, n, skip=chunk)
    assert dst_engine.retrieve(tokens, dst_tables, mask=mask) == n - chunk
    assert dst.first_difference(expected) is None
    # without the mask the engine would need chunk 0: nothing is loaded
    before = dst.snapshot()
    assert dst_engine.retrieve(tokens, dst_tables) == 0
    assert dst.same_bytes(before)


@pytest.mark.parametrize("name", ["llama-flash", "dsv3-mla-ascend", "dsv4-flash-packed", "gemma3-swa", "vllm-cpu"])
def test_same_engine_other_blocks(name, rng):
    """One engine, one pool: store from some blocks, retrieve into disjoint blocks of the same memory."""
    chunk = zoo.ZOO[name][1][0]
    n = 2 * chunk
    case = zoo.build(name, max_tokens=n, seed=5)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = _src_tables(case, name, n, bounds, rng)
    dst_tables = _dst_tables(case, name, n, n, rng, avoid=src_tables)
    engine = _engine(case, chunk)
    assert engine.store(tokens, src_tables) == n
    src_copy = case.clone()
    expected = zoo.expected_restore(src_copy, case.clone(), src_tables, dst_tables, n)
    assert engine.retrieve(tokens, dst_tables) == n
    assert case.first_difference(expected) is None
    # storing again is a no-op (already stored), and does not touch the memory
    assert engine.store(tokens, src_tables) == n
    assert engine.stats.stored_chunks == 2 and engine.stats.skipped_chunks == 2
    assert case.first_difference(expected) is None


@pytest.mark.parametrize(
    "name,src_kw,dst_kw,chunk",
    [
        ("dsv3-mla", dict(block_size=128), dict(block_size=32), 256),
        ("dsv32", dict(block_size=128), dict(block_size=32), 256),
        ("dsv4-flash", dict(c4_block_size=256), dict(c4_block_size=128), 256),
        ("gemma3-swa", dict(block_size=32), dict(block_size=16), 64),
        ("llama-hnd", dict(block_size=16), dict(block_size=32), 64),
    ],
)
def test_reuse_across_block_sizes(name, src_kw, dst_kw, chunk, rng):
    """Seed 001: a chunk stored by a deployment with block size 128 is read by one with 32."""
    n = 2 * chunk + 8
    src = zoo.build(name, max_tokens=n, seed=11, **src_kw)
    dst = zoo.build(name, max_tokens=n, seed=12, **dst_kw).clone(fill=0)
    assert src.layout().fingerprint == dst.layout().fingerprint
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = _src_tables(src, name, n, bounds, rng)
    engine = _engine(src, chunk)
    assert engine.store(tokens, src_tables) == 2 * chunk
    dst_engine = _engine(dst, chunk)
    assert [c.key for c in dst_engine.chunks(tokens, include_partial=False)] == [
        c.key for c in engine.chunks(tokens, include_partial=False)
    ]
    zoo.transplant(engine, dst_engine, tokens)
    assert dst_engine.lookup(tokens) == 2 * chunk
    dst_tables = _dst_tables(dst, name, n, 2 * chunk, rng)
    expected = zoo.expected_restore(src, dst.clone(), src_tables, dst_tables, 2 * chunk)
    assert dst_engine.retrieve(tokens, dst_tables) == 2 * chunk
    assert dst.first_difference(expected) is None


@pytest.mark.parametrize("direction", ["padded->packed", "packed->padded"])
def test_dsv4_packed_and_padded_share_chunks(direction, rng):
    """Seed 002: a per-block packed allocation and per-layer padded pools are one identity."""
    chunk, n = 256, 512
    padded = zoo.build("dsv4-flash", max_tokens=n, seed=21)
    packed = zoo.build("dsv4-flash-packed", max_tokens=n, seed=22)
    assert padded.layout().fingerprint == packed.layout().fingerprint
    src, dst = (padded, packed) if direction == "padded->packed" else (packed, padded)
    src_name = "dsv4-flash"  # both use sparse windowed tables
    dst = dst.clone(fill=0)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = _src_tables(src, src_name, n, bounds, rng)
    engine = _engine(src, chunk)
    assert engine.store(tokens, src_tables) == n
    dst_engine = _engine(dst, chunk)
    assert zoo.transplant(engine, dst_engine, tokens) == 2
    dst_tables = _dst_tables(dst, src_name, n, n, rng)
    expected = zoo.expected_restore(src, dst.clone(), src_tables, dst_tables, n)
    assert dst_engine.retrieve(tokens, dst_tables) == n
    assert dst.first_difference(expected) is None


def test_shared_prefix_prompts(rng):
    """Prompts sharing a prefix share chunks: a second prompt stores only its new chunks and
    the common prefix is restorable for a third prompt that diverges later."""
    chunk, name = 64, "gemma3-swa"
    case = zoo.build(name, max_tokens=4 * chunk, seed=9)
    engine = _engine(case, chunk)
    base = zoo.random_tokens(rng, 2 * chunk)
    a = np.concatenate([base, zoo.random_tokens(rng, 2 * chunk)])
    b = np.concatenate([base, zoo.random_tokens(rng, 2 * chunk)])
    assert engine.store(a, zoo.random_tables(case, len(a), rng)) == 4 * chunk
    assert engine.stats.stored_chunks == 4
    assert engine.store(b, zoo.random_tables(case, len(b), rng)) == 4 * chunk
    assert engine.stats.stored_chunks == 6  # the 2 shared chunks were not stored twice
    c = np.concatenate([base, zoo.random_tokens(rng, 3 * chunk)])
    assert engine.lookup(c) == 2 * chunk
    assert engine.lookup(a) == engine.lookup(b) == 4 * chunk


@pytest.mark.parametrize("name", MASK_CASES)
def test_retrieve_with_mask_ending_inside_a_chunk(name, rng):
    """An engine prefix hit that ends inside a chunk (block-aligned, not chunk-aligned): the
    straddling chunk is loaded only for tokens past the mask; the engine's rows survive."""
    chunk = zoo.ZOO[name][1][0]
    n, skip = 3 * chunk, chunk + chunk // 2
    case = zoo.build(name, max_tokens=n, seed=4)
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chunk, False)
    src_tables = _src_tables(case, name, n, bounds, rng)
    engine = _engine(case, chunk)
    assert engine.store(tokens, src_tables) == n

    dst = case.clone(fill=0x5A)
    dst_engine = _engine(dst, chunk)
    zoo.transplant(engine, dst_engine, tokens)
    dst_tables = _dst_tables(case, name, n, n, rng)
    mask = np.ones(n, bool)
    mask[:skip] = False
    expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, n, skip=skip)
    assert dst_engine.retrieve(tokens, dst_tables, mask=mask) == n - skip
    assert dst.first_difference(expected) is None
    with pytest.raises(TokenError):  # a store's mask stays chunk-aligned
        dst_engine.store(tokens, dst_tables, mask=mask)
