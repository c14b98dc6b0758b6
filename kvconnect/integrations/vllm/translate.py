"""Translate vLLM's (and vLLM-Ascend's) KV-cache description into kvconnect's.

The only module that reads vLLM objects. It reads them by attribute and class name and
imports vLLM lazily (parallel ranks only), so it is unit-tested with look-alike objects on
machines without vLLM.

    t = translate_kv_caches(kv_cache_config, kv_caches, backend_names=..., ...)
    t.layout                 KVLayout over every plane of every transferable group
    t.block_tables(ids)      vLLM per-group block ids -> kvconnect per-group int64 arrays

Groups. Each vLLM group becomes one kvconnect group (two when it mixes opaque pages and
token rows); a kvconnect group reads the block ids of the vLLM group it came from.

| vLLM spec (class name)                                  | kvconnect GroupSpec |
|---------------------------------------------------------|---------------------|
| FullAttentionSpec, MLAAttentionSpec, AscendMLAAttentionSpec, AscendSFAIndexerCacheSpec | full; compress ratio from ``compress_ratio`` (Ascend) or an integer ``tokens_per_state`` |
| SlidingWindowSpec, SlidingWindowMLASpec, AscendSlidingWindowMLASpec | window W, restore window W - 1 (vLLM keeps exactly the last W - 1 tokens' blocks); ``window_free_every`` N where the release's table has a bench-proven rule for the spec on the tensors' device (``engine_tables.WindowFree``: DeepSeek V4's C128 compressor state, N = 128, CPU) |
| Compress4AttentionSpec, Compress128AttentionSpec (vLLM-Ascend 0.13 only: ``EngineRelease.compressed_full_specs``) | full, compress ratio 4 / 128; tensors of ``num_blocks // ratio`` blocks (the release's per-group pools) |
| UniformTypeKVCacheSpecs                                 | per layer, by the rules above |
| MambaSpec (Gated DeltaNet, Mamba), ``mamba_cache_mode`` "align" | STATE group of the spec's block size: one state page per block, its snapshot at a restore point P is row P / B - 1 (``recurrent``); other modes refused |
| anything else (chunked local, cross attention, ...)     | ``UnsupportedLayoutError``: the connector stays off |

Tensors (one value per layer).

| registered value                                         | planes |
|----------------------------------------------------------|--------|
| tuple/list (vLLM-Ascend: MLA nope + rope, indexer K + scale) | one ``[NB, rows, ...]`` plane per distinct element |
| 4-D ``[B, H, N, C]`` view of a page-packing backend (vLLM CPU: K transposed in a page) | one opaque page per block |
| a layer whose module reports a tiled layout (``tiled_layers``: ROCm V3.2 indexer) | one opaque page per block |
| 4-D ``[B, H, N, C]`` whose ``(H, C)`` is contiguous per token (vLLM >= 0.32, MLA ``[B, 1, N, 576]``) | one plane ``[B, N, H*C]`` |
| 4-D ``[B, H, N, C]`` otherwise (HND)                     | one plane per head |
| 4-D ``[B, N, H, C]``, 3-D ``[B, N, C]``, 5-D flash / FlashInfer | ``kvconnect.layout_detect`` |

Split blocks. A cache whose blocks keep each row's fields in separate regions (vLLM's
DeepSeek V4 ``fp8_ds_mla``: ``[rows x 576][rows x 8]``; DeepSeek indexer K: ``[rows x 128][rows x 4]``)
is registered as rows of the fields' total width; ``engine_tables`` (``EngineRelease.split_rows``, per release)
says which, and the layout splits those planes into one sub-plane per region.

What a spec's ``block_size`` counts, and whether hybrid caches are re-split into kernel
blocks, depends on the engine release: ``engine_tables`` holds that as data (vLLM-Ascend 0.23
counts compressed blocks in rows and re-splits hybrid attention tensors into kernel blocks of
128: a vLLM block id b becomes kernel ids b*k .. b*k+k-1 in ``block_tables``). Views of one
layer that only re-read bytes its other views cover (vLLM-Ascend A5's third indexer view) are
stored once; a partial overlap is refused. Every refusal names the layer.

Tensor parallelism. A layout whose every group has a spec in ``TP_REPLICATED_SPECS`` (MLA-like:
the same cache on every TP rank) is ``Translation.tp_replicated``: its fingerprint carries the
TP size but not the rank, so every rank computes the same keys, and only the rank that
``ParallelRanks.writes_shared`` names writes the shared tiers (docs/vllm.md, "Replicated KV").
Any other layout, a mix of replicated and sharded groups included, keeps the rank in its keys.

The null block (id 0) marks blocks a request does not hold (sliding-window blocks that left
the window): it becomes -1. Layers of one group that share a tensor are stored once.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence

import blake3
import msgpack
import numpy as np
import torch

from kvconnect.errors import BlockTableError, LayoutError, UnsupportedLayoutError
from kvconnect.keys import MAX_NAMESPACE_BYTES
from kvconnect.layout import KVLayout
from kvconnect.layout_detect import split_planes
from kvconnect.spec import DCPSpec, GroupSpec, RowRegions

from . import engine_tables, recurrent
from .engine_tables import EngineRelease
from .metadata import BlockIds, RequestView, freeze_block_ids
from kvconnect.views import distinct_view_indices

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
"""vLLM's null block: a real block that no request owns and no valid position reads."""

PAGE_PACKED_BACKENDS = frozenset({"CPU_ATTN"})
"""Attention backends whose per-token K/V is not a contiguous row inside a page."""

_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec", "AscendMLAAttentionSpec", "AscendSFAIndexerCacheSpec"})
_WINDOW_SPECS = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec", "AscendSlidingWindowMLASpec"})
TP_REPLICATED_SPECS = frozenset({"MLAAttentionSpec", "SlidingWindowMLASpec", "AscendMLAAttentionSpec",
                                 "AscendSlidingWindowMLASpec", "AscendSFAIndexerCacheSpec"})
"""Specs whose cache is the same on every TP rank: MLA latents, DeepSeek V4's compressed and SWA
latents and compressor states, the V3.2 / V4 indexer K (one head from replicated weights)."""


# ---------------------------------------------------------------------------------------
# specs


def _compress_ratio(spec: Any) -> int:
    ratio = getattr(spec, "compress_ratio", None)  # vLLM-Ascend; vLLM 0.23 MLAAttentionSpec
    if ratio is None:
        per_state = getattr(spec, "tokens_per_state", 1)  # vLLM: tokens per stored state
        if isinstance(per_state, Fraction) and per_state.denominator != 1:
            raise UnsupportedLayoutError(f"{type(spec).__name__}: {per_state} tokens per state (several states per token)")
        ratio = int(per_state)
    return max(1, int(ratio))


def _block_tokens(spec: Any, ratio: int, release: EngineRelease) -> int:
    """Tokens one engine block of a spec covers, by what the release's ``block_size`` counts."""
    block_size = int(spec.block_size)
    if ratio == 1:
        return block_size
    if release.compressed_block_unit == "rows":
        return block_size * ratio  # vLLM-Ascend 0.23: block_size rows, each `ratio` tokens
    rows = getattr(spec, "storage_block_size", None)
    if rows is not None and int(rows) * ratio != block_size:
        raise UnsupportedLayoutError(
            f"{type(spec).__name__}: block_size {block_size} tokens with storage_block_size {rows} rows "
            f"at compress ratio {ratio} ({release.name} counts block_size in tokens)")
    return block_size


def group_spec_of(spec: Any, release: EngineRelease = engine_tables.VLLM, kernel_split: int = 1,
                  device_type: Optional[str] = None) -> GroupSpec:
    """The kvconnect GroupSpec of one vLLM per-layer spec (see the table in the module doc).

    kernel_split: the registered tensor holds each vLLM block as this many kernel blocks;
    the GroupSpec then describes one kernel block.
    device_type: the registered tensor's device type; the release's window-free rules
    (``EngineRelease.window_free``) apply only on the device types they were measured on
    (None: no rule).
    """
    name = type(spec).__name__
    if recurrent.is_state_spec(spec):
        if release.recurrent_refusal:
            raise UnsupportedLayoutError(f"{name}: {release.recurrent_refusal}")
        return recurrent.state_group_spec(spec)
    if getattr(spec, "sfa_dcp_replicated_indexer_size", 1) > 1:
        raise UnsupportedLayoutError(
            f"{name}: the indexer cache is replicated over {spec.sfa_dcp_replicated_indexer_size} decode-context "
            f"ranks (num_blocks x {spec.sfa_dcp_replicated_indexer_size} blocks); which rank's tokens a block holds "
            f"is not described by the spec")
    ratio = _compress_ratio(spec)
    tokens = _block_tokens(spec, ratio, release) // max(1, kernel_split)
    if name in _WINDOW_SPECS:
        window = int(spec.sliding_window)
        # vLLM frees blocks whose tokens are all before P - W + 1 (get_num_skipped_tokens),
        # so W - 1 trailing tokens is what it needs and what it keeps.
        return GroupSpec(block_size=tokens, compress_ratio=ratio,
                         sliding_window=window, restore_window=max(1, window - 1),
                         window_free_every=release.window_free_every(spec, device_type))
    if name in _FULL_SPECS or name in release.compressed_full_specs:
        # A sliding or chunked-local layer under a FullAttentionSpec (hybrid allocator off)
        # keeps blocks for every token, so it is restored as a full group.
        return GroupSpec(block_size=tokens, compress_ratio=ratio)
    raise UnsupportedLayoutError(
        f"vLLM cache spec {name} is not supported (chunked local, cross attention and "
        f"unknown specs cannot be restored exactly); kvconnect stays off for this model"
    )


def _device_type(value: Any) -> Optional[str]:
    tensor = value[0] if isinstance(value, (tuple, list)) and value else value
    return tensor.device.type if isinstance(tensor, torch.Tensor) else None


def _layer_spec(group_spec: Any, layer_name: str) -> Any:
    if type(group_spec).__name__ == "UniformTypeKVCacheSpecs":
        return group_spec.kv_cache_specs[layer_name]
    return group_spec


def _num_heads(spec: Any) -> int:
    slots = getattr(spec, "num_head_slots", None)
    return int(slots if slots is not None else getattr(spec, "num_kv_heads", 1))


# ---------------------------------------------------------------------------------------
# tensors


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether dims 2.. of a ``[blocks, rows, ...]`` view form one contiguous row."""
    expected = 1
    for dim in range(t.dim() - 1, 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def _distinct_views(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A layer's tensors without the views that only re-read bytes earlier tensors cover
    (``kvconnect.views``: vLLM-Ascend A5 registers the C4 indexer as K, scale and a third view
    over both). A partial overlap is refused: the connector stays off for the model."""
    try:
        kept = distinct_view_indices("", tensors)
    except LayoutError as exc:
        raise UnsupportedLayoutError(str(exc).replace("layer '': ", "")) from exc
    return tuple(tensors[i] for i in kept)


def _planes_of(value: Any, spec: Any, group: GroupSpec, backend: Optional[str], logical_views: bool):
    """(value for KVLayout, layout hint or None, is_page) of one layer."""
    if recurrent.is_state_spec(spec):  # one state page per block (conv state, then recurrent state)
        recurrent.check_state_tensor(spec, value)
        return value, "page", True
    if isinstance(value, (tuple, list)):
        return _distinct_views(value), None, False
    if not isinstance(value, torch.Tensor):
        raise LayoutError(f"expected a tensor or a tuple of tensors, got {type(value).__name__}")
    if value.dim() != 4:
        return value, None, False
    rows, heads = group.rows_per_block, _num_heads(spec)
    bhnc = value.shape[1] == heads and value.shape[2] == rows
    bnhc = value.shape[1] == rows and value.shape[2] == heads
    if bhnc and (logical_views or not bnhc):
        if backend in PAGE_PACKED_BACKENDS:
            return value, "page", True
        per_token = value.permute(0, 2, 1, 3)
        if _rows_contiguous(per_token):
            return per_token, "blocks_first", False
        return value, "hnd", False
    if bnhc:
        return value, "blocks_first", False
    raise UnsupportedLayoutError(
        f"a 4-D cache of shape {tuple(value.shape)} matches neither [B, H={heads}, N={rows}, C] nor [B, N, H, C]"
    )


def _signature(value: Any) -> tuple:
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    return tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors if isinstance(t, torch.Tensor))


# ---------------------------------------------------------------------------------------
# the translation


@dataclass(frozen=True, eq=False)
class Translation:
    """A vLLM cache as a kvconnect layout, and how vLLM's block ids map onto its groups."""

    layout: KVLayout
    source_groups: tuple[int, ...]  # per kvconnect group: the vLLM group whose block ids it reads
    num_vllm_groups: int
    layer_names: tuple[str, ...]
    kernel_splits: tuple[int, ...] = ()  # per kvconnect group: kernel blocks per vLLM block (default 1)
    release: str = engine_tables.VLLM.name
    tp_replicated: bool = False  # every group's cache is the same on every TP rank: keyed without the rank

    def split_of(self, group: int) -> int:
        return self.kernel_splits[group] if self.kernel_splits else 1

    def tokens_per_block(self, group: int) -> int:
        """Global tokens one *vLLM* block of kvconnect group ``group`` covers (all DCP shards)."""
        return self.layout.groups[group].block_size * self.split_of(group) * self.layout.dcp.size

    def vllm_ids(self, block_ids) -> BlockIds:
        ids = freeze_block_ids(block_ids)
        if len(ids) != self.num_vllm_groups:
            raise BlockTableError(f"expected block ids for {self.num_vllm_groups} vLLM groups, got {len(ids)}")
        return ids

    def block_tables(self, block_ids) -> list[np.ndarray]:
        """Per kvconnect group, vLLM's block ids as int64 with the null block as -1."""
        ids = self.vllm_ids(block_ids)
        tables = []
        for g, source in enumerate(self.source_groups):
            arr = np.asarray(ids[source], dtype=np.int64)
            split = self.split_of(g)
            if split > 1:  # vLLM block b is kernel blocks b*k .. b*k + k - 1 of the registered tensor
                kernel = (arr[:, None] * split + np.arange(split, dtype=np.int64)).reshape(-1)
                tables.append(np.where(np.repeat(arr, split) == NULL_BLOCK_ID, -1, kernel))
            else:
                tables.append(np.where(arr == NULL_BLOCK_ID, -1, arr))
        return tables


def translate_kv_caches(
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    *,
    backend_names: Optional[Mapping[str, str]] = None,
    model_name: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    dcp: DCPSpec = DCPSpec(),
    identity: Optional[Mapping[str, str]] = None,
    release: Optional[EngineRelease] = None,
    tiled_layers: Sequence[str] = (),
    conv_state_layout: Optional[str] = None,
) -> Translation:
    """Build the kvconnect layout of vLLM's registered caches.

    kv_cache_config: vLLM's KVCacheConfig (``kv_cache_groups`` with ``layer_names`` and
        ``kv_cache_spec``; ``transfer_group_ids`` where the vLLM version has it).
    kv_caches: what vLLM passes to ``register_kv_caches``: layer name -> tensor or tuple.
    backend_names: layer name -> attention backend name (decides page-packed layouts).
    release: the engine release whose block semantics apply (``engine_tables``); default:
        detected from the spec classes and the platform.
    tiled_layers: layers whose cache module reports a tiled in-block layout (``tiled_layers``):
        a row's bytes are scattered over its block, so each block is stored as one opaque page.
    conv_state_layout: vLLM's conv-state layout ("SD" / "DS", ``recurrent.conv_state_layout()``),
        required when a group is a recurrent state (MambaSpec); part of the fingerprint.

    Raises UnsupportedLayoutError for caches that cannot be restored exactly, LayoutError
    for shapes that do not fit their spec; nothing is registered in either case.
    """
    backend_names = backend_names or {}
    vllm_groups = list(kv_cache_config.kv_cache_groups)
    transferable = set(getattr(kv_cache_config, "transfer_group_ids", range(len(vllm_groups))))
    logical_views = hasattr(kv_cache_config, "kv_cache_layout")  # vLLM >= 0.32 registers [B, H, N, C]
    if release is None:
        release = engine_tables.release_of(
            [_layer_spec(g.kv_cache_spec, layer) for g in vllm_groups for layer in g.layer_names[:1]]
            + [s for g in vllm_groups if type(g.kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
               for s in g.kv_cache_spec.kv_cache_specs.values()])
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)

    group_index: dict[tuple, int] = {}
    group_specs: list[GroupSpec] = []
    sources: list[int] = []
    splits: list[int] = []
    values: dict[str, Any] = {}
    layer_groups: dict[str, Any] = {}
    hints: dict[str, Optional[str]] = {}
    regions: dict[str, RowRegions] = {}
    seen: set[tuple] = set()
    spec_names: set[str] = set()
    quant: set[str] = set()
    page_backends: set[str] = set()
    states: set[str] = set()
    for vllm_group, group in enumerate(vllm_groups):
        if vllm_group not in transferable:
            continue
        for layer in group.layer_names:
            if layer not in kv_caches:  # runner-only layers have no registered cache
                continue
            spec = _layer_spec(group.kv_cache_spec, layer)
            # Within a group, one tensor under two names is KV sharing: store it once. Across
            # groups it is vLLM's hybrid allocator overlaying groups on one allocation.
            signature = (vllm_group, _signature(kv_caches[layer]))
            if signature in seen:
                continue
            seen.add(signature)
            backend = backend_names.get(layer)
            try:
                split = release.kernel_split(type(spec).__name__, int(spec.block_size), len(vllm_groups))
                if split == 0:
                    raise UnsupportedLayoutError(
                        f"block_size {spec.block_size} is not a multiple of {release.name}'s kernel block "
                        f"{release.hybrid_kernel_block_tokens}")
                gspec = group_spec_of(spec, release, split, _device_type(kv_caches[layer]))
                if layer in tiled_layers and isinstance(kv_caches[layer], torch.Tensor):
                    value, hint, is_page = kv_caches[layer], "page", True
                else:
                    value, hint, is_page = _planes_of(kv_caches[layer], spec, gspec, backend, logical_views)
                _check_blocks(value, release.group_blocks(num_blocks, gspec.compress_ratio) * split, split)
                for tensor in value if isinstance(value, tuple) else (value,):  # shape errors name the layer
                    views, _ = split_planes(tensor, gspec.rows_per_block, "page" if is_page else hint)
                layer_regions = None if is_page or isinstance(value, tuple) else _row_regions(spec, views, release)
            except LayoutError as exc:
                raise type(exc)(f"layer {layer!r}: {exc}") from exc
            key = (vllm_group, gspec, is_page, split)
            if key not in group_index:
                group_index[key] = len(group_specs)
                group_specs.append(gspec)
                sources.append(vllm_group)
                splits.append(split)
            g = group_index[key]
            spec_names.add(type(spec).__name__)
            values[layer] = value
            layer_groups[layer] = tuple([g] * len(value)) if isinstance(value, tuple) else g
            hints[layer] = hint
            if layer_regions is not None:
                regions[layer] = layer_regions
            if recurrent.is_state_spec(spec):
                states.add(recurrent.state_identity(spec, conv_state_layout))
            else:
                quant.add(f"{getattr(spec, 'cache_dtype_str', None)}:{getattr(spec, 'kv_quant_mode', None)}")
            if is_page and not recurrent.is_state_spec(spec):
                page_backends.add("tiled" if layer in tiled_layers else str(backend))
    if not values:
        raise UnsupportedLayoutError("vLLM registered no transferable KV cache")
    layer_names = tuple(values)
    # KV replicated over TP (every group MLA-like) is keyed without the rank: one object per
    # chunk serves every rank. A layout mixing replicated and sharded groups keeps the rank.
    tp_replicated = tp_size > 1 and spec_names <= TP_REPLICATED_SPECS
    ident = {
        "engine": "vllm",
        "pp": f"{pp_rank}/{pp_size}",
        "layers": blake3.blake3("\n".join(layer_names).encode()).hexdigest(length=16),
        "quant": ",".join(sorted(quant)),
        "page_backends": ",".join(sorted(page_backends)),
        **({"states": ",".join(sorted(states))} if states else {}),
        **(identity or {}),
    }
    layout = KVLayout.from_tensors(
        values, groups=group_specs, layer_groups=layer_groups, layout_hints=hints, model_name=model_name,
        tp_rank=0 if tp_replicated else tp_rank, tp_size=tp_size, dcp=dcp, identity=ident, row_regions=regions,
    )
    return Translation(layout=layout, source_groups=tuple(sources), num_vllm_groups=len(vllm_groups),
                       layer_names=layer_names, kernel_splits=tuple(splits), release=release.name,
                       tp_replicated=tp_replicated)


def states_refusal(kv_cache_config: Any, kv_caches: Mapping[str, Any], kv_states: Mapping[str, Any],
                   release: Optional[EngineRelease] = None) -> str:
    """Why a cache registered with per-request ``kv_states`` gets no hit: the release's reason
    (``EngineRelease.states_refusal``) and what its block-addressed caches translate to."""
    groups = list(kv_cache_config.kv_cache_groups)
    specs = [_layer_spec(g.kv_cache_spec, layer) for g in groups for layer in g.layer_names[:1]]
    if release is None:
        release = engine_tables.release_of(specs)
    names = ", ".join(sorted({type(s).__name__ for s in specs})) or "none"
    try:
        translation = translate_kv_caches(kv_cache_config, kv_caches, release=release)
        blocks = (f"its {len(groups)} block-addressed groups ({names}) translate to "
                  f"{len(translation.layout.groups)} kvconnect groups")
    except LayoutError as exc:
        blocks = f"its block-addressed groups ({names}) do not translate either: {exc}"
    reason = release.states_refusal or (
        f"{release.name} registered per-request state buffers (kv_states) that no block id addresses; "
        "a restore would leave them stale")
    return f"{reason}; kv_states of {len(kv_states)} layers; {blocks}"


def _row_regions(spec: Any, views: Sequence[torch.Tensor], release: EngineRelease) -> Optional[RowRegions]:
    """The regions of a layer whose one row plane the release writes split (None: whole rows)."""
    if len(views) != 1 or views[0].dim() < 3:
        return None
    view = views[0]
    row_bytes = int(np.prod(view.shape[2:])) * view.element_size()
    dtype = str(view.dtype).removeprefix("torch.")
    if release.unaudited(spec, dtype, row_bytes):
        raise UnsupportedLayoutError(
            f"{type(spec).__name__} ({getattr(spec, 'cache_dtype_str', None)}, {row_bytes}-byte rows): a packed DeepSeek "
            f"V4 cache whose in-block layout {release.name}'s table does not describe; kvconnect stays off rather than "
            f"guess where each row's fields are")
    return release.row_regions(spec, dtype, row_bytes)


def _check_blocks(value: Any, expected: int, split: int) -> None:
    """Registered tensors must hold every block vLLM may hand out (x the kernel split)."""
    if expected <= 0:
        return
    for t in value if isinstance(value, tuple) else (value,):
        blocks = t.shape[1] if t.dim() == 5 and t.shape[0] == 2 else t.shape[0]
        if t.dim() == 5 and t.shape[0] != 2:
            continue  # FlashInfer [NB, 2, ...]: dim 0 is the block
        if blocks < expected:
            hint = f" ({split} kernel blocks per vLLM block)" if split > 1 else ""
            raise UnsupportedLayoutError(
                f"a {tuple(t.shape)} cache holds {blocks} blocks, fewer than the {expected} vLLM may use{hint}")


# ---------------------------------------------------------------------------------------
# the rest of what the connector reads from vLLM


@dataclass(frozen=True)
class ParallelRanks:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dcp: DCPSpec = DCPSpec()

    @property
    def num_workers(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def worker_index(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    def writes_shared(self, tp_replicated: bool) -> bool:
        """Whether this rank writes the shared places (lower tiers, the node server's pool).

        Every rank does for rank-keyed KV. KV replicated over TP is written by one rank per
        copy: with decode context parallelism each DCP rank's tokens are a copy of their own,
        held by the TP ranks with that DCP rank (vLLM's DCP groups are consecutive TP ranks:
        ``dcp_rank = tp_rank % dcp_size``), so the writers are the ranks whose TP rank equals
        their DCP rank (tp_rank < dcp_size; as SGLang's ``is_storage_writer``).
        """
        return not tp_replicated or self.tp_rank == self.dcp.rank


def parallel_ranks(vllm_config: Any, *, in_worker: bool) -> ParallelRanks:
    """Sizes from the config; this process's ranks too when ``in_worker`` (distributed is up)."""
    par = vllm_config.parallel_config
    tp_size, pp_size = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    dcp_size = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    interleave = int(getattr(par, "cp_kv_cache_interleave_size", 1) or 1)
    if not in_worker:
        return ParallelRanks(tp_size=tp_size, pp_size=pp_size, dcp=DCPSpec(size=dcp_size, interleave_tokens=interleave))
    from vllm.distributed import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank() if tp_size > 1 else 0
    pp_rank = ps.get_pp_group().rank_in_group if pp_size > 1 else 0
    dcp_rank = ps.get_dcp_group().rank_in_group if dcp_size > 1 else 0
    return ParallelRanks(tp_rank, tp_size, pp_rank, pp_size, DCPSpec(rank=dcp_rank, size=dcp_size, interleave_tokens=interleave))


def extra_config(vllm_config: Any) -> dict:
    """``kv_connector_extra_config`` as a plain dict."""
    return dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})


def model_identity(vllm_config: Any) -> str:
    model = vllm_config.model_config
    return f"{model.model}@{getattr(model, 'revision', None) or ''}"


def data_parallel_rank(vllm_config: Any) -> int:
    """This engine's data-parallel rank (0 without data parallelism)."""
    return int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)


def default_channel_address(vllm_config: Any) -> str:
    """An ipc:// prefix that the scheduler and the workers of one engine derive alike."""
    seed = f"{vllm_config.kv_transfer_config.engine_id}|dp{getattr(vllm_config.parallel_config, 'data_parallel_rank', 0)}"
    return f"ipc://{tempfile.gettempdir()}/kvconnect-{blake3.blake3(seed.encode()).hexdigest(length=8)}"


def attention_backend_names(vllm_config: Any, layer_names: Sequence[str]) -> dict[str, str]:
    """Attention backend name of each layer, where vLLM exposes it (else absent)."""
    names: dict[str, str] = {}
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    for layer in layer_names:
        module = context.get(layer)
        try:  # a hint only: a layer that cannot name its backend is treated as row-addressable
            backend = getattr(module, "attn_backend", None)
            if backend is None and hasattr(module, "get_attn_backend"):
                backend = module.get_attn_backend()
            if backend is not None and hasattr(backend, "get_name"):
                names[layer] = str(backend.get_name())
        except Exception:
            continue
    return names


def tiled_layers(vllm_config: Any, layer_names: Sequence[str]) -> list[str]:
    """Layers whose cache module says its rows are tiled across the block (vLLM's ROCm DeepSeek
    V3.2 indexer: ``uses_shuffled_layout``, values in [blk/16, head/16, 16, 16] tiles)."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    out = []
    for layer in layer_names:
        try:  # a property of the layer module; any failure to read it means "not tiled"
            if getattr(context.get(layer), "uses_shuffled_layout", False) is True:
                out.append(layer)
        except Exception:
            continue
    return out


def request_view(request: Any) -> RequestView:
    """A request's prompt and namespace; not cacheable when more than these decides its KV.

    A LoRA adapter (by name and path, as vLLM's own prefix cache keys it) and vLLM's
    per-request ``cache_salt`` change the KV of the same token ids: they form the request's
    namespace, so its chunks are found only by requests with the same adapter and salt.
    Multimodal inputs (placeholder tokens stand for different images) and prompt embeddings
    are not covered by chunk keys: such requests are neither looked up nor saved.
    """
    prompt = getattr(request, "prompt_token_ids", None)
    tokens = np.asarray(prompt if prompt is not None else [], dtype=np.int64)
    namespace = request_namespace(request)
    cacheable = (
        prompt is not None
        and not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
        and namespace is not None
        and len(namespace) <= MAX_NAMESPACE_BYTES
    )
    return RequestView(req_id=request.request_id, prompt_tokens=tokens, num_tokens=int(request.num_tokens),
                       cacheable=bool(cacheable), namespace=namespace or b"")


def request_namespace(request: Any) -> Optional[bytes]:
    """The namespace bytes of a request: empty without LoRA and salt (the keys of plain requests);
    None for an adapter without a name (it cannot be told apart from others: not cached)."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None)
        if not name:
            return None
        parts.append(["lora", str(name), str(getattr(lora, "lora_path", "") or "")])
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(["cache_salt", str(salt)])
    return msgpack.packb(parts) if parts else b""


def all_token_ids(request: Any) -> np.ndarray:
    """A request's prompt and generated token ids so far (vLLM's ``all_token_ids``)."""
    return np.asarray(request.all_token_ids, dtype=np.int64)


def num_computed_tokens(request: Any) -> int:
    return int(request.num_computed_tokens)


def block_ids_of(blocks: Any) -> BlockIds:
    """vLLM's KVCacheBlocks as per-group block ids."""
    return freeze_block_ids(blocks.get_block_ids())


def scheduled_tokens(scheduler_output: Any) -> dict[str, int]:
    return dict(scheduler_output.num_scheduled_tokens)


def preempted_ids(scheduler_output: Any) -> set[str]:
    """Requests whose blocks the scheduler freed for this step (``SchedulerOutput.preempted_req_ids``,
    vLLM 0.23 and 0.32; None when there are none)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def current_block_ids(scheduler_output: Any, kv_cache_manager: Any, req_id: str) -> Optional[BlockIds]:
    """A scheduled request's block ids as the scheduler holds them now (freed blocks as 0)."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    if state is not None:
        ids = state.get_block_ids(req_id)
        if ids is not None:
            return freeze_block_ids(ids)
    if kv_cache_manager is not None:
        return freeze_block_ids(kv_cache_manager.get_block_ids(req_id))
    return None
