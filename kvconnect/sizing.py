"""Sizing: what kvconnect stores and loads for a layout, computed from the layout's own row
rules (``rows.GroupGeometry``) and plane bytes, the same the engine's planner uses.

    s = sizing.of(layout, chunk_tokens)
    s.groups               per group: kind, rows and bytes one chunk stores
    s.stored_bytes(n)      payload bytes of the chunks of an n-token prompt (what ``store`` writes)
    s.restore_bytes(p)     bytes ``retrieve`` loads to resume at token p (windowed groups: only their window)
    s.pool_bytes(n)        CPU pool bytes n tokens occupy (fixed slots of the largest chunk)
    s.encoded_bytes(n)     bytes in the disk / remote tiers (payload + chunk header)
    restore_point_sizing(layout, chunk_tokens, interval)   prefix part, window part and bytes
                           per cached token with window rows kept only at restore points (kvconnect/restore/)

The per-prompt figures above are those of whole chunks (interval 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .chunks.chunk_format import FIXED_HEADER_BYTES
from .chunks.keys import Chunk
from .layout.kv_layout import KVLayout
from .layout.rows import chunk_bounds
from .restore.gate import window_chunks
from .restore.parts import PartLayout, slice_wide_planes
from .layout.chunk_size import check_chunk_size
from .restore.plan import max_chunk_payload_bytes
from .restore.points import is_interval_point, splits_window_groups


@dataclass(frozen=True)
class GroupSizing:
    index: int
    kind: str
    block_size: int
    compress_ratio: int
    window_tokens: object
    num_planes: int
    row_bytes: int  # all planes of the group, one row each
    rows_per_chunk: int  # a full chunk past the window
    bytes_per_chunk: int


@dataclass(frozen=True)
class Sizing:
    layout: KVLayout
    chunk_tokens: int
    groups: tuple[GroupSizing, ...]
    slot_bytes: int  # the largest chunk: one CPU pool slot

    @property
    def bytes_per_chunk(self) -> int:
        """A full chunk in steady state (windowed groups store their window's rows)."""
        return sum(g.bytes_per_chunk for g in self.groups)

    def _group_bytes(self, g: int, rows: tuple[int, int]) -> int:
        return max(0, rows[1] - rows[0]) * self.groups[g].row_bytes

    def stored_bytes(self, num_tokens: int, *, partial: bool = False) -> int:
        total = 0
        for s, e in chunk_bounds(num_tokens, self.chunk_tokens, partial):
            total += sum(self._group_bytes(g, geo.stored_rows(s, e)) for g, geo in enumerate(self.layout.geometries))
        return total

    def num_chunks(self, num_tokens: int, *, partial: bool = False) -> int:
        return len(chunk_bounds(num_tokens, self.chunk_tokens, partial))

    def restore_bytes(self, boundary: int) -> int:
        return sum(self._group_bytes(g, geo.needed_rows(boundary)) for g, geo in enumerate(self.layout.geometries))

    def pool_bytes(self, num_tokens: int) -> int:
        return self.num_chunks(num_tokens) * self.slot_bytes

    def encoded_bytes(self, num_tokens: int) -> int:
        return self.stored_bytes(num_tokens) + self.num_chunks(num_tokens) * header_bytes(self.layout)


def header_bytes(layout: KVLayout) -> int:
    """Bytes of one chunk's header in the lower tiers (fixed part + a row range per plane)."""
    return FIXED_HEADER_BYTES + 8 * len(layout.planes)


def of(layout: KVLayout, chunk_tokens: int) -> Sizing:
    """Raises LayoutError when ``chunk_tokens`` does not suit the layout (as the engine would)."""
    check_chunk_size(layout, chunk_tokens)
    groups = []
    for g, (spec, geo, row) in enumerate(zip(layout.groups, layout.geometries, layout.describe())):
        s = max(chunk_tokens, (geo.window_tokens or 0) // chunk_tokens * chunk_tokens + chunk_tokens)
        lo, hi = geo.stored_rows(s, s + chunk_tokens)
        groups.append(GroupSizing(g, row["kind"], spec.block_size, spec.compress_ratio, geo.window_tokens, row["num_planes"],
                                  row["row_bytes_per_row"], hi - lo, (hi - lo) * row["row_bytes_per_row"]))
    return Sizing(layout, chunk_tokens, tuple(groups), max_chunk_payload_bytes(layout, chunk_tokens))


@dataclass(frozen=True)
class RestorePointSizing:
    """What restore points (kvconnect/restore/) store for a long prompt at a restore interval."""

    interval_tokens: int
    chunk_tokens: int
    split: bool  # False: no window group, or interval 0 (whole chunks)
    prefix_bytes_per_chunk: int
    window_bytes_per_chunk: int  # one chunk's window rows, all pieces
    pieces_per_chunk: int
    window_part_chunks: int  # chunks whose window rows one restore point needs
    window_part_bytes: int  # bytes of the window part at one restore point
    slot_bytes: int
    bytes_per_token: float  # payload per cached prefix token, a prompt of many intervals
    pool_bytes_per_token: float  # CPU pool bytes (whole slots) per cached prefix token
    whole_bytes_per_token: float  # the same with every chunk whole (interval 0)
    window_free_bytes_per_chunk: int = 0  # window rows stored in no part (GroupSpec.window_free_every divides the chunk)
    window_free_groups: tuple = ()  # their group indices


def restore_point_sizing(layout: KVLayout, chunk_tokens: int, interval_tokens: int) -> RestorePointSizing:
    """Steady-state bytes per cached token at ``interval_tokens``: the restore points a long
    store makes (``points.is_interval_point``, the engine's rule) over one period of the
    interval and the chunk size; a prompt's end and branch points add one window part each."""
    check_chunk_size(layout, chunk_tokens)
    whole = max_chunk_payload_bytes(layout, chunk_tokens)
    split = splits_window_groups(interval_tokens)
    layout = slice_wide_planes(layout, chunk_tokens, split=split)  # as the engine stores it
    parts = PartLayout.of(layout, chunk_tokens, split=split)
    if not parts.split:
        per = whole / chunk_tokens
        return RestorePointSizing(interval_tokens, chunk_tokens, False, whole, 0, 0, 0, 0, whole, per, per, per)
    longest = max(geo.window_tokens or 0 for geo in layout.geometries)
    span_probe = [Chunk(i, i * chunk_tokens, (i + 1) * chunk_tokens, None) for i in range(longest // chunk_tokens + 3)]
    span = len(window_chunks(layout, parts.window_mask, span_probe, len(span_probe) - 1))
    # restore points repeat every lcm(interval, chunk) tokens: count one period far from the prompt's start
    period = interval_tokens * chunk_tokens // math.gcd(interval_tokens, chunk_tokens) // chunk_tokens  # in chunks
    first = span + period
    chunks = [Chunk(i, i * chunk_tokens, (i + 1) * chunk_tokens, None) for i in range(first + period + span)]
    kept: set[int] = set()  # chunks whose window rows some restore point keeps
    for k in range(first + period + span):
        if is_interval_point(chunks[k], interval_tokens):
            kept.update(window_chunks(layout, parts.window_mask, chunks, k))
    window_chunks_per_period = sum(1 for j in kept if first <= j < first + period)
    period_tokens = period * chunk_tokens
    payload = period * parts.prefix_bytes + window_chunks_per_period * parts.window_bytes
    objects = period + window_chunks_per_period * len(parts.pieces)
    free = tuple(g for g in range(layout.num_groups) if (parts.free_mask >> g) & 1)
    return RestorePointSizing(interval_tokens, chunk_tokens, True, parts.prefix_bytes, parts.window_bytes, len(parts.pieces),
                              span, span * parts.window_bytes, parts.slot_bytes, payload / period_tokens,
                              objects * parts.slot_bytes / period_tokens, whole / chunk_tokens,
                              whole - parts.prefix_bytes - parts.window_bytes, free)
