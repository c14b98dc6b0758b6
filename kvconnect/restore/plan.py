"""Planning: which rows of which planes a store writes and a retrieve reads.

Pure bookkeeping over the layout, the block tables and the chunk index; no byte moves
here. In the order a store and a retrieve use it:

    tables = BlockTables.of(layout, block_ids)         # validated per-group block ids
    plans  = plan_store(layout, chunks, tables)        # per chunk: rows per group, present?
    store_segments(layout, plans, offsets)             # -> segments for one gather
    retrieve_part_segments(layout, chunks, parts, P, tables)   # -> segments for one scatter

P comes from the restore gate (``gate.restorable_boundary``); the segments go to
``kvconnect.transfer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..chunks.keys import Chunk
from ..errors import BlockTableError, CorruptChunkError
from ..layout.chunk_size import local_chunk_tokens
from ..layout.kv_layout import KVLayout
from ..layout.rows import RowRange, intersect
from ..layout.spec import ChunkKey
from ..transfer.tables import SegmentBuilder


# ---------------------------------------------------------------------------------------
# layout-level facts


def max_group_rows(layout: KVLayout, chunk_tokens: int) -> list[int]:
    """Upper bound of the rows one chunk stores, per group."""
    dcp, local = layout.dcp, local_chunk_tokens(layout, chunk_tokens)
    out = []
    for geo in layout.geometries:
        if geo.window_tokens is None:
            out.append(local // geo.tokens_per_row)
            continue
        window = geo.window_tokens if dcp.size == 1 else (geo.window_tokens // dcp.period_tokens + 1) * dcp.interleave_tokens
        span = min(local, window)
        out.append(-(-span // geo.tokens_per_row))
    return out


def max_chunk_payload_bytes(layout: KVLayout, chunk_tokens: int) -> int:
    rows = max_group_rows(layout, chunk_tokens)
    return sum(rows[p.group_index] * p.row_bytes for p in layout.planes)


# ---------------------------------------------------------------------------------------
# block tables


class BlockTables:
    """Per-group block ids as int64 arrays; negative ids mean the block is absent."""

    def __init__(self, layout: KVLayout, tables: list[np.ndarray]) -> None:
        self.layout = layout
        self.tables = tables

    @classmethod
    def of(cls, layout: KVLayout, block_ids) -> "BlockTables":
        """``block_ids``: one sequence per group. A one-group layout also takes one flat sequence
        (that group's ids); a multi-group layout refuses one, which no group's ids can be told from."""
        groups = layout.num_groups
        flat = ((isinstance(block_ids, (torch.Tensor, np.ndarray)) and block_ids.ndim == 1)
                or (isinstance(block_ids, (list, tuple)) and bool(block_ids) and isinstance(block_ids[0], (int, np.integer))))
        if flat and groups > 1:
            raise BlockTableError(
                f"block_ids is one flat sequence of {len(block_ids)} ids, but this layout has {groups} KV-cache groups: "
                f"pass one sequence per group ([ids of group 0, ..., ids of group {groups - 1}], -1 for an absent block); "
                "a flat sequence is read as the block ids of a one-group layout only")
        if groups == 1 and (flat or (isinstance(block_ids, (list, tuple)) and not block_ids)):
            block_ids = [block_ids]
        if not isinstance(block_ids, (list, tuple)) or len(block_ids) != groups:
            got = len(block_ids) if isinstance(block_ids, (list, tuple)) else type(block_ids).__name__
            raise BlockTableError(f"expected block ids for {groups} groups, got {got}")
        tables = []
        for g, ids in enumerate(block_ids):
            if isinstance(ids, torch.Tensor):
                ids = ids.detach().cpu().numpy()
            arr = np.asarray(ids)
            if arr.size == 0:
                arr = arr.astype(np.int64)
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise BlockTableError(f"group {g}: block ids must be a 1-D sequence of ints, got {arr.dtype} {arr.shape}")
            arr = arr.astype(np.int64)
            limit = layout.group_num_blocks(g)
            if arr.size and arr.max() >= limit:
                bad = int(arr.max())
                raise BlockTableError(f"group {g}: block id {bad} is out of range (the group's planes have {limit} blocks)")
            tables.append(np.where(arr < 0, -1, arr))
        return cls(layout, tables)

    @property
    def all_absent(self) -> bool:
        """Every block id of every group is -1 (absent), and there is at least one: nothing can be stored."""
        return any(t.size for t in self.tables) and all(bool((t < 0).all()) for t in self.tables)

    def slots(self, group: int, rows: RowRange, *, required: bool, what: str) -> Optional[np.ndarray]:
        """Slots of rows [r0, r1) of a group; None if a block is absent and not required."""
        r0, r1 = rows
        if r1 <= r0:
            return np.zeros(0, np.int64)
        rpb = self.layout.geometries[group].rows_per_block
        table = self.tables[group]
        need_blocks = (r1 - 1) // rpb + 1
        if need_blocks > len(table):
            raise BlockTableError(
                f"group {group}: {what} needs rows [{r0}, {r1}) in {need_blocks} blocks, but only {len(table)} block ids were given"
            )
        row_ids = np.arange(r0, r1, dtype=np.int64)
        blocks = table[row_ids // rpb]
        if (blocks < 0).any():
            if required:
                missing = int(row_ids[np.argmax(blocks < 0)] // rpb)
                raise BlockTableError(f"group {group}: {what} needs block index {missing}, which is absent (id < 0)")
            return None
        return blocks * rpb + row_ids % rpb


# ---------------------------------------------------------------------------------------
# store


@dataclass
class StorePlan:
    chunk: Chunk
    group_mask: int
    plane_rows: tuple[tuple[int, int], ...]
    payload_bytes: int
    group_slots: list[Optional[np.ndarray]]


class PlaneArrays:
    """Per-plane integer arrays for vectorised segment building."""

    def __init__(self, layout: KVLayout) -> None:
        self.group = np.array([p.group_index for p in layout.planes], dtype=np.int64)
        self.row_bytes = np.array([p.row_bytes for p in layout.planes], dtype=np.int64)
        self.index = np.arange(len(layout.planes), dtype=np.int64)


def plan_store(layout: KVLayout, chunks: Sequence[Chunk], tables: BlockTables, *, groups: Optional[int] = None,
               planes: Optional[np.ndarray] = None) -> list[StorePlan]:
    """Per chunk, the rows each group stores and whether its blocks are present.

    ``groups`` (a bit mask, default all) and ``planes`` (a bool array over the layout's
    planes, default all) select what the stored object holds (parts.py: a prefix part or one
    window piece); a group outside ``groups`` stores nothing and has its bit clear.
    """
    arrays = PlaneArrays(layout)
    groups = (1 << layout.num_groups) - 1 if groups is None else groups
    used = np.ones(len(layout.planes), np.bool_) if planes is None else np.asarray(planes, np.bool_)
    group_used = [bool(((arrays.group == g) & used).any()) for g in range(layout.num_groups)]
    plans = []
    for chunk in chunks:
        mask, starts, counts, group_slots = 0, [], [], []
        for g, geo in enumerate(layout.geometries):
            if not (groups >> g) & 1:
                group_slots.append(None)
                starts.append(0)
                counts.append(0)
                continue
            rows = geo.stored_rows(chunk.start, chunk.end)
            slots = tables.slots(g, rows, required=False, what=f"storing chunk {chunk.index}")
            group_slots.append(slots if group_used[g] else None)
            starts.append(rows[0])
            counts.append(rows[1] - rows[0] if slots is not None else 0)
            if slots is not None:
                mask |= 1 << g
        plane_first = np.asarray(starts, np.int64)[arrays.group]
        plane_n = np.where(used, np.asarray(counts, np.int64)[arrays.group], 0)
        plane_first = np.where(used, plane_first, 0)
        plans.append(
            StorePlan(
                chunk=chunk,
                group_mask=mask,
                plane_rows=tuple(zip(plane_first.tolist(), plane_n.tolist())),
                payload_bytes=int((plane_n * arrays.row_bytes).sum()),
                group_slots=group_slots,
            )
        )
    return plans


def store_segments(layout: KVLayout, plans: Sequence[StorePlan], buffer_offsets: Sequence[int]) -> SegmentBuilder:
    arrays = PlaneArrays(layout)
    builder = SegmentBuilder()
    for plan, base in zip(plans, buffer_offsets):
        group_offsets = np.zeros(layout.num_groups, np.int64)
        for g, slots in enumerate(plan.group_slots):
            if slots is not None and len(slots):
                group_offsets[g] = builder.add_slots(slots)
        plane_n = np.array([n for _, n in plan.plane_rows], np.int64)
        plane_bytes = plane_n * arrays.row_bytes
        plane_off = np.cumsum(plane_bytes) - plane_bytes
        builder.add_segments(arrays.index, plane_n, group_offsets[arrays.group], base + plane_off)
    return builder


# ---------------------------------------------------------------------------------------
# retrieve


@dataclass(frozen=True)
class StoredPart:
    """One stored object of a chunk, as a retrieve reads it: its header, where its payload
    starts in the pool buffer, and which planes it holds (None: every plane)."""

    header: object
    base: int
    planes: Optional[np.ndarray] = None
    key: Optional[ChunkKey] = None


def retrieve_segments(
    layout: KVLayout,
    chunks: Sequence[Chunk],
    headers: Sequence,
    buffer_offsets: Sequence[int],
    boundary: int,
    tables: BlockTables,
    *,
    present_tokens: int = 0,
) -> SegmentBuilder:
    """``retrieve_part_segments`` for chunks stored whole: ``headers[i]`` is chunk i's header (None: not found)."""
    parts = [[StoredPart(h, b)] if h is not None else [] for h, b in zip(headers, buffer_offsets)]
    return retrieve_part_segments(layout, chunks, parts, boundary, tables, present_tokens=present_tokens)


def retrieve_part_segments(
    layout: KVLayout,
    chunks: Sequence[Chunk],
    parts: Sequence[Sequence[StoredPart]],
    boundary: int,
    tables: BlockTables,
    *,
    present_tokens: int = 0,
) -> SegmentBuilder:
    """Segments that load exactly the rows needed to resume at ``boundary`` from each chunk.

    ``parts[i]`` are the stored objects of ``chunks[i]`` (its prefix part and the pieces of
    its window rows that the restore needs; empty: the chunk is not needed), each holding
    a disjoint set of planes. Rows of tokens below ``present_tokens`` are already in the
    engine and never written (the engine's own prefix hit may end inside a chunk).
    Raises BlockTableError (nothing written) when a needed row has no valid block, and
    CorruptChunkError (``.chunk_index``, ``.key`` of the bad object) when a part does not
    hold rows the gate said it holds, or no part holds a needed plane.
    """
    arrays = PlaneArrays(layout)
    builder = SegmentBuilder()
    num_planes = len(layout.planes)
    needed = [intersect(geo.needed_rows(boundary), geo.chunk_rows(present_tokens, boundary)) for geo in layout.geometries]
    for chunk, chunk_parts in zip(chunks, parts):
        need = [intersect(needed[g], geo.chunk_rows(chunk.start, chunk.end)) for g, geo in enumerate(layout.geometries)]
        need_lo = np.array([lo for lo, _ in need], np.int64)[arrays.group]
        need_hi = np.array([hi for _, hi in need], np.int64)[arrays.group]
        need_n = need_hi - need_lo
        covered = np.zeros(num_planes, np.bool_)
        checked = []
        for part in chunk_parts:
            header = part.header
            if len(header.plane_rows) != num_planes:
                raise _corrupt(chunk, f"has {len(header.plane_rows)} planes, layout has {num_planes}", part.key)
            stored = np.asarray(header.plane_rows, np.int64).reshape(-1, 2)
            first, count = stored[:, 0], stored[:, 1]
            # the checksum proves integrity, not consistency: rows claimed beyond the payload
            # would read stale slot bytes as KV
            if int((count * arrays.row_bytes).sum()) != header.payload_bytes:
                raise _corrupt(chunk, f"has plane rows that do not add up to its {header.payload_bytes}-byte payload", part.key)
            sel = np.ones(num_planes, np.bool_) if part.planes is None else part.planes
            wanted = sel & (need_n > 0)
            if (wanted & ((need_lo < first) | (need_hi > first + count))).any():
                raise _corrupt(chunk, "does not hold the rows its group mask claims", part.key)
            covered |= wanted
            checked.append((part, first, count, wanted))
        if ((need_n > 0) & ~covered).any():
            raise _corrupt(chunk, "is needed but was not found")
        if not checked:
            continue
        group_offsets = np.zeros(layout.num_groups, np.int64)
        for g, rows in enumerate(need):
            if rows[1] > rows[0]:
                slots = tables.slots(g, rows, required=True, what=f"restoring at token {boundary}")
                group_offsets[g] = builder.add_slots(slots)
        for part, first, count, wanted in checked:
            stored_off = np.cumsum(count * arrays.row_bytes) - count * arrays.row_bytes
            buf = part.base + stored_off + (need_lo - first) * arrays.row_bytes
            builder.add_segments(arrays.index, np.where(wanted, need_n, 0), group_offsets[arrays.group], buf)
    return builder


def _corrupt(chunk: Chunk, why: str, key: Optional[ChunkKey] = None) -> CorruptChunkError:
    """A CorruptChunkError that names the chunk (``.chunk_index``) and, when known, the bad
    object's key (``.key``) so only it is dropped."""
    err = CorruptChunkError(f"chunk {chunk.index} {why}")
    err.chunk_index = chunk.index
    err.key = key
    return err
