"""Every bad input raises its typed error before anything moves: the engine's memory, the
pool's entries and their bytes are exactly as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support import zoo
from kvconnect import BlockTableError, DCPSpec, GroupSpec, KVCacheEngine, LayoutError, TokenError, TransferError

CHUNK = 64
N = 3 * CHUNK


class World:
    """A Gemma-like hybrid engine whose pool holds one prompt, and a fresh destination cache."""

    def __init__(self, rng):
        self.case = zoo.gemma_swa(max_tokens=2 * N)
        self.tokens = zoo.random_tokens(rng, N)
        self.tables = zoo.random_tables(self.case, N, rng)
        self.engine = KVCacheEngine(self.case.layout(), zoo.small_config(CHUNK))
        assert self.engine.store(self.tokens, self.tables) == N
        self.other_tokens = zoo.random_tokens(rng, N)
        self.keys = [c.key for c in self.engine.chunks(self.tokens, include_partial=True)]
        self.dst_tables = zoo.random_tables(self.case, N, rng, avoid=self.tables)
        self.snap = self.snapshot()

    def snapshot(self):
        pool = self.engine.pool
        stats = pool.stats()
        return (
            self.case.snapshot(), len(pool), stats.used_slots, stats.extra["pinned"], stats.commits,
            [self.engine.storage.export_chunk(k) for k in self.keys],
        )

    def assert_unchanged(self):
        cache, *rest = self.snapshot()
        assert self.case.first_difference(self.snap[0]) is None, "engine memory changed"
        assert rest == list(self.snap[1:]), "pool changed"


@pytest.fixture
def world(rng):
    return World(rng)


def _bad_block_ids(w: World):
    nb_full, nb_swa = w.case.num_blocks
    full, swa = w.dst_tables
    return {
        "id out of range (full group)": [full[:-1] + [nb_full], swa],
        "id out of range (window group)": [full, [nb_swa + 5] + swa[1:]],
        "too few ids": [full[:5], swa],
        "too few ids (window group)": [full, swa[:3]],
        "one group for two": [full],
        "three groups for two": [full, swa, swa],
        "not a list": 42,
        "2-D ids": [np.array([full, full]), swa],
        "float ids": [np.array(full, dtype=np.float64), swa],
    }


@pytest.mark.parametrize("op", ["store", "retrieve"])
def test_bad_block_ids(world, op):
    fn = getattr(world.engine, op)
    tokens = world.other_tokens if op == "store" else world.tokens
    for what, ids in _bad_block_ids(world).items():
        with pytest.raises(BlockTableError):
            fn(tokens, ids)
        world.assert_unchanged()


def test_absent_block_where_a_restore_needs_it(world):
    """-1 is fine outside the window, an error inside it (and in a full group)."""
    full, swa = world.dst_tables
    for ids in ([full[:3] + [-1] + full[4:], swa], [full, swa[:-1] + [-1]]):
        with pytest.raises(BlockTableError, match="absent"):
            world.engine.retrieve(world.tokens, ids)
        world.assert_unchanged()
    outside = [full, [-1] * 6 + swa[6:]]  # tokens [0, 96) lie outside the last window [112, 192)
    assert world.engine.retrieve(world.tokens, outside) == N


@pytest.mark.parametrize("form", ["list", "numpy", "torch"])
@pytest.mark.parametrize("op", ["store", "retrieve"])
def test_a_flat_block_id_list_is_refused_for_a_multi_group_layout(world, op, form):
    """One flat list (not one per group) cannot say which ids are whose: a typed error naming the
    groups, before anything moves, whether its length matches the groups or not."""
    full, _ = world.dst_tables
    tokens = world.other_tokens if op == "store" else world.tokens
    for flat in (full, full[:2]):  # 2 ids for 2 groups once read as two groups' one block each
        ids = {"list": flat, "numpy": np.array(flat), "torch": torch.tensor(flat)}[form]
        with pytest.raises(BlockTableError, match="one flat sequence of .* 2 KV-cache groups: pass one sequence per group"):
            getattr(world.engine, op)(tokens, ids)
        world.assert_unchanged()


def test_a_flat_block_id_list_is_the_one_group_of_a_one_group_layout(rng):
    case = zoo.build("llama-flash", max_tokens=N)
    engine = KVCacheEngine(case.layout(), zoo.small_config(CHUNK))
    tokens = zoo.random_tokens(rng, N)
    (ids,) = zoo.random_tables(case, N, rng)
    try:
        assert engine.store(tokens, ids) == N  # the same as [ids]
        assert engine.lookup(tokens) == N
    finally:
        engine.close()


def test_all_absent_block_ids_store_nothing_and_say_so(world, rng, caplog):
    """-1 everywhere: the store writes nothing and a WARNING says why (not a silent 0)."""
    caplog.set_level("WARNING", logger="kvconnect")
    full, swa = world.tables
    fresh = zoo.random_tokens(rng, N)
    assert world.engine.store(fresh, [[-1] * len(full), [-1] * len(swa)]) == 0
    world.assert_unchanged()
    (warned,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "all -1 (absent) in every group: nothing written" in warned
    caplog.clear()
    assert world.engine.store(fresh, [full, [-1] * 4 + swa[4:]]) == N  # some absent (outside the window): no word
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_store_checks_every_chunk_before_writing(world, rng):
    """Ids for the first chunk only: the whole call fails, even chunk 0 is not stored."""
    fresh = zoo.random_tokens(rng, N)
    full, swa = world.tables
    with pytest.raises(BlockTableError):
        world.engine.store(fresh, [full[:4], swa[:4]])
    world.assert_unchanged()
    keys = [c.key for c in world.engine.chunks(fresh, include_partial=False)]
    assert world.engine.storage.masks(keys) == [None] * 3


BAD_TOKENS = {
    "float": np.linspace(0, 1, N),
    "2-D": np.zeros((2, N // 2), np.int64),
    "negative": np.full(N, -3),
    "bool tensor": torch.ones(N, dtype=torch.bool),
    "float tensor": torch.zeros(N),
    "strings": ["x"] * N,
}


@pytest.mark.parametrize("what", sorted(BAD_TOKENS))
def test_bad_tokens(world, what):
    tokens = BAD_TOKENS[what]
    for call in (
        lambda: world.engine.store(tokens, world.tables),
        lambda: world.engine.retrieve(tokens, world.dst_tables),
        lambda: world.engine.lookup(tokens),
    ):
        with pytest.raises(TokenError):
            call()
        world.assert_unchanged()


def _bad_masks():
    ok = np.ones(N, bool)
    holes = ok.copy()
    holes[CHUNK + 3] = False
    unaligned = ok.copy()
    unaligned[: CHUNK // 2] = False
    late_false = ok.copy()
    late_false[-1] = False
    return {
        "short": ok[:-1],
        "long": np.ones(N + 1, bool),
        "ints": ok.astype(np.int64),
        "2-D": ok.reshape(3, -1),
        "True then False": late_false,
        "hole": holes,
        "prefix not a chunk multiple": unaligned,
        "torch uint8": torch.ones(N, dtype=torch.uint8),
    }


# retrieve accepts a prefix ending inside a chunk (tested in test_engine_roundtrip.py)
_MASK_CASES = [(op, what) for op in ("store", "retrieve") for what in sorted(_bad_masks())
               if not (op == "retrieve" and what == "prefix not a chunk multiple")]


@pytest.mark.parametrize("op,what", _MASK_CASES)
def test_bad_masks(world, op, what):
    mask = _bad_masks()[what]
    tables = world.tables if op == "store" else world.dst_tables
    tokens = world.other_tokens if op == "store" else world.tokens
    with pytest.raises(TokenError):
        getattr(world.engine, op)(tokens, tables, mask=mask)
    world.assert_unchanged()


# ---------------------------------------------------------------------------------------
# layouts and configs the engine refuses at construction


@pytest.mark.parametrize(
    "name,chunk,match",
    [
        ("dsv4-flash", 64, "group 2.s compress ratio 128"),  # C128 needs chunks of whole rows
        ("dsv4-flash", 258, "group 1.s compress ratio 4"),
        ("vllm-cpu", 40, "block size"),  # an opaque page holds 16 tokens
        ("dsv3-mla-dcp", 8, "DCP period 16"),
    ],
)
def test_chunk_size_the_layout_cannot_hold(name, chunk, match):
    case = zoo.build(name, max_tokens=300)
    with pytest.raises(LayoutError, match=match):
        KVCacheEngine(case.layout(), zoo.small_config(chunk))


def test_rows_per_block_mismatch():
    case = zoo.mla(max_tokens=300, block_size=64)
    with pytest.raises(LayoutError, match="rows per block"):
        case.layout(groups=[GroupSpec(block_size=32)])
    with pytest.raises(LayoutError, match="rows per block"):
        zoo.dsv4(max_tokens=300).layout(groups=[g if i != 1 else GroupSpec(block_size=256, compress_ratio=8)
                                               for i, g in enumerate(zoo.dsv4(max_tokens=300).groups)])


def test_unknown_backend():
    case = zoo.mla(max_tokens=300)
    with pytest.raises(TransferError):
        KVCacheEngine(case.layout(), zoo.small_config(64), backend="gpu")


def test_dcp_with_page_planes():
    case = zoo.vllm_cpu(max_tokens=300)
    with pytest.raises(LayoutError):
        case.layout(dcp=DCPSpec(rank=0, size=2))
