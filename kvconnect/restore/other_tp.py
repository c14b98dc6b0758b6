"""Reads across tensor-parallel sizes: a rank restores chunks that ranks of another TP size
wrote (issue 40; docs/design.md, "The identity of a chunk and what varies with parallelism").

A layout's fingerprint is its TP-free model identity and one part identity (``TPShard``) per
group (``kv_layout``). A writer rank of TP size ``s`` therefore stored its objects under a
fingerprint this rank can compute without having met it: the same model identity, with each
group's part as rank ``r`` of ``s`` holds it (``TPShard.at``: a head-sharded group's heads as
vLLM splits them, a group split by ranges (a Gated DeltaNet state page) each field's ranges,
a replicated group unchanged; ``writer_shards``). ``sources_at`` lists the writer ranks whose
parts together hold this rank's (one rank per distinct part: ranks that hold the same ranges
hold the same bytes); ``assemble`` cuts this rank's units (heads, channels, value heads) out of
their objects, row by row and field by field, into one payload in this rank's own format,
which the engine commits into its pool under its own key (``OtherTPReader``,
other_tp_reads.py). A group keyed by rank or a plane whose rows are not its part's fields (one
plane per head, column slices, row regions) is never read across sizes: the layout is then not
``cross_readable``.

An object read may be a whole chunk, a prefix part or the window pieces of a chunk (restore
points, parts.py): the writer's pieces group planes by the writer's byte sizes
(``writer_layout`` is the writer's geometry, from which its pieces follow), and ``assemble``
takes all of one writer rank's objects of a chunk together and builds any selection of this
rank's planes (its own pieces). Every object read is verified against the writer's fingerprint
and key (``chunk_format``), and the writers' objects must agree on the chunk's token range,
groups and rows per plane, and cover every unit this rank holds, so a read across sizes is a
miss or the right bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..chunks.chunk_format import ChunkHeader
from ..errors import LayoutError
from ..layout.kv_layout import KVLayout, layout_fingerprint
from ..layout.spec import Fingerprint, ShardKind, TPShard

Objects = Sequence[tuple[ChunkHeader, memoryview]]  # one writer rank's objects of one chunk


def cross_readable(layout: KVLayout) -> bool:
    """Whether this layout's chunks can be assembled from another TP size's objects: every
    group replicated, head-sharded or split by ranges, at least one not replicated, every plane
    of a head-sharded group a row (or page) of its ``count`` heads as equal leading slices, and
    every plane of a group split by ranges a row of its fields."""
    kinds = {s.kind for s in layout.shards}
    if ShardKind.RANK in kinds or kinds <= {ShardKind.REPLICATED}:
        return False
    for p in layout.planes:
        shard = layout.shards[p.group_index]
        if shard.kind is ShardKind.HEADS and (p.num_slices > 1 or p.num_regions > 1 or not p.row_shape
                                              or p.row_shape[0] != shard.count):
            return False
        if shard.kind is ShardKind.RANGES and shard.row_fields(p.row_bytes) is None:
            return False
    return True


def writer_shards(layout: KVLayout, tp_size: int, tp_rank: int) -> Optional[tuple[TPShard, ...]]:
    """Each group's part identity at rank ``tp_rank`` of TP size ``tp_size``; None where the
    layout is not cross-readable or the size does not split its heads or ranges."""
    if not cross_readable(layout):
        return None
    try:
        return tuple(shard.at(tp_rank, tp_size) for shard in layout.shards)
    except LayoutError:
        return None


def writer_row_bytes(layout: KVLayout, shards: Sequence[TPShard]) -> tuple[int, ...]:
    """Per plane, the bytes of a row in the objects of a writer holding ``shards``."""
    out = []
    for p in layout.planes:
        own, theirs = layout.shards[p.group_index], shards[p.group_index]
        if own.kind is ShardKind.HEADS:
            out.append(p.row_bytes // own.count * theirs.count)
        elif own.kind is ShardKind.RANGES:
            out.append(theirs.row_bytes)
        else:
            out.append(p.row_bytes)
    return tuple(out)


def writer_layout(layout: KVLayout, shards: Sequence[TPShard]) -> KVLayout:
    """The layout a writer holding ``shards`` stored under, as geometry only (its planes' row
    bytes, its fingerprint; this rank's tensors, never moved through it): what decides the
    writer's chunk parts and pieces (``PartLayout.of``)."""
    planes = tuple(dataclasses.replace(p, row_bytes=w, row_stride_bytes=max(p.row_stride_bytes, w))
                   for p, w in zip(layout.planes, writer_row_bytes(layout, shards)))
    return dataclasses.replace(layout, planes=planes, shards=tuple(shards),
                               fingerprint=layout_fingerprint(layout.model_fingerprint, shards))


def refusal(layout: KVLayout, tp_size: int) -> Optional[str]:
    """Why a rank of this layout can never restore what ranks of TP size ``tp_size`` stored,
    or None where it can: the same size, every group replicated (TP-free objects, the same
    for every size), or every writer part readable (``sources_at``, or the writers' objects
    are this rank's own). Named for a caller that must decide before anything is looked up
    (a P/D decode side whose producer runs another TP size, integrations/vllm/pd.py)."""
    if tp_size == layout.tp_size:
        return None
    kinds = [s.kind for s in layout.shards]
    if all(k is ShardKind.REPLICATED for k in kinds):
        return None
    ranked = [g for g, k in enumerate(kinds) if k is ShardKind.RANK]
    if ranked:
        return (f"KV-cache group(s) {ranked} are split over TP ranks in a way kvconnect keys by rank (layouts it "
                "does not describe by heads or ranges): what another TP size stored is never theirs")
    if not cross_readable(layout):
        return ("a group's rows are not its heads as equal leading slices or its state fields as whole rows (one "
                "plane per head, column slices or row regions): they cannot be cut into another TP size's parts")
    for g, shard in enumerate(layout.shards):
        try:
            for rank in range(tp_size):
                shard.at(rank, tp_size)
        except LayoutError:
            what = f"{shard.total} KV heads" if shard.kind is ShardKind.HEADS else "state fields (channel / head blocks)"
            return f"TP {tp_size} does not split KV-cache group {g}'s {what}"
    return None


@dataclass(frozen=True)
class Sources:
    """The writer ranks of one TP size whose objects together hold this rank's part."""

    tp_size: int
    ranks: tuple[int, ...]
    shards: tuple[tuple[TPShard, ...], ...]  # per rank: its part identity per group
    fingerprints: tuple[Fingerprint, ...]  # per rank: the fingerprint its objects carry


def _overlaps(own: TPShard, theirs: TPShard) -> bool:
    if own.kind is ShardKind.HEADS:
        return min(own.end, theirs.end) > max(own.first, theirs.first)
    if own.kind is ShardKind.RANGES:
        return any(min(b, d) > max(a, c) for f, t in zip(own.fields, theirs.fields)
                   for a, b in f.ranges for c, d in t.ranges)
    return False


def sources_at(layout: KVLayout, tp_size: int) -> Optional[Sources]:
    """Writer ranks at ``tp_size`` to read this rank's part from, one per distinct part; None
    where none can be (not cross-readable, a size that does not split the heads or ranges) or
    where the writers' objects would be this rank's own (same parts: the ordinary path reads them)."""
    own = tuple(layout.shards)
    ranks, shards, seen = [], [], set()
    for rank in range(tp_size):
        theirs = writer_shards(layout, tp_size, rank)
        if theirs is None:
            return None
        if theirs == own:
            return None  # the same objects as this rank's own: nothing to translate
        if any(_overlaps(s, t) for s, t in zip(own, theirs)) and theirs not in seen:
            seen.add(theirs)
            ranks.append(rank)
            shards.append(theirs)
    if not ranks:
        return None
    prints = tuple(layout_fingerprint(layout.model_fingerprint, s) for s in shards)
    return Sources(tp_size, tuple(ranks), tuple(shards), prints)


def _plane_views(layout: KVLayout, widths: Sequence[int], objects: Objects) -> Optional[dict[int, tuple[int, int, np.ndarray]]]:
    """One writer rank's rows per plane over its objects of a chunk: plane -> (first row, rows,
    ``[rows, row bytes]`` view); None where an object does not fit the writer's geometry."""
    out: dict[int, tuple[int, int, np.ndarray]] = {}
    for header, payload in objects:
        if len(header.plane_rows) != len(layout.planes):
            return None
        sizes = [n * w for (_, n), w in zip(header.plane_rows, widths)]
        if sum(sizes) != header.payload_bytes or len(payload) != header.payload_bytes:
            return None
        at = 0
        for i, ((first, n), size) in enumerate(zip(header.plane_rows, sizes)):
            if n:
                if i in out:  # a plane in two objects of one chunk: not what a writer stores
                    return None
                out[i] = (first, n, np.frombuffer(payload, dtype=np.uint8, count=size, offset=at).reshape(n, widths[i]))
            at += size
    return out


def _copy_fields(dest: np.ndarray, own: TPShard, row_bytes: int, sources: Sequence[tuple[TPShard, np.ndarray]]) -> bool:
    """This rank's row fields from the writers' rows (``sources``: their part of this group, their
    ``[rows, bytes]`` view), each unit from the first writer holding it (writers that differ in
    another group may hold the same heads here: vLLM's one KV head on both TP 2 ranks); False
    where the writers do not cover every unit, or hold part of a range another one holds."""
    mine = own.row_fields(row_bytes)
    n = dest.shape[0]
    at = 0
    theirs_at = [0] * len(sources)
    for k, f in enumerate(mine):
        out = dest[:, at: at + f.row_bytes].reshape(n, f.outer, f.units, f.unit_bytes)
        done = np.zeros(f.total, np.bool_)
        for s, (shard, view) in enumerate(sources):
            fields = shard.row_fields(view.shape[1])
            if fields is None or len(fields) != len(mine):
                return False
            t = fields[k]
            if (t.outer, t.unit_bytes, t.blocks) != (f.outer, f.unit_bytes, f.blocks):
                return False
            src = view[:, theirs_at[s]: theirs_at[s] + t.row_bytes].reshape(n, t.outer, t.units, t.unit_bytes)
            theirs_at[s] += t.row_bytes
            u0 = 0
            for a, b in f.ranges:
                w0 = 0
                for c, d in t.ranges:
                    lo, hi = max(a, c), min(b, d)
                    if hi > lo and not done[lo:hi].all():
                        if done[lo:hi].any():  # one size's parts are equal or disjoint: never a partial overlap
                            return False
                        out[:, :, u0 + lo - a: u0 + hi - a] = src[:, :, w0 + lo - c: w0 + hi - c]
                        done[lo:hi] = True
                    w0 += d - c
                u0 += b - a
        if any(not done[a:b].all() for a, b in f.ranges):
            return False
        at += f.row_bytes
    return True


def assemble(layout: KVLayout, sources: Sources, objects: Sequence[Objects],
             planes: Optional[np.ndarray] = None) -> Optional[tuple[tuple[tuple[int, int], ...], np.ndarray, int]]:
    """This rank's object of one chunk from the writers' objects (``objects[i]``: every object
    of ``sources.ranks[i]`` for the chunk, e.g. all its window pieces): ``(plane_rows, payload,
    group_mask)`` of the planes ``planes`` selects (None: every plane the objects hold), or None
    where the objects disagree (token range, groups, rows per plane), do not fit the writers'
    geometry or do not cover this rank's part."""
    if len(objects) != len(sources.ranks) or not objects or not objects[0]:
        return None
    first = objects[0][0][0]
    group_mask = first.group_mask
    for mine in objects:
        if len(mine) != len(objects[0]):
            return None
        for (h, _), (ref, _) in zip(mine, objects[0]):
            if (h.token_start, h.token_end, h.group_mask) != (first.token_start, first.token_end, ref.group_mask):
                return None
    for h, _ in objects[0]:
        group_mask &= h.group_mask
    views = []
    for shards, mine in zip(sources.shards, objects):
        got = _plane_views(layout, writer_row_bytes(layout, shards), mine)
        if got is None:
            return None
        views.append(got)
    held = sorted(views[0])
    if any(sorted(v) != held or any(v[i][:2] != views[0][i][:2] for i in held) for v in views):
        return None
    chosen = [i for i in held if planes is None or planes[i]]
    plane_rows = [(0, 0)] * len(layout.planes)
    sizes = {i: views[0][i][1] * layout.planes[i].row_bytes for i in chosen}
    out = np.empty(sum(sizes.values()), dtype=np.uint8)
    at = 0
    for i in chosen:  # plane order, as a store writes a payload
        p, (first_row, n, _) = layout.planes[i], views[0][i]
        plane_rows[i] = (first_row, n)
        dest = out[at: at + sizes[i]].reshape(n, p.row_bytes)
        at += sizes[i]
        own = layout.shards[p.group_index]
        if own.kind is ShardKind.REPLICATED:
            dest[:] = views[0][i][2]
        elif not _copy_fields(dest, own, p.row_bytes, [(s[p.group_index], v[i][2]) for s, v in zip(sources.shards, views)]):
            return None
    return tuple(plane_rows), out, group_mask
