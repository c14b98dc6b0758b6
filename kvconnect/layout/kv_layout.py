"""KVLayout: an engine's paged KV memory as groups of planes, plus its identity.

``KVLayout.from_tensors`` is the one entry point: it splits each layer's tensor (or
tuple of tensors) into planes, binds each plane to its group, checks every plane against
its group's geometry, and computes the layout fingerprint that namespaces chunk keys.

Sub-planes: ``row_regions`` names the layers whose blocks keep their rows' fields in
separate regions (``spec.RowRegions``, e.g. vLLM's DeepSeek V4 ``fp8_ds_mla`` block
``[rows x 576][rows x 8]``). Each region becomes a plane of its own, with its in-block offset
in its base address and its own row stride, so every kernel (compiled CPU and CUDA, Triton,
torch) moves each field from where the engine wrote it, whatever row range a copy covers.

The fingerprint covers what decides a stored chunk's bytes (model, dtypes, plane row bytes,
row shapes (heads x head size) and order, group kinds, compress ratios and windows, DCP
shard, format version, and the regions of split planes) and deliberately not the engine's block size or block stride
of token planes: a chunk stored by a deployment with block size 128 is read by one with
block size 32.

It is two parts (docs/design.md, "The identity of a chunk"): the *model identity*
(``model_fingerprint``: everything above, with a head-sharded group's planes counted per
global head, so it is the same at every TP size) and the *part identity*, one ``TPShard`` per
group: nothing of TP for a replicated group, the global head range for a head-sharded one,
the global unit ranges of every field for a group split by ranges (a GDN state page: its
planes enter the model identity as the global fields), rank and size for any other split. ``fingerprint`` hashes both; it never holds the TP rank
of a group that is not split by rank.

Rebuilt groups (``spec.RebuiltGroup``): engine groups that carry no stored bytes because the
engine rebuilds them after a hit (vLLM's per-request rings, bounded-replay windows). They have
no planes; their description enters the fingerprint, and ``resume_every`` tells the restore
gate where a hit may land (``KVLayout.resumable_at``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Optional, Sequence, Union

import blake3
import msgpack
import torch

from .views import drop_aliased_views
from ..errors import LayoutError
from .detect import plane_geometry, split_planes, split_regions
from .rows import GroupGeometry
from .spec import DCPSpec, Fingerprint, GroupKind, GroupSpec, PlaneSpec, RebuiltGroup, RowRegions, ShardKind, TPShard

FORMAT_VERSION = 1

LayerValue = Union[torch.Tensor, Sequence[torch.Tensor]]
GroupAssignment = Union[int, Sequence[int]]
RegionAssignment = Union[RowRegions, Sequence[Optional[RowRegions]]]


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Planes of paged KV memory, grouped, with the identity their chunks are stored under."""

    groups: tuple[GroupSpec, ...]
    planes: tuple[PlaneSpec, ...]
    tensors: tuple[torch.Tensor, ...] = field(repr=False)
    geometries: tuple[GroupGeometry, ...]
    dcp: DCPSpec
    model_name: str
    tp_rank: int
    tp_size: int
    fingerprint: Fingerprint
    identity: tuple[tuple[str, str], ...] = ()  # the extra identity strings, sorted
    shards: tuple[TPShard, ...] = ()  # per group: what of it this TP rank holds (its part identity)
    model_fingerprint: Fingerprint = Fingerprint(b"")  # the TP-free model identity
    rebuilt: tuple[RebuiltGroup, ...] = ()  # groups the engine rebuilds after a hit: identity only, no planes

    @classmethod
    def from_tensors(
        cls,
        kv_caches: Mapping[str, LayerValue],
        *,
        groups: Sequence[GroupSpec],
        layer_groups: Optional[Mapping[str, GroupAssignment]] = None,
        layout_hints: Optional[Union[str, Mapping[str, str]]] = None,
        model_name: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        dcp: DCPSpec = DCPSpec(),
        identity: Optional[Mapping[str, str]] = None,
        row_regions: Optional[Mapping[str, RegionAssignment]] = None,
        group_shards: Optional[Sequence[Optional[TPShard]]] = None,
        rebuilt: Sequence[RebuiltGroup] = (),
    ) -> "KVLayout":
        """Build a layout from ``{layer_name: tensor | tuple_of_tensors}``.

        groups: one GroupSpec per KV-cache group, in the engine's group order.
        layer_groups: group index per layer, or a tuple with one index per plane of a tuple
            value. Omitted: every layer is in group 0 (requires a single group).
        layout_hints: one hint for all layers or one per layer (see layout_detect.HINTS).
        identity: extra strings (e.g. quantisation, kv dtype flags) folded into the fingerprint.
        row_regions: per layer, the ``RowRegions`` of its row planes (or a tuple with one
            entry, possibly None, per tensor of a tuple value): each such plane becomes one
            sub-plane per region, in region order.
        group_shards: per group, what of it this TP rank holds (``TPShard``); None (or a None
            entry): ``TPShard.rank(tp_rank, tp_size)``, read only by the same rank and size.
        rebuilt: the engine's groups that hold no stored bytes because the engine rebuilds them
            after a hit (``spec.RebuiltGroup``): in the fingerprint, and a restore point must be a
            multiple of each one's ``resume_every``.

        Example::

            kv = {"layers.0": torch.zeros(2, 100, 16, 8, 128, dtype=torch.bfloat16)}
            layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=16)])
        """
        groups = tuple(groups)
        if not groups:
            raise LayoutError("a layout needs at least one GroupSpec")
        if not 0 <= tp_rank < tp_size:
            raise LayoutError(f"TP rank {tp_rank} is not in [0, {tp_size})")
        if layer_groups is None:
            if len(groups) != 1:
                raise LayoutError(f"{len(groups)} groups given but no layer_groups to assign layers to them")
            layer_groups = {name: 0 for name in kv_caches}
        missing = [name for name in kv_caches if name not in layer_groups]
        if missing:
            raise LayoutError(f"layers without a group in layer_groups: {missing[:5]}")
        # row regions are given per tensor of the value as registered: check them before aliased
        # views of one blob are dropped (stored once), then drop a dropped view's regions with it
        regions_given = {
            name: _regions_per_tensor(name, (row_regions or {}).get(name),
                                      len(value) if isinstance(value, (tuple, list)) else 1)
            for name, value in kv_caches.items()
        }
        kv_caches, layer_groups, regions_given = drop_aliased_views(kv_caches, layer_groups, regions_given)

        planes: list[PlaneSpec] = []
        tensors: list[torch.Tensor] = []
        for layer_name, value in kv_caches.items():
            values = list(value) if isinstance(value, (tuple, list)) else [value]
            assignment = layer_groups[layer_name]
            group_ids = list(assignment) if isinstance(assignment, (tuple, list)) else [assignment] * len(values)
            if len(group_ids) != len(values):
                raise LayoutError(
                    f"layer {layer_name!r}: {len(values)} tensors but {len(group_ids)} group indices"
                )
            hint = layout_hints.get(layer_name) if isinstance(layout_hints, Mapping) else layout_hints
            regions_of = regions_given[layer_name]
            for tensor, group_index, regions in zip(values, group_ids, regions_of):
                if not isinstance(group_index, int) or not 0 <= group_index < len(groups):
                    raise LayoutError(f"layer {layer_name!r}: group index {group_index!r} not in [0, {len(groups)})")
                group = groups[group_index]
                if not isinstance(tensor, torch.Tensor):
                    raise LayoutError(f"layer {layer_name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
                force_page = group.kind is GroupKind.STATE
                views, is_page = split_planes(tensor, group.rows_per_block, "page" if force_page else hint)
                if regions is not None and is_page:
                    raise LayoutError(f"layer {layer_name!r}: row regions given for a page plane (pages are stored whole)")
                for view in views:
                    where = f"layer {layer_name!r} plane {len([p for p in planes if p.layer_name == layer_name])}"
                    subs = [view] if regions is None else split_regions(view, regions, where)
                    for region_index, view in enumerate(subs):
                        geo = plane_geometry(view, is_page=is_page, where=where)
                        if not is_page and geo["rows_per_block"] != group.rows_per_block:
                            raise LayoutError(
                                f"{where}: {geo['rows_per_block']} rows per block, but group {group_index} "
                                f"(block_size {group.block_size}, compress_ratio {group.compress_ratio}) has "
                                f"{group.rows_per_block}"
                            )
                        planes.append(
                            PlaneSpec(
                                layer_name=layer_name,
                                plane_index=len([p for p in planes if p.layer_name == layer_name]),
                                group_index=group_index,
                                tokens_per_row=group.block_size if is_page else group.compress_ratio,
                                is_page=is_page,
                                region_index=region_index,
                                num_regions=len(subs),
                                **geo,
                            )
                        )
                        tensors.append(view)
        shards = _group_shards(group_shards, len(groups), tp_rank, tp_size)
        return cls._assemble(groups, planes, tensors, dcp, model_name, tp_rank, tp_size, identity or {}, shards,
                             tuple(rebuilt))

    @classmethod
    def _assemble(cls, groups, planes, tensors, dcp, model_name, tp_rank, tp_size, identity, shards,
                  rebuilt: tuple = ()) -> "KVLayout":
        if not planes:
            raise LayoutError("a layout needs at least one plane")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise LayoutError(f"all planes must be on one device, got {sorted(map(str, devices))}")
        geometries = []
        for g, group in enumerate(groups):
            members = [p for p in planes if p.group_index == g]
            if not members:
                raise LayoutError(f"group {g} ({group}) has no planes")
            kinds = {p.is_page for p in members}
            if len(kinds) != 1:
                raise LayoutError(f"group {g} mixes page planes and row planes; split it into two groups")
            is_page = kinds.pop()
            if is_page and dcp.size > 1:
                raise LayoutError(f"group {g}: page planes cannot be sharded by decode context parallel")
            geometries.append(GroupGeometry.of(group, is_page=is_page, dcp=dcp))
        if any(not isinstance(r, RebuiltGroup) for r in rebuilt):
            raise LayoutError(f"rebuilt groups must be RebuiltGroup values, got {rebuilt!r}")
        _check_head_planes(planes, shards)
        model_doc = _model_doc(groups, planes, geometries, dcp, model_name, identity, shards, rebuilt)
        model_fingerprint = Fingerprint(blake3.blake3(msgpack.packb(model_doc)).digest(16))
        fingerprint = layout_fingerprint(model_fingerprint, shards)
        return cls(
            groups=tuple(groups),
            planes=tuple(planes),
            tensors=tuple(tensors),
            geometries=tuple(geometries),
            dcp=dcp,
            model_name=model_name,
            tp_rank=tp_rank,
            tp_size=tp_size,
            fingerprint=fingerprint,
            identity=tuple(sorted(identity.items())),
            shards=tuple(shards),
            model_fingerprint=model_fingerprint,
            rebuilt=rebuilt,
        )

    def with_identity(self, *, model_name: Optional[str] = None,
                      identity: Optional[Mapping[str, str]] = None) -> "KVLayout":
        """This layout under another model name and/or more identity strings (its fingerprint,
        and so every chunk key, changes): the fingerprint ``from_tensors`` gives for them."""
        name = self.model_name if model_name is None else model_name
        extra = {**dict(self.identity), **(identity or {})}
        if name == self.model_name and extra == dict(self.identity):
            return self
        return self._assemble(self.groups, self.planes, self.tensors, self.dcp, name, self.tp_rank, self.tp_size, extra,
                              self.shards, self.rebuilt)

    def with_sliced_planes(self, slices: Mapping[int, int]) -> "KVLayout":
        """This layout with plane ``i`` cut into ``slices[i]`` column slices (``PlaneSpec``):
        each holds consecutive bytes of every row, 16-byte aligned widths (the last one shorter),
        so no kernel sees a new kind of plane. Groups, block ids and rows are unchanged; the
        fingerprint records the slices."""
        if not slices:
            return self
        planes, tensors = [], []
        per_layer: dict[str, int] = {}
        for i, (p, t) in enumerate(zip(self.planes, self.tensors)):
            n = int(slices.get(i, 1))
            if n <= 1:
                pieces = [(p, t)]
            else:
                width = -(-p.row_bytes // n)
                width = -(-width // 16) * 16 if p.row_bytes > 16 * n else width
                cuts = [(c, min(c + width, p.row_bytes)) for c in range(0, p.row_bytes, width)]
                elem = t.element_size()
                flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                base = t.storage_offset() * elem
                pieces = []
                for k, (a, b) in enumerate(cuts):
                    view = torch.as_strided(flat, (p.num_blocks, p.rows_per_block, b - a),
                                            (p.block_stride_bytes, p.row_stride_bytes, 1), base + a)
                    pieces.append((dataclasses.replace(p, row_bytes=b - a, dtype="uint8", slice_index=k,
                                                       num_slices=len(cuts)), view))
            for spec, view in pieces:
                index = per_layer.get(spec.layer_name, 0)
                per_layer[spec.layer_name] = index + 1
                planes.append(dataclasses.replace(spec, plane_index=index))
                tensors.append(view)
        return self._assemble(self.groups, planes, tensors, self.dcp, self.model_name, self.tp_rank, self.tp_size,
                              dict(self.identity), self.shards, self.rebuilt)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @cached_property
    def resume_every(self) -> int:
        """Restore points must be multiples of this many tokens: the least common multiple of the
        rebuilt groups' ``resume_every`` (1 without rebuilt groups)."""
        return math.lcm(1, *(r.resume_every for r in self.rebuilt))

    def resumable_at(self, boundary: int) -> bool:
        """Whether the engine can rebuild every rebuilt group after a restore at ``boundary``."""
        return boundary % self.resume_every == 0

    @cached_property
    def _group_num_blocks(self) -> tuple[int, ...]:
        return tuple(min(p.num_blocks for p in self.planes if p.group_index == g) for g in range(len(self.groups)))

    def group_num_blocks(self, group_index: int) -> int:
        """Blocks addressable by every plane of a group (ids must be below this)."""
        return self._group_num_blocks[group_index]

    def planes_of_group(self, group_index: int) -> list[int]:
        return [i for i, p in enumerate(self.planes) if p.group_index == group_index]

    def describe(self) -> list[dict]:
        """One row per group: kind, geometry, planes and bytes per row (for tables and docs)."""
        out = []
        for g, (group, geo) in enumerate(zip(self.groups, self.geometries)):
            members = [self.planes[i] for i in self.planes_of_group(g)]
            out.append(
                dict(
                    group=g,
                    kind=group.kind.value,
                    block_size=group.block_size,
                    compress_ratio=group.compress_ratio,
                    window=geo.window_tokens,
                    window_free_every=geo.window_free_every,
                    num_planes=len(members),
                    row_bytes_per_row=sum(p.row_bytes for p in members),
                )
            )
        return out


def _regions_per_tensor(layer_name: str, given: Optional[RegionAssignment], count: int) -> list[Optional[RowRegions]]:
    if given is None:
        return [None] * count
    if isinstance(given, RowRegions):
        return [given] * count
    out = list(given)
    if len(out) != count or any(r is not None and not isinstance(r, RowRegions) for r in out):
        raise LayoutError(f"layer {layer_name!r}: row_regions needs one RowRegions or None per tensor ({count}), got {given!r}")
    return out


def _group_shards(given, num_groups: int, tp_rank: int, tp_size: int) -> tuple[TPShard, ...]:
    default = TPShard.rank(tp_rank, tp_size)
    if given is None:
        return (default,) * num_groups
    given = list(given)
    if len(given) != num_groups or any(s is not None and not isinstance(s, TPShard) for s in given):
        raise LayoutError(f"group_shards needs one TPShard or None per group ({num_groups}), got {given!r}")
    return tuple(default if s is None else s for s in given)


def _check_head_planes(planes, shards) -> None:
    """Every plane of a head-sharded group holds its rank's heads as equal slices of each row;
    every plane of a group split by ranges is a row of its shard's fields."""
    for p in planes:
        shard = shards[p.group_index]
        if shard.kind is ShardKind.HEADS and p.num_slices == 1 and p.row_bytes % shard.count:
            raise LayoutError(f"layer {p.layer_name!r} plane {p.plane_index}: rows of {p.row_bytes} bytes do not "
                              f"split into the {shard.count} heads of its group's TP shard")
        if shard.kind is ShardKind.RANGES and p.num_slices == 1 and (p.num_regions > 1 or p.row_bytes != shard.row_bytes):
            raise LayoutError(f"layer {p.layer_name!r} plane {p.plane_index}: a row of {p.row_bytes} bytes is not its "
                              f"group's TP fields ({shard.row_bytes} bytes, whole rows only)")


def _per_head_plane(p: PlaneSpec, shard: TPShard) -> list:
    """A plane's entry in the model identity: a head-sharded group's per global head (and the
    global head count), so it is the same at every TP size."""
    if shard.kind is ShardKind.RANGES and p.num_slices == 1:  # the global fields: the same at every TP size
        return [p.group_index, p.dtype, "fields", [f.geometry() for f in shard.fields], p.tokens_per_row, p.is_page]
    if shard.kind is not ShardKind.HEADS or p.num_slices > 1:  # a column slice is no head range: strict
        return [p.group_index, p.dtype, p.row_bytes, p.tokens_per_row, p.is_page]
    return [p.group_index, p.dtype, p.row_bytes // shard.count, p.tokens_per_row, p.is_page, "per_head", shard.total]


def _per_head_shape(p: PlaneSpec, shard: TPShard) -> list:
    if shard.kind is ShardKind.RANGES:  # a rank's share; the plane entry holds the global fields (or the slice's bytes)
        return ["fields"]
    shape = list(p.row_shape)
    if shard.kind is ShardKind.HEADS and shape and p.num_slices == 1:
        if shape[0] % shard.count == 0:
            shape[0] //= shard.count
        else:  # heads are not the leading dim: the per-head bytes (already in the plane entry) decide
            shape = ["bytes", p.row_bytes // shard.count]
    return shape


def layout_fingerprint(model_fingerprint: Fingerprint, shards) -> Fingerprint:
    """The layout fingerprint: the model identity and each group's part identity."""
    doc = {"model": bytes(model_fingerprint), "shards": [s.identity() for s in shards]}
    return Fingerprint(blake3.blake3(msgpack.packb(doc)).digest(16))


def _model_doc(groups, planes, geometries, dcp, model_name, identity, shards, rebuilt=()) -> dict:
    doc = {
        "format": FORMAT_VERSION,
        "model": model_name,
        "identity": sorted(identity.items()),
        "dcp": [dcp.rank, dcp.size, dcp.interleave_tokens],
        "groups": [
            [g.kind.value, geo.tokens_per_row, geo.window_tokens, geo.aligned_boundary]
            for g, geo in zip(groups, geometries)
        ],
        "planes": [_per_head_plane(p, shards[p.group_index]) for p in planes],
    }
    if any(geo.window_free_every for geo in geometries):
        # Chunks stored under a window-free rule lack the group's rows (and their window pieces hold
        # other planes): a deployment without the rule (or with another) must never read them, nor
        # they its. Layouts without a rule keep the fingerprint they had before the rule existed.
        doc["window_free_every"] = [geo.window_free_every for geo in geometries]
    if any(p.num_regions > 1 for p in planes):
        # Chunks of split planes hold each region's rows apart; before sub-planes existed such
        # caches were stored as wide rows (wrong bytes within a block): never match those.
        doc["regions"] = [[p.region_index, p.num_regions] for p in planes]
    if any(p.num_slices > 1 for p in planes):
        # a sliced plane's chunk rows are stored in column slices: never read as whole rows
        doc["slices"] = [[p.slice_index, p.num_slices] for p in planes]
    if rebuilt:
        # groups stored without bytes (the engine rebuilds them): another engine layout's chunks
        # (the same groups stored, or other rebuilt groups) must never be read, nor ours by it
        doc["rebuilt"] = [[r.what, r.resume_every] for r in rebuilt]
    # rows of equal bytes split otherwise (4 heads x 128 vs 8 x 64) are other models' KV
    doc["row_shapes"] = [_per_head_shape(p, shards[p.group_index]) for p in planes]
    return doc
