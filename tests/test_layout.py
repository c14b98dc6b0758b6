"""KVLayout.from_tensors: plane splitting, byte geometry, detection, fingerprint, errors.

Plane addresses are checked against the engine-native tensors themselves: for every plane
the address kvconnect computes for (block, row) must be the ``data_ptr`` of the engine's
own ``t[k, block, row]`` (or equivalent) view, with ``row_bytes`` contiguous bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support import zoo
from kvconnect import DCPSpec, GroupKind, GroupSpec, KVLayout, LayoutError
from kvconnect.layout.spec import RowRegions
from kvconnect.transfer.tables import plane_table

NAMES = list(zoo.ZOO)


@pytest.mark.parametrize("name", NAMES)
def test_plane_addresses_match_engine_indexing(name, rng):
    case = zoo.build(name, max_tokens=300)
    layout = case.layout()
    ref = zoo.reference_planes(case)
    assert len(layout.planes) == len(ref)
    table = plane_table(layout)
    for p, (plane, rp) in enumerate(zip(layout.planes, ref)):
        group = rp.group
        assert plane.group_index == group
        assert plane.num_blocks == case.num_blocks[group]
        assert plane.rows_per_block == case.rows_per_block(group)
        assert plane.tokens_per_row == case.tokens_per_row(group)
        assert plane.is_page == case.is_page(group)
        base, block_stride, row_stride, row_bytes, rpb, num_slots = table[p].tolist()
        assert num_slots == plane.num_blocks * plane.rows_per_block and rpb == plane.rows_per_block
        for _ in range(8):
            b, r = int(rng.integers(plane.num_blocks)), int(rng.integers(plane.rows_per_block))
            view = rp.get(torch.tensor(b), torch.tensor(r))
            assert view.is_contiguous() and view.numel() == row_bytes == plane.row_bytes
            assert base + b * block_stride + r * row_stride == view.data_ptr()


@pytest.mark.parametrize("name", ["llama-flash", "llama-flashinfer", "llama-hnd", "llama-hnd-flashinfer", "dsv3-mla", "dsv32", "dsv4-flash"])
def test_detection_without_hints(name):
    case = zoo.build(name, max_tokens=300)
    hinted, detected = case.layout(), case.layout(layout_hints=None)
    assert hinted.planes == detected.planes
    assert hinted.fingerprint == detected.fingerprint


def test_ambiguous_shape_asks_for_a_hint():
    t = torch.zeros(10, 3, 16, dtype=torch.bfloat16)  # [NB, H, D] with block 16: rows are not dim 1
    with pytest.raises(LayoutError, match="hint"):
        KVLayout.from_tensors({"l": t}, groups=[GroupSpec(block_size=16)])
    with pytest.raises(LayoutError, match="unknown layout hint"):
        KVLayout.from_tensors({"l": t}, groups=[GroupSpec(block_size=16)], layout_hints="nhd_please")


def test_padded_pages_keep_their_stride():
    """DSv4 pages are padded to 576 bytes: block stride > rows x row bytes, row bytes exact;
    the fp8 caches are split into a data and a scale sub-plane (vLLM writes them so)."""
    layout = zoo.dsv4(max_tokens=300).layout()
    by_name = {(p.layer_name, p.region_index): p for p in layout.planes}
    swa, swa_scales = by_name["layers.0.swa", 0], by_name["layers.0.swa", 1]
    assert (swa.row_bytes, swa.rows_per_block, swa.block_stride_bytes) == (576, 64, 37440)
    assert (swa_scales.row_bytes, swa_scales.row_stride_bytes, swa_scales.block_stride_bytes) == (8, 8, 37440)
    c128 = by_name["layers.2.c128", 1]
    assert (c128.row_bytes, c128.rows_per_block, c128.block_stride_bytes, c128.num_regions) == (8, 2, 1728, 2)
    idx = by_name["layers.1.c4_indexer", 0], by_name["layers.1.c4_indexer", 1]
    assert [(p.row_bytes, p.block_stride_bytes) for p in idx] == [(128, 8640), (4, 8640)]
    state = by_name["layers.1.c4_state", 0]
    assert (state.dtype, state.row_bytes, state.rows_per_block, state.block_stride_bytes) == ("float32", 8192, 4, 32768)
    assert state.num_regions == 1


def test_packed_views_share_one_block_stride():
    packed = zoo.dsv4(packed=True, max_tokens=300, max_window_blocks=8).layout()
    strides = {p.block_stride_bytes for p in packed.planes}
    # 3 SWA pages + C4 MLA + C4 indexer + 2 C4 states + C128 MLA + C128 state, each 576-aligned
    assert strides == {3 * 37440 + 37440 + 8640 + 32832 + 8640 + 1728 + 32832}
    starts = sorted(t.data_ptr() for t in packed.tensors)
    assert len(set(starts)) == len(starts)  # 15 (sub-)plane views at distinct offsets into one block
    storages = {t.untyped_storage().data_ptr() for t in packed.tensors}
    assert len(storages) == 1


def test_fingerprint_ignores_block_size_and_padding():
    base = zoo.mla(block_size=64).layout()
    assert zoo.mla(block_size=16).layout().fingerprint == base.fingerprint
    assert zoo.mla(block_size=128).layout().fingerprint == base.fingerprint
    assert zoo.dsv4(packed=True, max_window_blocks=8).layout().fingerprint == zoo.dsv4().layout().fingerprint
    assert zoo.dsv4(c4_block_size=128).layout().fingerprint == zoo.dsv4().layout().fingerprint
    # flash-attn and FlashInfer hold the same K and V rows: one identity
    assert zoo.llama("flash").layout().fingerprint == zoo.llama("flashinfer").layout().fingerprint


def test_fingerprint_covers_what_decides_the_bytes():
    base = zoo.gemma_swa().layout().fingerprint
    variants = [
        zoo.gemma_swa(window=96),
        zoo.gemma_swa(head_dim=64),
        zoo.gemma_swa(num_layers=12),
        zoo.gemma_swa(num_heads=3),
    ]
    prints = {v.layout().fingerprint for v in variants}
    assert base not in prints and len(prints) == len(variants)
    # two heads of 64 and one head of 128 are the same row bytes in an NHD row but other models' KV
    # (issue 31: equal row bytes of another head split shared chunks under one name)
    two, one = zoo.gemma_swa(num_heads=2, head_dim=64).layout(), zoo.gemma_swa(num_heads=1, head_dim=128).layout()
    assert [p.row_bytes for p in two.planes] == [p.row_bytes for p in one.planes]
    assert two.fingerprint != one.fingerprint
    case = zoo.gemma_swa()
    assert case.layout(model_name="other").fingerprint != base
    assert case.layout(tp_rank=1, tp_size=2).fingerprint != base
    assert case.layout(identity={"kv_quant": "fp8"}).fingerprint != base
    restore = [case.groups[0], GroupSpec(block_size=16, sliding_window=80, restore_window=64)]
    assert case.layout(groups=restore).fingerprint != base
    # dtype: same bytes per row, different dtype
    a = KVLayout.from_tensors({"l": torch.zeros(4, 16, 8, dtype=torch.float16)}, groups=[GroupSpec(block_size=16)])
    b = KVLayout.from_tensors({"l": torch.zeros(4, 16, 8, dtype=torch.bfloat16)}, groups=[GroupSpec(block_size=16)])
    assert a.fingerprint != b.fingerprint
    # plane order: the same two layers named in the other order
    x, y = torch.zeros(4, 16, 8, dtype=torch.uint8), torch.zeros(4, 16, 4, dtype=torch.uint8)
    g = [GroupSpec(block_size=16)]
    assert KVLayout.from_tensors({"a": x, "b": y}, groups=g).fingerprint != KVLayout.from_tensors({"a": y, "b": x}, groups=g).fingerprint


def test_tuple_planes_assigned_per_group():
    layout = zoo.tuple_split(max_tokens=300).layout()
    assert [p.group_index for p in layout.planes] == [0, 0, 1, 1] * 2
    assert [p.row_bytes for p in layout.planes[:4]] == [1024, 128, 128, 2]
    assert [p.dtype for p in layout.planes[:4]] == ["bfloat16", "bfloat16", "int8", "float16"]
    assert layout.planes_of_group(1) == [2, 3, 6, 7]
    rows = layout.describe()
    assert [r["row_bytes_per_row"] for r in rows] == [2 * 1152, 2 * 130]


def test_group_num_blocks_is_the_smallest_plane():
    small, big = torch.zeros(5, 4, 8, dtype=torch.uint8), torch.zeros(9, 4, 8, dtype=torch.uint8)
    layout = KVLayout.from_tensors({"a": big, "b": small}, groups=[GroupSpec(block_size=4)])
    assert layout.group_num_blocks(0) == 5


def test_page_plane_geometry():
    case = zoo.vllm_cpu(max_tokens=300)
    layout = case.layout()
    p = layout.planes[0]
    assert p.is_page and p.rows_per_block == 1 and p.tokens_per_row == 16
    assert p.row_bytes == 2 * 16 * 2 * 16 * 2  # H * BS * 2D * bf16
    state = zoo.state_hybrid(max_tokens=300).layout()
    assert [q.is_page for q in state.planes] == [False, False, True, True, True, True]
    assert [q.row_bytes for q in state.planes[2:4]] == [3 * 32 * 4, 4 * 16 * 16 * 4]


# ---------------------------------------------------------------------------------------
# inconsistent specs -> LayoutError naming the culprit


def _mla(nb=8, bs=16):
    return torch.zeros(nb, bs, 8, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=16, compress_ratio=0), "compress_ratio"),
        (dict(block_size=16, compress_ratio=3), "multiple of compress_ratio"),
        (dict(block_size=16, sliding_window=0), "sliding_window"),
        (dict(block_size=16, restore_window=8), "restore_window needs a sliding_window"),
        (dict(block_size=16, sliding_window=8, kind=GroupKind.STATE), "STATE"),
        (dict(block_size=16.0), "block_size"),
    ],
)
def test_group_spec_validation(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        GroupSpec(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(rank=2, size=2), dict(rank=-1, size=2), dict(size=0), dict(size=2, interleave_tokens=0)])
def test_dcp_spec_validation(kwargs):
    with pytest.raises(LayoutError):
        DCPSpec(**kwargs)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: KVLayout.from_tensors({"l": _mla()}, groups=[]), "at least one GroupSpec"),
        (lambda: KVLayout.from_tensors({"l": _mla()}, groups=[GroupSpec(block_size=16)] * 2), "no layer_groups"),
        (lambda: KVLayout.from_tensors({"l": _mla(), "m": _mla()}, groups=[GroupSpec(block_size=16)], layer_groups={"l": 0}), "without a group"),
        (lambda: KVLayout.from_tensors({"l": _mla()}, groups=[GroupSpec(block_size=16)], layer_groups={"l": 1}), "group index"),
        (lambda: KVLayout.from_tensors({"l": (_mla(), _mla())}, groups=[GroupSpec(block_size=16)], layer_groups={"l": (0,)}), "2 tensors but 1 group"),
        (lambda: KVLayout.from_tensors({"l": _mla(bs=16)}, groups=[GroupSpec(block_size=32)], layout_hints="blocks_first"), "rows per block"),
        (lambda: KVLayout.from_tensors({"l": _mla(bs=16)}, groups=[GroupSpec(block_size=64, compress_ratio=2)]), "rows per block"),
        (lambda: KVLayout.from_tensors({"l": _mla().transpose(1, 2)}, groups=[GroupSpec(block_size=8)], layout_hints="blocks_first"), "not contiguous"),
        (lambda: KVLayout.from_tensors({"l": np.zeros((8, 16, 8))}, groups=[GroupSpec(block_size=16)]), "torch.Tensor"),
        (lambda: KVLayout.from_tensors({"l": _mla()}, groups=[GroupSpec(block_size=16)], tp_rank=1, tp_size=1), "TP rank"),
        (lambda: KVLayout.from_tensors({}, groups=[GroupSpec(block_size=16)]), "at least one plane"),
        (
            lambda: KVLayout.from_tensors(
                {"l": _mla(), "p": _mla()}, groups=[GroupSpec(block_size=16)], layout_hints={"l": "blocks_first", "p": "page"}
            ),
            "mixes page planes",
        ),
        (
            lambda: KVLayout.from_tensors({"l": _mla(), "m": _mla()}, groups=[GroupSpec(block_size=16)] * 2, layer_groups={"l": 0, "m": 0}),
            "group 1 .* has no planes",
        ),
        (
            lambda: KVLayout.from_tensors({"p": _mla()}, groups=[GroupSpec(block_size=16)], layout_hints="page", dcp=DCPSpec(rank=0, size=2)),
            "decode context parallel",
        ),
    ],
)
def test_inconsistent_layouts_raise(build, match):
    with pytest.raises(LayoutError, match=match):
        build()


# --- sub-planes: blocks the engine writes as separate regions (spec.RowRegions) --------------


def _split_cache(num_blocks=6, rows=64, row=584, page=37440, seed=3):
    backing = torch.randint(0, 256, (num_blocks * page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return backing, torch.as_strided(backing, (num_blocks, rows, row), (page, row, 1))


def test_sub_planes_address_each_region_as_the_engine_writes_it():
    """Field k of row r of block b lies at ``b * page + rows * sum(regions[:k]) + r * regions[k]``."""
    backing, t = _split_cache()
    layout = KVLayout.from_tensors({"swa": t}, groups=[GroupSpec(block_size=64, sliding_window=128)],
                                   row_regions={"swa": RowRegions(region_bytes=(576, 8))})
    assert [(p.row_bytes, p.row_stride_bytes, p.block_stride_bytes, p.region_index, p.num_regions, p.dtype)
            for p in layout.planes] == [(576, 576, 37440, 0, 2, "uint8"), (8, 8, 37440, 1, 2, "uint8")]
    table = plane_table(layout)
    for b, r in [(0, 0), (2, 1), (5, 63)]:
        data = table[0, 0] + b * table[0, 1] + r * table[0, 2]
        scale = table[1, 0] + b * table[1, 1] + r * table[1, 2]
        assert data - backing.data_ptr() == b * 37440 + r * 576
        assert scale - backing.data_ptr() == b * 37440 + 64 * 576 + r * 8
    assert RowRegions(region_bytes=(576, 8)).region_offsets_bytes(64) == (0, 36864)


def test_split_fingerprint_differs_from_whole_rows():
    _, t = _split_cache()
    groups = [GroupSpec(block_size=64, sliding_window=128)]
    whole = KVLayout.from_tensors({"swa": t}, groups=groups)
    split = KVLayout.from_tensors({"swa": t}, groups=groups, row_regions={"swa": RowRegions(region_bytes=(576, 8))})
    other = KVLayout.from_tensors({"swa": t}, groups=groups, row_regions={"swa": RowRegions(region_bytes=(512, 72))})
    assert len({whole.fingerprint, split.fingerprint, other.fingerprint}) == 3


@pytest.mark.parametrize("regions, tensor, match", [
    ((576, 8), lambda: _split_cache()[1][:, :, :576], "cannot hold the regions"),
    ((576, 8), lambda: torch.as_strided(_split_cache()[0], (6, 64, 584), (37440, 585, 1)), "must be one tight run"),
    ((576, 8), lambda: torch.as_strided(_split_cache(page=40000)[0], (6, 64, 584), (30000, 584, 1)), "blocks overlap"),
    ((576,), lambda: _split_cache()[1], "at least two regions"),
    ((576, 0), lambda: _split_cache()[1], "positive byte count"),
])
def test_bad_regions_raise(regions, tensor, match):
    with pytest.raises(LayoutError, match=match):
        KVLayout.from_tensors({"l": tensor()}, groups=[GroupSpec(block_size=64)],
                              row_regions={"l": RowRegions(region_bytes=regions)})


def test_regions_on_page_planes_and_bad_assignments_raise():
    _, t = _split_cache()
    with pytest.raises(LayoutError, match="page plane"):
        KVLayout.from_tensors({"l": t}, groups=[GroupSpec(block_size=64)], layout_hints="page",
                              row_regions={"l": RowRegions(region_bytes=(576, 8))})
    with pytest.raises(LayoutError, match="one RowRegions or None per tensor"):
        KVLayout.from_tensors({"l": (t, t)}, groups=[GroupSpec(block_size=64)],
                              row_regions={"l": (RowRegions(region_bytes=(576, 8)),)})


def test_row_regions_follow_the_views_that_are_kept_when_an_alias_is_dropped():
    """Regions are given per registered tensor; an aliased view dropped (stored once) drops its
    entry too, so the kept view keeps its own regions whatever the order."""
    _, t = _split_cache()
    alias = t.view(torch.uint8)  # the same bytes again, e.g. a second dtype view of the blob
    regions = RowRegions(region_bytes=(576, 8))
    for value, given in (((t, alias), (regions, None)), ((alias, t), (regions, regions))):
        layout = KVLayout.from_tensors({"swa": value}, groups=[GroupSpec(block_size=64, sliding_window=128)],
                                       row_regions={"swa": given})
        assert [(p.row_bytes, p.region_index) for p in layout.planes] == [(576, 0), (8, 1)]
    with pytest.raises(LayoutError, match="one RowRegions or None per tensor"):
        KVLayout.from_tensors({"swa": (t, alias)}, groups=[GroupSpec(block_size=64, sliding_window=128)],
                              row_regions={"swa": (regions,)})
