"""Model-zoo paged KV layouts on CPU, and an independent reference of the restore rules.

Every builder returns a ``ZooCase`` whose ``kv_caches``, ``groups``, ``layer_groups`` and
``hints`` go straight into ``KVLayout.from_tensors`` (``case.layout()`` does that). All bytes
live in a few flat ``uint8`` backing buffers (``case.backings``) so a test can compare the
*whole* memory of a cache, padding and unused blocks included, before and after a call.

The reference half of this module (``local_tokens``, ``needed_rows``, ``store_masks``,
``expected_boundary``, ``expected_restore``) re-derives the rules of the issue from scratch
with brute force and engine-native indexing (``t[:, block, row]`` for a flash-attn tensor),
so it shares no code with kvconnect's planner or plane splitter.

Builders (small sizes, real row widths; ``ZOO`` names them with the chunk sizes they allow):
llama (flash-attn, FlashInfer, HND), mla / mla_ascend (DeepSeek-V3), dsv32 / dsv32_ascend,
dsv4 (seven caches, padded or packed per block), gemma_swa, state_hybrid, vllm_cpu (page
plane), mla(dcp=...) and mla_swa(dcp=...) (decode-context-parallel shards).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import dsv4_cache  # noqa: E402  (the DeepSeek-V4 cache table lives with the demo)

from kvconnect import Config, DCPSpec, GroupKind, GroupSpec, KVLayout  # noqa: E402
from kvconnect.layout.spec import RowRegions  # noqa: E402


@dataclass(frozen=True)
class Elem:
    """One tensor of a layer: a strided view (in elements of ``dtype``) into a backing buffer."""

    backing: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int
    index: str  # key of SUBPLANES: how the engine addresses (block, row) in this tensor
    group: int
    regions: tuple = ()  # bytes per row of each region when the engine writes a block split


def _contig_stride(shape: Sequence[int]) -> tuple:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass
class ZooCase:
    name: str
    groups: list
    layer_groups: dict
    hints: Optional[Union[str, dict]]
    layers: dict  # layer name -> (is_tuple, [Elem, ...])
    backings: list  # flat uint8 tensors
    num_blocks: list  # per group
    page_groups: frozenset = frozenset()
    dcp: DCPSpec = DCPSpec()
    model_name: str = "zoo"
    shared_pool: bool = False  # all groups draw block ids from one pool (packed layout)
    tied_groups: dict = field(default_factory=dict)  # group -> group whose block ids it reuses
    kv_caches: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.kv_caches = self._views(self.backings)

    def _views(self, backings) -> dict:
        view = lambda e: torch.as_strided(backings[e.backing].view(e.dtype), e.shape, e.stride, e.offset)  # noqa: E731
        return {n: tuple(map(view, es)) if tup else view(es[0]) for n, (tup, es) in self.layers.items()}

    # -- construction ------------------------------------------------------------------
    def clone(self, fill: Optional[int] = None) -> "ZooCase":
        """Same structure; bytes copied (fill None) or set to ``fill`` everywhere."""
        backings = [b.clone() if fill is None else torch.full_like(b, fill) for b in self.backings]
        return replace(self, backings=backings)

    def randomize(self, seed: int) -> "ZooCase":
        gen = torch.Generator().manual_seed(seed)
        for b in self.backings:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
        return self

    def row_regions(self) -> dict:
        """``row_regions`` for KVLayout: the layers whose engine writes blocks split into regions."""
        out = {}
        for name, (tup, es) in self.layers.items():
            if any(e.regions for e in es):
                regions = [RowRegions(region_bytes=e.regions) if e.regions else None for e in es]
                out[name] = tuple(regions) if tup else regions[0]
        return out

    def layout(self, **overrides) -> KVLayout:
        kwargs = dict(groups=self.groups, layer_groups=self.layer_groups, layout_hints=self.hints,
                      model_name=self.model_name, dcp=self.dcp, row_regions=self.row_regions())
        return KVLayout.from_tensors(self.kv_caches, **{**kwargs, **overrides})

    def snapshot(self) -> list:
        return [b.clone() for b in self.backings]

    def same_bytes(self, other: Union["ZooCase", list]) -> bool:
        theirs = other.backings if isinstance(other, ZooCase) else other
        return all(torch.equal(a, b) for a, b in zip(self.backings, theirs))

    def first_difference(self, other: Union["ZooCase", list]) -> Optional[str]:
        theirs = other.backings if isinstance(other, ZooCase) else other
        for i, (a, b) in enumerate(zip(self.backings, theirs)):
            diff = (a != b).nonzero()
            if len(diff):
                return f"backing {i}: {len(diff)} bytes differ, first at byte {int(diff[0])}"
        return None

    # -- geometry (independent of kvconnect) --------------------------------------------
    def is_page(self, g: int) -> bool:
        return g in self.page_groups or self.groups[g].kind is GroupKind.STATE

    def tokens_per_row(self, g: int) -> int:
        return self.groups[g].block_size if self.is_page(g) else self.groups[g].compress_ratio

    def rows_per_block(self, g: int) -> int:
        return 1 if self.is_page(g) else self.groups[g].block_size // self.groups[g].compress_ratio

    def window(self, g: int) -> Optional[int]:
        spec = self.groups[g]
        if spec.kind is GroupKind.STATE:
            return spec.block_size
        return spec.sliding_window if spec.restore_window is None else spec.restore_window

    def blocks_for(self, g: int, num_tokens: int) -> int:
        return -(-local_tokens(self.dcp, num_tokens) // self.groups[g].block_size)

    def tensor(self, name: str, i: int) -> torch.Tensor:
        value = self.kv_caches[name]
        return value[i] if isinstance(value, tuple) else value


# ---------------------------------------------------------------------------------------
# builders


class CaseBuilder:
    """Accumulates layers whose tensors are views into zeroed backing buffers."""

    def __init__(self) -> None:
        self.layers: dict = {}
        self.sizes: list[int] = []

    def backing(self, nbytes: int) -> int:
        self.sizes.append(_align(nbytes, 8))
        return len(self.sizes) - 1

    def tight(self, dtype, shape, index="blocks_first", group=0, regions=()) -> Elem:
        """A contiguous tensor with its own backing."""
        b = self.backing(math.prod(shape) * _nbytes(dtype))
        return Elem(b, dtype, tuple(shape), _contig_stride(shape), 0, index, group, tuple(regions))

    def padded(self, dtype, num_blocks, rows, row_bytes, stride_bytes, group, backing=None, offset_bytes=0,
               regions=()) -> Elem:
        """[NB, rows, row] whose blocks are ``stride_bytes`` apart (>= rows * row bytes)."""
        elem = _nbytes(dtype)
        backing = self.backing(num_blocks * stride_bytes) if backing is None else backing
        shape, stride = (num_blocks, rows, row_bytes // elem), (stride_bytes // elem, row_bytes // elem, 1)
        return Elem(backing, dtype, shape, stride, offset_bytes // elem, "blocks_first", group, tuple(regions))

    def add(self, name, *elems, as_tuple=False) -> None:
        self.layers[name] = (as_tuple, list(elems))

    def case(self, name, groups, *, seed=0, **kw) -> ZooCase:
        backings = [torch.zeros(n, dtype=torch.uint8) for n in self.sizes]
        layer_groups = {n: (tuple(e.group for e in es) if tup else es[0].group) for n, (tup, es) in self.layers.items()}
        case = ZooCase(name=name, groups=list(groups), layer_groups=layer_groups, layers=self.layers, backings=backings, **kw)
        return case.randomize(seed)


def _blocks(spec: GroupSpec, max_tokens: int, dcp: DCPSpec = DCPSpec()) -> int:
    """Room for two disjoint block tables of ``max_tokens`` tokens plus 2 canary blocks."""
    return 2 * -(-local_tokens(dcp, max_tokens) // spec.block_size) + 2


DSA_INDEXER_REGIONS = (128, 4)

LLAMA_SHAPES = {  # variant -> (hint, shape of (NB, BS, H, D))
    "flash": ("kv_first", lambda nb, bs, h, d: (2, nb, bs, h, d)),
    "flashinfer": ("kv_second", lambda nb, bs, h, d: (nb, 2, bs, h, d)),
    "hnd": ("hnd_kv_first", lambda nb, bs, h, d: (2, nb, h, bs, d)),
    "hnd_flashinfer": ("hnd_kv_second", lambda nb, bs, h, d: (nb, 2, h, bs, d)),
}


def llama(variant="flash", *, max_tokens=600, block_size=16, num_layers=2, num_heads=2, head_dim=16,
          dtype=torch.bfloat16, seed=0) -> ZooCase:
    """Llama-like GQA: one full-attention group, K/V per layer in an engine layout."""
    hint, shape_of = LLAMA_SHAPES[variant]
    spec = GroupSpec(block_size=block_size)
    nb, b = _blocks(spec, max_tokens), CaseBuilder()
    for i in range(num_layers):
        b.add(f"layers.{i}.attn", b.tight(dtype, shape_of(nb, block_size, num_heads, head_dim), hint))
    return b.case(f"llama-{variant}", [spec], hints=hint, num_blocks=[nb], seed=seed, model_name="llama-zoo")


def _mla_family(kind, *, max_tokens=600, block_size=64, num_layers=2, dtype=torch.bfloat16, dcp=DCPSpec(), seed=0,
                model_name="dsv3-zoo", window=40) -> ZooCase:
    spec = GroupSpec(block_size=block_size)
    groups = [spec] + ([GroupSpec(block_size=block_size, sliding_window=window)] if kind == "swa" else [])
    groups += [spec] if kind == "tuple-split" else []
    nb, b, bs = _blocks(spec, max_tokens, dcp), CaseBuilder(), block_size
    for i in range(num_layers if kind != "swa" else 1):
        if kind in ("v3", "v32", "swa"):
            b.add(f"layers.{i}.attn", b.tight(dtype, (nb, bs, 576)))
        if kind == "v32":  # vLLM's indexer_k_quant_and_cache writes [rows x 128 fp8][rows x 4 B fp32 scale]
            b.add(f"layers.{i}.indexer", b.tight(torch.uint8, (nb, bs, 132), regions=DSA_INDEXER_REGIONS))
        if kind == "swa":
            b.add("layers.1.swa", b.tight(dtype, (nb, bs, 576), group=1))
        if kind in ("v3-ascend", "v32-ascend", "tuple-split"):
            planes = [b.tight(dtype, (nb, bs, 1, 512)), b.tight(dtype, (nb, bs, 1, 64))]
            if kind == "v32-ascend" and i == 0:  # LI C8 indexer: int8 K + fp16 scale, same group
                planes += [b.tight(torch.int8, (nb, bs, 1, 128)), b.tight(torch.float16, (nb, bs, 1, 1))]
            if kind == "tuple-split":  # synthetic: indexer planes in a group of their own, same ids
                planes += [b.tight(torch.int8, (nb, bs, 1, 128), group=1), b.tight(torch.float16, (nb, bs, 1, 1), group=1)]
            b.add(f"layers.{i}" + (".attn" if kind == "v3-ascend" else ""), *planes, as_tuple=True)
    suffix = "" if dcp.size == 1 else f"-dcp{dcp.rank}of{dcp.size}x{dcp.interleave_tokens}"
    return b.case(f"mla-{kind}{suffix}", groups, hints="blocks_first", num_blocks=[nb] * len(groups), dcp=dcp, seed=seed,
                  model_name=model_name, tied_groups={1: 0} if kind == "tuple-split" else {})


def mla(**kw) -> ZooCase:
    """DeepSeek-V3 MLA (vLLM CUDA): one [NB, BS, 576] tensor per layer (``dcp=`` for a shard)."""
    return _mla_family("v3", **kw)


def mla_ascend(**kw) -> ZooCase:
    """vLLM-Ascend MLA: a (nope [NB,BS,1,512], rope [NB,BS,1,64]) tuple per layer."""
    return _mla_family("v3-ascend", **kw)


def dsv32(**kw) -> ZooCase:
    """DeepSeek-V3.2 (vLLM): MLA [NB,BS,576] bf16 + indexer K uint8 [NB,BS,132], same block ids."""
    return _mla_family("v32", model_name="dsv32-zoo", **kw)


def dsv32_ascend(**kw) -> ZooCase:
    """V3.2 (LI C8) as vLLM-Ascend 0.23.0.post1 registers it (checked against its runner in
    tests/ascend): one AscendMLAAttentionSpec group; layer 0 a 4-tuple (nope bf16 [..,1,512],
    rope [..,1,64], indexer int8 [..,1,128], scale fp16 [..,1,1]); layer 1 reuses layer 0's
    top-k and registers (nope, rope) only."""
    return _mla_family("v32-ascend", model_name="dsv32-zoo", **kw)


def tuple_split(**kw) -> ZooCase:
    """SYNTHETIC (no engine registers this): a layer's 4-tuple whose indexer planes belong to a
    second group with the first group's block ids; exercises per-plane group assignment."""
    return _mla_family("tuple-split", model_name="tuple-split-zoo", **kw)


def mla_swa(*, block_size=16, **kw) -> ZooCase:
    """An MLA layer (group 0) plus a sliding-window MLA layer (group 1, window in global
    tokens), for decode context parallel shards whose windows hold only local rows."""
    return _mla_family("swa", block_size=block_size, model_name="mla-swa-zoo", **kw)


DSV4_GROUPS = dsv4_cache.GROUPS  # name -> (spec, row bytes, dtype, page alignment), shared with the demo
DSV4_REGIONS = {name: r.region_bytes for name, r in dsv4_cache.ROW_REGIONS.items()}  # the split fp8 blocks
DSV4_NAMES = list(DSV4_GROUPS)
DSV4_LAYER_CACHES = {
    "swa": ["swa"],
    "c4": ["swa", "c4", "c4_indexer", "c4_state", "c4_indexer_state"],
    "c128": ["swa", "c128", "c128_state"],
}


def dsv4(*, packed=False, max_tokens=600, layer_kinds=("swa", "c4", "c128"), c4_block_size=256, seed=0,
         max_window_blocks=None) -> ZooCase:
    """DeepSeek-V4-Flash, vLLM's seven caches (fewer layers than the model).

    packed=False: one tensor per (layer, cache), pages padded to 576 (uint8) / 512 (fp32).
    packed=True (SYNTHETIC, for the transfer paths on machines without vLLM; vLLM 0.32's real
    packed V4 layout is driven in tests/integration/vllm_dsv4_packed.py): every page of one
    block id in one per-block allocation (pages 576-aligned), each layer's cache an
    ``as_strided`` view with a storage offset; all groups draw block ids from that one pool.
    Unlike vLLM, whose groups each lay their pages out from byte 0 of a block (aliasing; the
    block stride is the widest group's bytes), every group's pages here follow one another, so
    the tests' random per-plane tables stay valid without a cross-group block pool. Windowed groups get fewer blocks than a dense table needs:
    use ``window_keep`` / ``restore_keep`` tables (blocks no store or restore reads are -1).
    ``c4_block_size`` changes the compressed groups' engine block size (seed 001).
    """
    compressed = ("c4", "c128", "c4_indexer")
    specs = {n: replace(s, block_size=c4_block_size) if n in compressed else s for n, (s, *_) in DSV4_GROUPS.items()}

    def num_blocks(name):
        spec = specs[name]
        if spec.sliding_window is None:
            return _blocks(spec, max_tokens)
        sparse = 2 * (-(-spec.sliding_window // spec.block_size) + 1) * (max_tokens // 128 + 2) + 2
        return min(_blocks(spec, max_tokens), max_window_blocks or sparse)

    caches = [(f"layers.{i}.{c}", c) for i, kind in enumerate(layer_kinds) for c in DSV4_LAYER_CACHES[kind]]
    page = {c: _align(specs[c].rows_per_block * DSV4_GROUPS[c][1], 576 if packed else DSV4_GROUPS[c][3]) for c in specs}
    nb = [num_blocks(n) for n in DSV4_NAMES]
    b, backing, offset = CaseBuilder(), None, 0
    if packed:  # one backing; a block is every layer's page, one after another
        nb = [sum(nb)] * len(nb)
        block_bytes = sum(page[c] for _, c in caches)
        backing = b.backing(nb[0] * block_bytes)
    for name, c in caches:
        g, (_, row_bytes, dtype, _) = DSV4_NAMES.index(c), DSV4_GROUPS[c]
        stride = block_bytes if packed else page[c]
        b.add(name, b.padded(dtype, nb[g], specs[c].rows_per_block, row_bytes, stride, g, backing, offset,
                             regions=DSV4_REGIONS.get(c, ())))
        offset += page[c] if packed else 0
    return b.case("dsv4-flash" + ("-packed" if packed else ""), [specs[n] for n in DSV4_NAMES], hints="blocks_first",
                  num_blocks=nb, seed=seed, model_name="dsv4-zoo", shared_pool=packed)


def gemma_swa(*, max_tokens=600, block_size=16, window=80, num_layers=6, num_heads=1, head_dim=32, seed=0) -> ZooCase:
    """Gemma-3-like hybrid: 5 sliding-window layers (group 1) per full layer (group 0), flash-attn layout."""
    groups = [GroupSpec(block_size=block_size), GroupSpec(block_size=block_size, sliding_window=window)]
    nb, b = [_blocks(g, max_tokens) for g in groups], CaseBuilder()
    for i in range(num_layers):
        g = 0 if i % 6 == 5 else 1
        b.add(f"layers.{i}.attn", b.tight(torch.bfloat16, (2, nb[g], block_size, num_heads, head_dim), "kv_first", g))
    return b.case("gemma3-swa", groups, hints="kv_first", num_blocks=nb, seed=seed, model_name="gemma-zoo")


def gemma_swa_coarse(*, max_tokens=600, block_size=16, window=80, num_heads=1, head_dim=32, seed=0) -> ZooCase:
    """``gemma_swa``'s caches registered one tensor per group (an engine with one buffer per cache
    type): the 5 sliding-window layers side by side in one row, wider than a pool slot, so the
    engine stores their window rows in column slices (``KVLayout.with_sliced_planes``)."""
    groups = [GroupSpec(block_size=block_size), GroupSpec(block_size=block_size, sliding_window=window)]
    nb, b = [_blocks(g, max_tokens) for g in groups], CaseBuilder()
    b.add("full.attn", b.tight(torch.bfloat16, (2, nb[0], block_size, num_heads, head_dim), "kv_first", 0))
    b.add("window.attn", b.tight(torch.bfloat16, (2, nb[1], block_size, 5 * num_heads, head_dim), "kv_first", 1))
    return b.case("gemma3-swa-coarse", groups, hints="kv_first", num_blocks=nb, seed=seed, model_name="gemma-zoo-coarse")


def state_hybrid(*, max_tokens=600, block_size=16, state_block_size=64, seed=0) -> ZooCase:
    """Qwen3-Next-like: one full-attention layer (group 0) + recurrent state layers (group 1),
    the state of each block one opaque page (conv fp32 [..,3,32] + temporal fp32 [..,4,16,16])."""
    groups = [GroupSpec(block_size=block_size), GroupSpec(block_size=state_block_size, kind=GroupKind.STATE)]
    nb, b = [_blocks(g, max_tokens) for g in groups], CaseBuilder()
    b.add("layers.3.attn", b.tight(torch.bfloat16, (2, nb[0], block_size, 1, 32), "kv_first", 0))
    for i in (0, 1):
        b.add(f"layers.{i}.conv", b.tight(torch.float32, (nb[1], 3, 32), "page", 1))
        b.add(f"layers.{i}.ssm", b.tight(torch.float32, (nb[1], 4, 16, 16), "page", 1))
    hints = {name: ("kv_first" if name.endswith(".attn") else "page") for name in b.layers}
    return b.case("state-hybrid", groups, hints=hints, num_blocks=nb, seed=seed, model_name="qwen-next-zoo")


def vllm_cpu(*, max_tokens=600, block_size=16, num_layers=2, num_heads=2, head_dim=16, seed=0) -> ZooCase:
    """vLLM CPU backend: [NB, H, BS, 2*D] with K transposed inside the page; an opaque page plane."""
    spec = GroupSpec(block_size=block_size)
    nb, b = _blocks(spec, max_tokens), CaseBuilder()
    for i in range(num_layers):
        b.add(f"layers.{i}.attn", b.tight(torch.bfloat16, (nb, num_heads, block_size, 2 * head_dim), "page"))
    return b.case("vllm-cpu", [spec], hints="page", num_blocks=[nb], page_groups=frozenset({0}), seed=seed,
                  model_name="llama-zoo")


ZOO = {  # name -> (builder, chunk sizes the layout allows and the tests sweep)
    "llama-flash": (lambda **kw: llama("flash", **kw), (64, 256)),
    "llama-flashinfer": (lambda **kw: llama("flashinfer", **kw), (64, 256)),
    "llama-hnd": (lambda **kw: llama("hnd", **kw), (64, 256)),
    "llama-hnd-flashinfer": (lambda **kw: llama("hnd_flashinfer", **kw), (64, 256)),
    "dsv3-mla": (mla, (64, 256, 512)),
    "dsv3-mla-ascend": (mla_ascend, (64, 256)),
    "dsv32": (dsv32, (64, 256)),
    "dsv32-ascend": (dsv32_ascend, (64, 256)),
    "dsv4-flash": (dsv4, (256, 512)),
    "dsv4-flash-packed": (lambda **kw: dsv4(packed=True, **{"max_window_blocks": 48, **kw}), (256, 512)),
    "gemma3-swa": (gemma_swa, (32, 64, 128)),
    "gemma3-swa-coarse": (gemma_swa_coarse, (32, 64, 128)),
    "state-hybrid": (state_hybrid, (64, 128)),
    "vllm-cpu": (vllm_cpu, (64, 256)),
    "dsv3-mla-dcp": (lambda **kw: mla(dcp=DCPSpec(rank=1, size=2, interleave_tokens=8), **kw), (64, 256)),
    "mla-swa-dcp": (lambda **kw: mla_swa(dcp=DCPSpec(rank=0, size=2, interleave_tokens=8), **kw), (64, 128)),
}


def build(name: str, **kw) -> ZooCase:
    return ZOO[name][0](**kw)


# ---------------------------------------------------------------------------------------
# block tables


def random_tables(case: ZooCase, num_tokens: int, rng: np.random.Generator, *, avoid: Optional[Sequence] = None,
                  keep: Optional[Mapping[int, Sequence[tuple]]] = None) -> list:
    """Per-group random block ids for ``num_tokens`` tokens, no id repeated (across groups too
    when the case has one shared pool). ``avoid``: tables whose ids must not be reused.
    ``keep``: for some groups, token ranges whose blocks are present; the others are -1.
    """
    avoid = avoid or [[] for _ in case.groups]
    shared = {int(x) for t in avoid for x in t if x >= 0}
    tables: dict = {}
    for g in (g for g in range(len(case.groups)) if g not in case.tied_groups):
        n, bs = case.blocks_for(g, num_tokens), case.groups[g].block_size
        present = np.zeros(n, bool) if keep and g in keep else np.ones(n, bool)
        for a, e in (keep or {}).get(g, ()):
            la, le = local_tokens(case.dcp, a), local_tokens(case.dcp, e)
            present[la // bs : -(-le // bs)] |= le > la
        busy = shared if case.shared_pool else {int(x) for x in avoid[g] if x >= 0}
        free = [i for i in range(case.num_blocks[g]) if i not in busy]
        if present.sum() > len(free):
            raise ValueError(f"{case.name} group {g}: {present.sum()} blocks needed, {len(free)} free")
        tables[g] = np.full(n, -1, np.int64)
        tables[g][present] = rng.permutation(free)[: present.sum()]
        shared |= set(tables[g][present].tolist())
    tables.update({g: tables[src] for g, src in case.tied_groups.items()})
    return [tables[g].tolist() for g in range(len(case.groups))]


def window_keep(case: ZooCase, bounds: Sequence[tuple]) -> dict:
    """Token ranges a store of chunks ``bounds`` reads in each windowed group."""
    windows = {g: case.window(g) for g in range(len(case.groups)) if case.window(g) is not None}
    return {g: [(max(s, e - w), e) for s, e in bounds] for g, w in windows.items()}


def restore_keep(case: ZooCase, boundary: int) -> dict:
    """Token ranges a restore at ``boundary`` writes in each windowed group."""
    return {g: [(max(0, boundary - case.window(g)), boundary)] for g in range(len(case.groups)) if case.window(g) is not None}


# ---------------------------------------------------------------------------------------
# reference rules (brute force, independent of kvconnect)


def local_tokens(dcp: DCPSpec, t: int) -> int:
    """Tokens of [0, t) that live on this DCP rank, by enumeration."""
    return int(np.count_nonzero((np.arange(t) // dcp.interleave_tokens) % dcp.size == dcp.rank))


def chunk_bounds_ref(num_tokens: int, chunk: int, partial: bool) -> list:
    full = [(s, s + chunk) for s in range(0, num_tokens, chunk) if s + chunk <= num_tokens]
    tail = full[-1][1] if full else 0
    return full + ([(tail, num_tokens)] if partial and tail < num_tokens else [])


def rows_of(case: ZooCase, g: int, a: int, b: int) -> tuple:
    t = case.tokens_per_row(g)
    return local_tokens(case.dcp, a) // t, local_tokens(case.dcp, b) // t


def stored_rows(case: ZooCase, g: int, s: int, e: int) -> tuple:
    w = case.window(g)
    return rows_of(case, g, s if w is None else max(s, e - w), e)


def needed_rows(case: ZooCase, g: int, boundary: int) -> tuple:
    w = case.window(g)
    return rows_of(case, g, 0 if w is None else max(0, boundary - w), boundary)


def store_masks(case: ZooCase, tables: Sequence, bounds: Sequence[tuple]) -> list:
    """Group mask each chunk is stored with: bit g when every block its rows need is present."""
    def present(g, s, e):
        return all(tables[g][r // case.rows_per_block(g)] >= 0 for r in range(*stored_rows(case, g, s, e)))

    return [sum(1 << g for g in range(len(case.groups)) if present(g, s, e)) for s, e in bounds]


def _held_rows(case: ZooCase, g: int, bounds, masks, present_below: int) -> set:
    held = [range(*stored_rows(case, g, s, e)) for (s, e), m in zip(bounds, masks)
            if e <= present_below or (m is not None and (m >> g) & 1)]
    return {r for rows in held for r in rows}


def expected_boundary(case: ZooCase, bounds: Sequence[tuple], masks: Sequence[Optional[int]], *, present_below: int = 0) -> int:
    """Largest chunk end P such that every row each group needs at P is held by a chunk
    stored with that group's bit (chunks ending at or below ``present_below`` count as held),
    every chunk of [0, P) is stored with the bits of the groups without a window (even one
    holding none of their rows: a hit never runs past a chunk that is not stored), and page
    groups' P falls on a page edge. Brute force over rows."""
    groups = range(len(case.groups))
    unwindowed = [g for g in groups if case.window(g) is None]
    for k in range(len(bounds) - 1, -1, -1):
        boundary = bounds[k][1]
        if any(case.is_page(g) and local_tokens(case.dcp, boundary) % case.tokens_per_row(g) for g in groups):
            continue
        if any(e > present_below and (m is None or not (m >> g) & 1)
               for (_, e), m in zip(bounds[: k + 1], masks[: k + 1]) for g in unwindowed):
            continue
        held = [_held_rows(case, g, bounds[: k + 1], masks[: k + 1], present_below) for g in groups]
        if all(set(range(*needed_rows(case, g, boundary))) <= held[g] for g in groups):
            return boundary
    return 0


# Planes of one engine tensor in kvconnect's documented order (layout_detect: K then V,
# per head for HND): for each, (blocks, rows) -> an index into the engine tensor.
SUBPLANES = {
    "blocks_first": lambda t: [lambda b, r: (b, r)],
    "kv_first": lambda t: [lambda b, r, k=k: (k, b, r) for k in range(2)],
    "kv_second": lambda t: [lambda b, r, k=k: (b, k, r) for k in range(2)],
    "hnd_kv_first": lambda t: [lambda b, r, k=k, h=h: (k, b, h, r) for k in range(2) for h in range(t.shape[2])],
    "hnd_kv_second": lambda t: [lambda b, r, k=k, h=h: (b, k, h, r) for k in range(2) for h in range(t.shape[2])],
    "page": lambda t: [lambda b, r: (b,)],
}


@dataclass(frozen=True)
class RefPlane:
    """One plane as the engine addresses it: ``tensor[index(blocks, rows)]`` are its rows."""

    group: int
    tensor: torch.Tensor  # the engine tensor viewed as uint8
    index: object

    def get(self, blocks, rows) -> torch.Tensor:
        return self.tensor[self.index(blocks, rows)]

    def put(self, blocks, rows, values) -> None:
        self.tensor[self.index(blocks, rows)] = values


def _region_views(t: torch.Tensor, regions: tuple) -> list:
    """The regions of a split ``[NB, rows, row]`` uint8 tensor as the engine writes them: field k of
    row r at ``rows * sum(regions[:k]) + r * regions[k]`` from the block's first byte."""
    rows, before, out = t.shape[1], 0, []
    for size in regions:
        out.append(torch.as_strided(t, (t.shape[0], rows, size), (t.stride(0), size, 1),
                                    t.storage_offset() + rows * before))
        before += size
    return out


def reference_planes(case: ZooCase) -> list:
    """RefPlane per plane, in layout order."""
    tensors = [(e, case.tensor(name, i).view(torch.uint8)) for name, (_, es) in case.layers.items() for i, e in enumerate(es)]
    out = []
    for e, t in tensors:
        if e.regions:
            out += [RefPlane(e.group, view, lambda b, r: (b, r)) for view in _region_views(t, e.regions)]
        else:
            out += [RefPlane(e.group, t, index) for index in SUBPLANES[e.index](t)]
    return out


def expected_chunk(case: ZooCase, tables, start: int, end: int) -> tuple:
    """(plane_rows, payload) a store of chunk [start, end) must produce: per plane the
    stored rows, then the rows themselves, plane-major, exactly row bytes each."""
    plane_rows, payload = [], b""
    mask = store_masks(case, tables, [(start, end)])[0]
    for plane in reference_planes(case):
        g = plane.group
        r0, r1 = stored_rows(case, g, start, end) if (mask >> g) & 1 else (stored_rows(case, g, start, end)[0],) * 2
        plane_rows.append((r0, r1 - r0))
        r, rpb = torch.arange(r0, r1), case.rows_per_block(g)
        payload += plane.get(torch.as_tensor(tables[g], dtype=torch.int64)[r // rpb], r % rpb).numpy().tobytes()
    return plane_rows, payload


def copy_rows(src: ZooCase, dst: ZooCase, g: int, rows: Sequence[int], src_tables, dst_tables) -> None:
    """dst[row] = src[row] for the rows of group g, through engine-native indexing on bytes."""
    r = torch.as_tensor(list(rows), dtype=torch.int64)
    s_rpb, d_rpb = src.rows_per_block(g), dst.rows_per_block(g)
    sb = torch.as_tensor(src_tables[g], dtype=torch.int64)[r // s_rpb]
    db = torch.as_tensor(dst_tables[g], dtype=torch.int64)[r // d_rpb]
    assert (sb >= 0).all() and (db >= 0).all(), "reference asked to copy a row of an absent block"
    for sp, dp in zip(reference_planes(src), reference_planes(dst)):
        if sp.group == g and len(r):
            dp.put(db, r % d_rpb, sp.get(sb, r % s_rpb))


def expected_restore(src: ZooCase, dst_before: ZooCase, src_tables, dst_tables, boundary: int, skip: int = 0) -> ZooCase:
    """The destination cache as a correct retrieve of ``boundary`` tokens (mask skipping
    ``skip``) must leave it: every byte as before except the rows each group needs at the
    boundary from the chunks in [skip, boundary)."""
    out = dst_before.clone()
    if boundary <= skip:
        return out
    for g in range(len(src.groups)):
        n0, n1 = needed_rows(src, g, boundary)
        lo = max(n0, rows_of(src, g, skip, skip)[0])
        copy_rows(src, out, g, range(lo, n1), src_tables, dst_tables)
    return out


# ---------------------------------------------------------------------------------------
# engine helpers


def small_config(chunk_size: int, **kw) -> Config:
    """A Config for tests: a 64 MB CPU pool, 2 kernel threads, no lower tiers, and a restore
    point at every chunk end (what the hand-computed boundaries assume) made by the restore-point
    model: an interval of one chunk, so a hybrid layout's chunks are stored as prefix parts and
    window pieces (kvconnect/restore/parts.py; interval 0 would store whole chunks). The restore-point
    tests (tests/test_restore_points.py) set other intervals."""
    return Config(**{"chunk_size": chunk_size, "max_local_cpu_size": 64 / 1024, "num_threads": 2,
                     "restore_interval_tokens": chunk_size, **kw})


def transplant(src_engine, dst_engine, tokens) -> int:
    """Move every stored chunk of ``tokens`` from one engine's pool to another's through the
    canonical encoded form (export_chunk -> import_chunk); returns chunks moved. A hybrid
    layout's window pieces (kvconnect/restore/parts.py) move with their chunk and are not counted."""
    from kvconnect.restore.parts import window_key

    chunks = src_engine.chunks(tokens, include_partial=True)
    blobs = [(c.key, src_engine.storage.export_chunk(c.key)) for c in chunks]
    pieces = [(k, src_engine.storage.export_chunk(k)) for c in chunks for k in
              (window_key(c.key, p) for p in range(len(src_engine.parts.pieces)))]
    assert all(dst_engine.storage.import_chunk(data, key) for key, data in blobs + pieces if data is not None)
    return sum(data is not None for _, data in blobs)


def random_tokens(rng: np.random.Generator, n: int, vocab: int = 32000) -> np.ndarray:
    return rng.integers(0, vocab, n, dtype=np.int64)


# ---------------------------------------------------------------------------------------
# the two parts of a stored chunk (kvconnect/restore/parts.py), reassembled for format checks


def stored_masks(engine, chunks) -> list:
    """Per chunk, the groups stored for it in either part: its prefix part's and, when every
    window piece is present, the window groups all pieces hold (None: nothing stored)."""
    from kvconnect.restore.parts import window_key

    prefix = engine.storage.masks([c.key for c in chunks])
    if not engine.parts.split:
        return prefix
    out = []
    for c, p in zip(chunks, prefix):
        pieces = engine.storage.masks([window_key(c.key, i) for i in range(len(engine.parts.pieces))])
        w = None
        if all(m is not None for m in pieces):
            w = engine.parts.window_mask
            for m in pieces:
                w &= m
        out.append(None if p is None and w is None else (p or 0) | (w or 0))
    return out


def export_logical_chunk(engine, chunk):
    """(token start, token end, group mask, plane rows, payload) of a chunk as one object: the
    prefix part and the window pieces merged plane by plane (None when nothing is stored)."""
    from kvconnect.chunks.chunk_format import decode_header
    from kvconnect.restore.parts import window_key

    keys = [chunk.key] + ([window_key(chunk.key, i) for i in range(len(engine.parts.pieces))] if engine.parts.split else [])
    objs = [engine.storage.export_chunk(k) for k in keys]
    if all(o is None for o in objs):
        return None
    planes = engine.layout.planes
    rows: list = [None] * len(planes)
    data: list = [b""] * len(planes)
    mask, window = 0, None
    for n_obj, (k, obj) in enumerate(zip(keys, objs)):
        if obj is None:
            continue
        owned = (set(i for i, p in enumerate(planes) if not (engine.parts.window_mask >> p.group_index) & 1) if n_obj == 0
                 else set(engine.parts.pieces[n_obj - 1]))
        header = decode_header(obj)
        assert (k == chunk.key) or not header.group_mask & engine.parts.prefix_mask, "a window piece holds prefix groups"
        if k == chunk.key:
            mask |= header.group_mask
        else:
            window = header.group_mask if window is None else window & header.group_mask
        off = header.header_bytes
        for i, (first, n) in enumerate(header.plane_rows):
            nbytes = n * planes[i].row_bytes
            if i in owned:
                rows[i], data[i] = (first, n), bytes(obj[off : off + nbytes])
            else:
                assert n == 0, f"plane {i} has rows in a part that does not hold it"
            off += nbytes
    if window is not None and all(o is not None for o in objs[1:]):
        mask |= window
    header0 = decode_header(next(o for o in objs if o is not None))
    for i in range(len(planes)):  # a part not stored: its groups' blocks were absent, rows (first, 0)
        geo = engine.layout.geometries[planes[i].group_index]
        rows[i] = rows[i] or (geo.stored_rows(header0.token_start, header0.token_end)[0], 0)
    rows, data = _unslice(planes, rows, data)
    return header0.token_start, header0.token_end, mask, rows, b"".join(data)


def _unslice(planes, rows, data):
    """Rows and bytes per plane of the layout the engine was given: the column slices of a wide
    plane (``KVLayout.with_sliced_planes``) joined back, row by row."""
    out_rows, out_data, i = [], [], 0
    while i < len(planes):
        n = planes[i].num_slices
        if n == 1:
            out_rows.append(rows[i])
            out_data.append(data[i])
            i += 1
            continue
        members = range(i, i + n)
        counts = {rows[j][1] for j in members}
        first, count = rows[i]
        if len(counts) != 1:  # some slices absent: the plane's rows are not stored
            out_rows.append((first, 0))
            out_data.append(b"")
        else:
            cols = [np.frombuffer(data[j], np.uint8).reshape(count, planes[j].row_bytes) for j in members]
            out_rows.append((first, count))
            out_data.append(np.concatenate(cols, axis=1).tobytes())
        i += n
    return out_rows, out_data


def remove_chunk(engine, chunk) -> None:
    """Evict a chunk from the pool as one unit: its prefix part and every window piece."""
    from kvconnect.restore.parts import window_key

    engine.pool.remove(chunk.key)
    for i in range(len(engine.parts.pieces)):
        engine.pool.remove(window_key(chunk.key, i))
