"""Translate vLLM's (and vLLM-Ascend's) KV-cache description into kvconnect's.

With its neighbours (below), the only modules that read vLLM objects. They read
them by attribute and class name and import vLLM lazily (parallel ranks only), so they are
unit-tested with look-alike objects on machines without vLLM.

    t = translate_kv_caches(kv_cache_config, kv_caches, backend_names=..., ...)
    t.layout                 KVLayout over every plane of every transferable group
    t.block_tables(ids)      vLLM per-group block ids -> kvconnect per-group int64 arrays

Groups. Each vLLM group becomes one kvconnect group (two when it mixes opaque pages and
token rows); a kvconnect group reads the block ids of the vLLM group it came from. Which
GroupSpec a vLLM spec becomes is the table in ``specs`` (``group_spec_of``). Groups vLLM
rebuilds after a hit (rings, bounded-replay windows: ``rebuilt``) become no kvconnect group:
they are stored without bytes, as ``RebuiltGroup`` entries of the layout's identity that
restrict where a hit lands (``KVLayout.resume_every``).

Tensors (one value per layer). Which planes a registered value becomes is the table in
``tensors`` (``planes_of``); a layer whose module reports a tiled layout (``tiled_layers``)
is one opaque page per block.

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

Tensor parallelism. Each group's part identity (``TPShard``, docs/design.md "The identity of
a chunk") says what of it this rank holds: a group whose spec is in ``TP_REPLICATED_SPECS``
(MLA-like: the same cache on every TP rank) is replicated and carries nothing of TP, so every
rank of every TP size computes the same keys; an attention group holds the global KV heads
vLLM's split gives the rank (``TPShard.of_kv_heads`` of ``total_kv_heads``) and carries that
range, not the rank; a recurrent state group (and an attention group whose heads do not match
vLLM's split, or without ``total_kv_heads``) carries rank and size; a Gated DeltaNet state
group carries the global channel and value-head ranges its page holds (``recurrent.state_shard``,
given the model's ``gdn_dims``), any other recurrent state rank and size. A layout whose every group
is replicated is ``Translation.tp_replicated``: only the rank that ``ParallelRanks.writes_shared``
names writes the shared tiers (docs/vllm.md, "Replicated KV"); a rank whose every group holds
what a lower rank holds (KV heads < TP, no state ranges of its own) is ``head_copy``.

The null block (id 0) marks blocks a request does not hold (sliding-window blocks that left
the window): it becomes -1. Layers of one group that share a tensor are stored once.

The neighbours, one concept each (import from them): ``specs`` (spec -> GroupSpec),
``tensors`` (registered value -> planes, its checks, the layer modules' hints), ``ranks``
(``ParallelRanks``, ``parallel_ranks``, ``data_parallel_rank``) and ``request_reads``
(requests and scheduler output).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import blake3
import numpy as np
import torch

from kvconnect.errors import BlockTableError, LayoutError, UnsupportedLayoutError
from kvconnect.layout.kv_layout import KVLayout
from kvconnect.layout.detect import detect_hint, split_planes
from kvconnect.layout.model_identity import model_identity as layout_model_identity
from kvconnect.layout.spec import DCPSpec, GroupSpec, RowRegions, ShardKind, TPShard

from . import engine_tables, rebuilt, recurrent
from .engine_tables import EngineRelease
from .metadata import BlockIds, freeze_block_ids
from .specs import TP_REPLICATED_SPECS, layer_spec_of, group_spec_of, num_heads_of
from .tensors import check_blocks, planes_of, row_regions_of, tensor_device_type, tensor_signature

__all__ = ["NULL_BLOCK_ID", "Translation", "translate_kv_caches", "shard_of", "states_refusal", "extra_config", "model_identity"]

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
"""vLLM's null block: a real block that no request owns and no valid position reads."""


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
    head_copy: bool = False  # this rank holds the very heads a lower TP rank holds (KV heads < TP): a replica of it

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
    total_kv_heads: Optional[int] = None,
    gdn_dims: Optional[recurrent.GDNDims] = None,
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
    total_kv_heads: the model's KV heads over all TP ranks (``ModelConfig.get_total_num_kv_heads``):
        attention groups are then keyed by the global heads this rank holds (``shard_of``).
    gdn_dims: the model's Gated DeltaNet dims (``recurrent.gdn_dims``): its state groups are then
        keyed by the global ranges this rank holds (``recurrent.state_shard``).

    Raises UnsupportedLayoutError for caches that cannot be restored exactly, LayoutError
    for shapes that do not fit their spec; nothing is registered in either case.
    """
    backend_names = backend_names or {}
    vllm_groups = list(kv_cache_config.kv_cache_groups)
    transferable = set(getattr(kv_cache_config, "transfer_group_ids", range(len(vllm_groups))))
    logical_views = hasattr(kv_cache_config, "kv_cache_layout")  # vLLM >= 0.32 registers [B, H, N, C]
    if release is None:
        release = engine_tables.release_of(
            [layer_spec_of(g.kv_cache_spec, layer) for g in vllm_groups for layer in g.layer_names[:1]]
            + [s for g in vllm_groups if type(g.kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
               for s in g.kv_cache_spec.kv_cache_specs.values()])
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)

    group_index: dict[tuple, int] = {}
    group_specs: list[GroupSpec] = []
    group_shards: list[set] = []
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
    # groups vLLM rebuilds after a hit (rings, bounded-replay windows): identity only, no planes
    rebuilt_groups = rebuilt.rebuilt_groups(kv_cache_config, release, dcp.size)
    rebuilt_ids = set(rebuilt.rebuilt_group_ids(kv_cache_config))
    for vllm_group, group in enumerate(vllm_groups):
        if vllm_group not in transferable or vllm_group in rebuilt_ids:
            continue
        for layer in group.layer_names:
            if layer not in kv_caches:  # runner-only layers have no registered cache
                continue
            spec = layer_spec_of(group.kv_cache_spec, layer)
            # Within a group, one tensor under two names is KV sharing: store it once. Across
            # groups it is vLLM's hybrid allocator overlaying groups on one allocation.
            signature = (vllm_group, tensor_signature(kv_caches[layer]))
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
                gspec = group_spec_of(spec, release, split, tensor_device_type(kv_caches[layer]))
                if layer in tiled_layers and isinstance(kv_caches[layer], torch.Tensor):
                    value, hint, is_page = kv_caches[layer], "page", True
                else:
                    value, hint, is_page = planes_of(kv_caches[layer], spec, gspec, backend, logical_views)
                check_blocks(value, release.group_blocks(num_blocks, gspec.compress_ratio) * split, split)
                for tensor in value if isinstance(value, tuple) else (value,):  # shape errors name the layer
                    views, _ = split_planes(tensor, gspec.rows_per_block, "page" if is_page else hint)
                layer_regions = None if is_page or isinstance(value, tuple) else row_regions_of(spec, views, release)
            except LayoutError as exc:
                raise type(exc)(f"layer {layer!r}: {exc}") from exc
            key = (vllm_group, gspec, is_page, split)
            if key not in group_index:
                group_index[key] = len(group_specs)
                group_specs.append(gspec)
                group_shards.append(set())
                sources.append(vllm_group)
                splits.append(split)
            g = group_index[key]
            per_head = not is_page and any((hint or detect_hint(t, gspec.rows_per_block)).startswith("hnd")
                                           for t in (value if isinstance(value, tuple) else (value,)))
            # one plane per head (HND) holds no head range as a row's leading slices: keyed by rank
            if recurrent.is_state_spec(spec):
                shard = recurrent.state_shard(spec, gdn_dims, conv_state_layout, tp_rank=tp_rank, tp_size=tp_size)
            elif per_head:
                shard = TPShard.rank(tp_rank, tp_size)
            else:
                shard = shard_of(spec, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=total_kv_heads)
            group_shards[g].add(shard)
            spec_names.add(type(spec).__name__)
            values[layer] = value
            layer_groups[layer] = tuple([g] * len(value)) if isinstance(value, tuple) else g
            hints[layer] = hint
            if layer_regions is not None:
                regions[layer] = layer_regions
            if recurrent.is_state_spec(spec):
                keyed = shard.kind is ShardKind.RANGES  # by global ranges: the global shapes, TP-free
                states.add(recurrent.state_identity(spec, conv_state_layout, recurrent.global_state_shapes(
                    spec, gdn_dims, conv_state_layout, tp_size) if keyed else None))
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
        tp_rank=tp_rank, tp_size=tp_size, dcp=dcp, identity=ident, row_regions=regions,
        group_shards=[shards.pop() if len(shards) == 1 else TPShard.rank(tp_rank, tp_size) for shards in group_shards],
        rebuilt=rebuilt_groups,
    )
    # fewer KV heads than ranks: vLLM gives each head to tp / heads consecutive ranks, which name it
    # alike; where every group of this rank is what a lower rank holds (no state ranges of its own),
    # the first of them writes the shared tiers, the others read its objects (as replicated KV)
    head_copy = not tp_replicated and _copy_of_lower_rank(layout.shards, tp_rank, tp_size)
    return Translation(layout=layout, source_groups=tuple(sources), num_vllm_groups=len(vllm_groups),
                       layer_names=layer_names, kernel_splits=tuple(splits), release=release.name,
                       tp_replicated=tp_replicated, head_copy=head_copy)


def _copy_of_lower_rank(shards: Sequence[TPShard], tp_rank: int, tp_size: int) -> bool:
    """Whether a lower TP rank holds exactly this rank's part of every group (the same objects)."""
    try:
        return any(all(s.at(r, tp_size) == s for s in shards) for r in range(tp_rank))
    except LayoutError:  # a group keyed by rank: its objects are this rank's own
        return False


def shard_of(spec: Any, *, tp_rank: int, tp_size: int, total_kv_heads: Optional[int]) -> TPShard:
    """What of a layer's cache TP rank ``tp_rank`` of ``tp_size`` holds (its part identity):
    replicated for ``TP_REPLICATED_SPECS``; the global KV heads of vLLM's split for attention
    whose per-rank head count is that split's; rank and size otherwise (recurrent states are
    keyed by ``recurrent.state_shard``)."""
    if type(spec).__name__ in TP_REPLICATED_SPECS:
        return TPShard.replicated()
    if recurrent.is_state_spec(spec) or not total_kv_heads:
        return TPShard.rank(tp_rank, tp_size)
    try:
        shard = TPShard.of_kv_heads(int(total_kv_heads), tp_rank=tp_rank, tp_size=tp_size)
        heads = num_heads_of(spec)
    except (LayoutError, AttributeError, TypeError, ValueError):
        return TPShard.rank(tp_rank, tp_size)
    return shard if heads == shard.count else TPShard.rank(tp_rank, tp_size)


def states_refusal(kv_cache_config: Any, kv_caches: Mapping[str, Any], kv_states: Mapping[str, Any],
                   release: Optional[EngineRelease] = None) -> str:
    """Why a cache registered with per-request ``kv_states`` gets no hit: the release's reason
    (``EngineRelease.states_refusal``) and what its block-addressed caches translate to."""
    groups = list(kv_cache_config.kv_cache_groups)
    specs = [layer_spec_of(g.kv_cache_spec, layer) for g in groups for layer in g.layer_names[:1]]
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


# ---------------------------------------------------------------------------------------
# what else the connector reads from vLLM's config (ranks: ``ranks``; requests: ``request_reads``)


def extra_config(vllm_config: Any) -> dict:
    """``kv_connector_extra_config`` as a plain dict."""
    return dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})


def model_identity(vllm_config: Any) -> str:
    """``name@revision#digest`` of the model vLLM serves (``kvconnect.layout.model_identity``):
    shared tiers key chunks by it, so two deployments share KV only when they serve the same model."""
    model = vllm_config.model_config
    return layout_model_identity(model.model, getattr(model, "revision", None), getattr(model, "hf_config", None),
                                 getattr(model, "dtype", None), getattr(model, "quantization", None))

