"""The restore gate: the largest P at which every group can resume, and the one walk of the
chunks whose window rows a restore at P needs.

``window_walk`` is asked by the gate (are those rows stored?), by the store of a window
part (which chunks' window rows to write) and by a retrieve (which pieces to pin and load).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..chunks.keys import Chunk
from ..layout.kv_layout import KVLayout
from ..layout.rows import intersect


def window_walk(layout: KVLayout, window_mask: int, chunks: Sequence[Chunk], k: int) -> list[tuple[int, int]]:
    """``(j, groups)`` for the chunks j <= k, from k down, that hold rows a restore at
    ``chunks[k].end`` needs of the window groups in ``window_mask``; ``groups``: those of them
    whose needed rows chunk j holds. Chunk k is always listed (its piece may hold no row,
    e.g. a state group's partial page, and then ``groups`` is 0)."""
    boundary = chunks[k].end
    geos = [(g, geo, geo.needed_rows(boundary)) for g, geo in enumerate(layout.geometries) if (window_mask >> g) & 1]
    out = []
    for j in range(k, -1, -1):
        below, groups = True, 0
        for g, geo, needed in geos:
            rows = geo.chunk_rows(chunks[j].start, chunks[j].end)
            lo, hi = intersect(rows, needed)
            if hi > lo:
                groups |= 1 << g
            below = below and rows[1] <= needed[0]  # rows only grow with j: no chunk below holds needed rows
        if groups or j == k:
            out.append((j, groups))
        if below:
            break
    return out


def window_chunks(layout: KVLayout, window_mask: int, chunks: Sequence[Chunk], k: int) -> list[int]:
    """Indices of the chunks (<= k, from k down) holding window rows needed to resume at
    ``chunks[k].end``; chunk k itself always."""
    return [j for j, _ in window_walk(layout, window_mask, chunks, k)]


def effective_masks(prefix: Sequence[Optional[int]], window: Sequence[int]) -> list[Optional[int]]:
    """Per chunk, the groups its stored parts hold (the gate's input): its prefix part's groups
    (None: absent) with the window groups of its complete window part."""
    return [None if p is None and not w else (p or 0) | w for p, w in zip(prefix, window)]


def resumable_end(layout: KVLayout, boundary: int) -> bool:
    """Whether a chunk end can be a restore point at all, whatever is stored: the layout resumes
    there (its rebuilt groups' period, ``KVLayout.resumable_at``) and every page or state group
    has a row edge there."""
    return layout.resumable_at(boundary) and all(geo.boundary_ok(boundary) for geo in layout.geometries)


def restorable_boundary(layout: KVLayout, chunks: Sequence[Chunk], masks: Sequence[Optional[int]], *, present_below: int = 0) -> int:
    """Largest chunk end P at which every group can be restored from stored chunks, else 0.

    Full/compressed groups need every chunk of [0, P) stored with their bit (so a hit never
    extends past a chunk that is not stored, even one holding none of this rank's rows of
    them, e.g. a DCP rank's share of a short chunk); a windowed group needs
    its rows in every chunk that holds rows of [P - W, P); page/state groups also need P on
    a row edge; a layout with rebuilt groups (``KVLayout.resume_every``) needs P on a multiple of
    their period, where the engine can rebuild them. Chunks ending at or below ``present_below`` are
    already in the engine.
    """
    all_groups = (1 << layout.num_groups) - 1
    geos = layout.geometries
    windowed = sum(1 << g for g, geo in enumerate(geos) if geo.window_tokens is not None)
    full_bits = all_groups & ~windowed
    eff = [all_groups if c.end <= present_below else (m if m is not None else 0) for c, m in zip(chunks, masks)]
    full_ok, running = [], True
    for m in eff:
        running = running and (m & full_bits) == full_bits
        full_ok.append(running)
    for k in range(len(chunks) - 1, -1, -1):
        if not full_ok[k]:
            continue
        boundary = chunks[k].end
        if boundary <= present_below and present_below:
            return boundary
        if not resumable_end(layout, boundary):
            continue
        if all((eff[j] & groups) == groups for j, groups in window_walk(layout, windowed, chunks, k)):
            return boundary
    return 0
