"""Reads across tensor-parallel sizes: a rank restores chunks that ranks of another TP size
wrote (issue 40; docs/design.md, "The identity of a chunk and what varies with parallelism").

A layout's fingerprint is its TP-free model identity and one part identity (``TPShard``) per
group (``kv_layout``). A writer rank of TP size ``s`` therefore stored its objects under a
fingerprint this rank can compute without having met it: the same model identity, with each
head-sharded group's range as vLLM splits the global heads at ``s`` (``writer_shards``) and
each replicated group unchanged. ``sources_at`` lists the writer ranks whose head ranges
together hold this rank's (one rank per distinct range: ranks that hold the same heads hold
the same bytes); ``assemble`` cuts this rank's heads out of their objects, row by row, into
one payload in this rank's own format, which the engine commits into its pool under its own
key (``OtherTPReader``, engine.py). A group split by rank (recurrent states) or a plane whose
rows are not the rank's heads as equal leading slices (one plane per head, column slices, row
regions) is never read across sizes: the layout is then not ``cross_readable``.

Only objects that hold every group's rows of a chunk (``WholeChunks``) are read this way: a
chunk's window pieces group planes by their byte sizes, which differ with the TP size.
Every object read is verified against the writer's fingerprint and key (``chunk_format``), and
the writers' objects must agree on the chunk's token range, groups and rows per plane, so a
read across sizes is a miss or the right bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..chunks.chunk_format import ChunkHeader
from ..errors import LayoutError
from ..layout.kv_layout import KVLayout, layout_fingerprint
from ..layout.spec import Fingerprint, ShardKind, TPShard


def cross_readable(layout: KVLayout) -> bool:
    """Whether this layout's chunks can be assembled from another TP size's objects: every
    group replicated or head-sharded, at least one head-sharded, and every plane of a
    head-sharded group a row (or page) of its ``count`` heads as equal leading slices."""
    kinds = {s.kind for s in layout.shards}
    if ShardKind.RANK in kinds or ShardKind.HEADS not in kinds:
        return False
    for p in layout.planes:
        shard = layout.shards[p.group_index]
        if shard.kind is ShardKind.HEADS and (p.num_slices > 1 or p.num_regions > 1 or not p.row_shape
                                              or p.row_shape[0] != shard.count):
            return False
    return True


def writer_shards(layout: KVLayout, tp_size: int, tp_rank: int) -> Optional[tuple[TPShard, ...]]:
    """Each group's part identity at rank ``tp_rank`` of TP size ``tp_size``; None where the
    layout is not cross-readable or the size does not split its heads."""
    if not cross_readable(layout):
        return None
    out = []
    for shard in layout.shards:
        if shard.kind is ShardKind.REPLICATED:
            out.append(shard)
            continue
        try:
            out.append(TPShard.of_kv_heads(shard.total, tp_rank=tp_rank, tp_size=tp_size))
        except LayoutError:
            return None
    return tuple(out)


def refusal(layout: KVLayout, tp_size: int) -> Optional[str]:
    """Why a rank of this layout can never restore what ranks of TP size ``tp_size`` stored,
    or None where it can: the same size, every group replicated (TP-free objects, the same
    for every size), or every writer range readable (``sources_at``, or the writers' objects
    are this rank's own). Named for a caller that must decide before anything is looked up
    (a P/D decode side whose producer runs another TP size, integrations/vllm/pd.py)."""
    if tp_size == layout.tp_size:
        return None
    kinds = [s.kind for s in layout.shards]
    if all(k is ShardKind.REPLICATED for k in kinds):
        return None
    ranked = [g for g, k in enumerate(kinds) if k is ShardKind.RANK]
    if ranked:
        return (f"KV-cache group(s) {ranked} are split over TP ranks in a way kvconnect keys by rank (recurrent "
                "states, layouts it does not describe by heads): what another TP size stored is never theirs")
    if not cross_readable(layout):
        return ("a head-sharded group's rows are not its heads as equal leading slices (one plane per head, "
                "column slices or row regions): it cannot be cut into another TP size's heads")
    for g, shard in enumerate(layout.shards):
        if shard.kind is ShardKind.HEADS:
            try:
                for rank in range(tp_size):
                    TPShard.of_kv_heads(shard.total, tp_rank=rank, tp_size=tp_size)
            except LayoutError:
                return f"TP {tp_size} does not split KV-cache group {g}'s {shard.total} KV heads"
    return None


@dataclass(frozen=True)
class Sources:
    """The writer ranks of one TP size whose objects together hold this rank's part."""

    tp_size: int
    ranks: tuple[int, ...]
    shards: tuple[tuple[TPShard, ...], ...]  # per rank: its part identity per group
    fingerprints: tuple[Fingerprint, ...]  # per rank: the fingerprint its objects carry


def sources_at(layout: KVLayout, tp_size: int) -> Optional[Sources]:
    """Writer ranks at ``tp_size`` to read this rank's heads from, one per distinct range; None
    where none can be (not cross-readable, a size that does not split the heads) or where the
    writers' objects would be this rank's own (same ranges: the ordinary path reads them)."""
    own = tuple(layout.shards)
    ranks, shards, seen = [], [], set()
    for rank in range(tp_size):
        theirs = writer_shards(layout, tp_size, rank)
        if theirs is None:
            return None
        if theirs == own:
            return None  # the same objects as this rank's own: nothing to translate
        overlaps = any(s.kind is ShardKind.HEADS and min(s.end, t.end) > max(s.first, t.first)
                       for s, t in zip(own, theirs))
        if overlaps and theirs not in seen:
            seen.add(theirs)
            ranks.append(rank)
            shards.append(theirs)
    if not ranks:
        return None
    prints = tuple(layout_fingerprint(layout.model_fingerprint, s) for s in shards)
    return Sources(tp_size, tuple(ranks), tuple(shards), prints)


def _source_row_bytes(layout: KVLayout, shards: Sequence[TPShard]) -> list[int]:
    out = []
    for p in layout.planes:
        own, theirs = layout.shards[p.group_index], shards[p.group_index]
        out.append(p.row_bytes if own.kind is ShardKind.REPLICATED else p.row_bytes // own.count * theirs.count)
    return out


def assemble(layout: KVLayout, sources: Sources, headers: Sequence[ChunkHeader],
             payloads: Sequence[memoryview]) -> Optional[tuple[tuple[tuple[int, int], ...], np.ndarray]]:
    """This rank's payload of one chunk from the writers' objects (``headers[i]``/``payloads[i]``
    of ``sources.ranks[i]``): ``(plane_rows, payload)``, or None where the objects disagree
    (token range, groups, rows per plane) or do not fit this layout."""
    first = headers[0]
    if len(headers) != len(sources.ranks) or len(first.plane_rows) != len(layout.planes):
        return None
    if any((h.token_start, h.token_end, h.group_mask, h.plane_rows) !=
           (first.token_start, first.token_end, first.group_mask, first.plane_rows) for h in headers):
        return None
    rows = [n for _, n in first.plane_rows]
    src_row_bytes = [_source_row_bytes(layout, s) for s in sources.shards]
    src_offsets = []
    for widths, header, payload in zip(src_row_bytes, headers, payloads):
        sizes = [n * w for n, w in zip(rows, widths)]
        if sum(sizes) != header.payload_bytes or len(payload) != header.payload_bytes:
            return None
        src_offsets.append(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    sizes = [n * p.row_bytes for n, p in zip(rows, layout.planes)]
    out = np.empty(sum(sizes), dtype=np.uint8)
    at = 0
    for i, p in enumerate(layout.planes):
        n = rows[i]
        dest = out[at: at + sizes[i]].reshape(n, p.row_bytes)
        at += sizes[i]
        if not n:
            continue
        own = layout.shards[p.group_index]
        views = [np.frombuffer(payloads[k], dtype=np.uint8, count=n * src_row_bytes[k][i],
                               offset=int(src_offsets[k][i])).reshape(n, src_row_bytes[k][i])
                 for k in range(len(sources.ranks))]
        if own.kind is ShardKind.REPLICATED:
            dest[:] = views[0]
            continue
        head_bytes = p.row_bytes // own.count
        covered = 0
        for theirs, view in zip(sources.shards, views):
            t = theirs[p.group_index]
            lo, hi = max(own.first, t.first), min(own.end, t.end)
            if hi <= lo:
                continue
            dest[:, (lo - own.first) * head_bytes:(hi - own.first) * head_bytes] = \
                view[:, (lo - t.first) * head_bytes:(hi - t.first) * head_bytes]
            covered += hi - lo
        if covered != own.count:  # distinct writer ranges never overlap: each head exactly once
            return None
    return first.plane_rows, out
