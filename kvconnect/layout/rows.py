"""Row arithmetic: which rows of a group a chunk stores and a restore needs.

Everything here is a pure function of integers, property-tested in tests/test_rows.py.

For a group with ``tpr`` tokens per row, rows for the (rank-local) tokens [a, b) are
``[a // tpr, b // tpr)``: a row belongs to its last token. With decode context parallel,
global token positions are first mapped to this rank's local positions.

Chunk [s, e) of a full or compressed group stores rows [s, e). A windowed group
(sliding window, compressor state, recurrent state) stores only the rows of
[max(s, e - W), e), what resuming at e needs. Restoring at a boundary P needs rows
[0, P) of full groups and [P - W, P) of windowed groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .spec import DCPSpec, GroupKind, GroupSpec

RowRange = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class GroupGeometry:
    """A group's row rules, resolved against its planes and the DCP shard."""

    tokens_per_row: int
    rows_per_block: int
    window_tokens: Optional[int]
    aligned_boundary: bool  # page/state rows: a boundary must fall on a row edge
    dcp: DCPSpec = DCPSpec()
    window_free_every: Optional[int] = None  # no rows needed at boundaries that are multiples of this

    @classmethod
    def of(cls, group: GroupSpec, *, is_page: bool, dcp: DCPSpec) -> "GroupGeometry":
        page_like = is_page or group.kind is GroupKind.STATE
        return cls(
            tokens_per_row=group.block_size if page_like else group.compress_ratio,
            rows_per_block=1 if page_like else group.rows_per_block,
            window_tokens=group.window_tokens,
            aligned_boundary=page_like,
            dcp=dcp,
            window_free_every=group.window_free_every,
        )

    def _rows(self, a: int, b: int) -> RowRange:
        local_a = self.dcp.local_tokens_before(a)
        local_b = self.dcp.local_tokens_before(b)
        return local_a // self.tokens_per_row, local_b // self.tokens_per_row

    def chunk_rows(self, start: int, end: int) -> RowRange:
        """All rows whose last token lies in chunk [start, end) (the chunk's partition)."""
        return self._rows(start, end)

    def stored_rows(self, start: int, end: int) -> RowRange:
        """Rows chunk [start, end) stores: a suffix of chunk_rows for windowed groups."""
        if self.window_tokens is None:
            return self._rows(start, end)
        return self._rows(max(start, end - self.window_tokens), end)

    def needed_rows(self, boundary: int) -> RowRange:
        """Rows that must be in the engine to resume computing at token ``boundary``."""
        if self.window_tokens is None:
            return self._rows(0, boundary)
        if self.window_free_at(boundary):
            end = self._rows(boundary, boundary)[1]
            return end, end
        return self._rows(max(0, boundary - self.window_tokens), boundary)

    def window_free_at(self, boundary: int) -> bool:
        """Whether resuming at ``boundary`` needs none of this group's rows (its restore
        window is 0 there: ``GroupSpec.window_free_every``)."""
        every = self.window_free_every
        return every is not None and boundary % every == 0

    def boundary_ok(self, boundary: int) -> bool:
        """Whether a restore at ``boundary`` loses no token of a page or state row."""
        if not self.aligned_boundary:
            return True
        return self.dcp.local_tokens_before(boundary) % self.tokens_per_row == 0


def intersect(a: RowRange, b: RowRange) -> RowRange:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else (lo, lo)


def chunk_bounds(num_tokens: int, chunk_tokens: int, include_partial: bool) -> list[RowRange]:
    """Token ranges of the chunks of a prompt: full chunks, then the tail if asked."""
    bounds = [(s, s + chunk_tokens) for s in range(0, num_tokens - chunk_tokens + 1, chunk_tokens)]
    tail = bounds[-1][1] if bounds else 0
    if include_partial and tail < num_tokens:
        bounds.append((tail, num_tokens))
    return bounds
