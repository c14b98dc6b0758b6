"""The two parts of a stored prefix: a prefix part per chunk, window parts at restore points.

A group whose rows of all of [0, P) stay needed to resume at P (full and compressed
attention, indexers) is stored per chunk: the *prefix part* of the chunk, under the chunk's
key. A group that needs only the rows (or state) just before P (a sliding window, a
compressor state, a recurrent state: anything with a restore window) is stored only where a
request can resume: the *window part* at a restore point P (``points.py`` says where those
are). A hit is the largest restore point P such that every prefix part of [0, P) and the
window part at P are present.

The window part at P is made of the window rows of the chunks that hold rows of the
window before P (``gate.window_walk``: one chunk when the window is at most a chunk, e.g.
DeepSeek V4's; four for Gemma 3's 1024-token window at chunk 256). A chunk's window rows
are the same whatever restore point needs them (rows of [max(s, e - W), e)), so they are
keyed by the chunk: ``window_key(chunk key, piece)``, a BLAKE3 hash of a domain tag, the
chunk key and the piece number. The key is content-only and block-size-free like the chunk
key it derives from, and never equals a chain key (chain steps are keyed BLAKE3, this is
unkeyed with a tag). With restore points at every chunk end (interval 0) the parts of a
chunk hold exactly the rows of the whole chunk, so the engine then stores it whole.

A chunk's window rows are cut into *pieces* of whole planes, each at most one pool slot,
so the pool's fixed slots are sized to the prefix part (DeepSeek-V4-Flash: ~1 MiB of the
~16 MiB a whole chunk holds) and not to the largest object. A window part is present only
when every piece is; each piece is an object of its own in every tier, with the chunk
format's own checks; its header's group mask holds window groups only.

The slot must not depend on how an engine slices its tensors: vLLM registers DeepSeek V4 one
tensor per layer, an engine with one buffer per cache type (or a Python API user) one per
group, and then one window plane (the C128 compressor states of every layer) would be the
slot and every prefix part would waste most of one. So the slot is
``max(prefix part, window / MAX_PIECES)`` and a window plane wider than that is first cut
into column slices of its rows (``slice_wide_planes``, ``KVLayout.with_sliced_planes``): the
same bytes, in pieces of about a slot, whatever the tensor granularity.

Window-free groups. A window group whose restore window is 0 at restore points that are
multiples of N tokens (``GroupSpec.window_free_every``, set by an adapter per engine release
from a bench on the real forward) is stored in no part when N divides the chunk size: every
full chunk's end is then such a multiple and needs none of its rows. A restore point that is
not (a partial chunk's end) needs its rows, finds them in no part (no piece's group mask has
the group) and is never a hit: the restore falls back to an earlier point. With parts off
(``split=False``) every group is stored whole and the rule only skips the copy at aligned points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import blake3
import numpy as np

from ..layout.kv_layout import KVLayout
from ..layout.spec import ChunkKey
from .plan import max_chunk_payload_bytes, max_group_rows

MAX_PIECES = 16  # a chunk's window rows are cut into at most about this many pieces
_WINDOW_DOMAIN = b"kvconnect/window-part/v1\x00"


def slice_wide_planes(layout: KVLayout, chunk_tokens: int, *, split: bool = True) -> KVLayout:
    """``layout`` with every window plane whose rows of a chunk exceed
    ``max(prefix part, window / MAX_PIECES)`` cut into column slices of about that size; the
    layout itself where none does (every per-layer layout kvconnect has met) or parts are off."""
    return layout.with_sliced_planes(wide_planes(layout, chunk_tokens, split=split))


def wide_planes(layout: KVLayout, chunk_tokens: int, *, split: bool = True) -> dict[int, int]:
    """The planes ``slice_wide_planes`` cuts, and into how many slices (empty: none). Geometry
    only: also asked of a layout whose tensors are not its own (another TP size's writer)."""
    split_bytes = _SplitBytes.of(layout, chunk_tokens) if split else None
    if split_bytes is None or split_bytes.all_free:
        return {}
    target = max(split_bytes.prefix, -(-split_bytes.window // MAX_PIECES), 1)
    return {i: -(-split_bytes.plane_bytes[i] // target) for i in split_bytes.window_planes
            if split_bytes.plane_bytes[i] > target}


@dataclass(frozen=True)
class _SplitBytes:
    """A full chunk's bytes as the split sees them: which groups go in no part (window-free) and
    which in the window part, each plane's rows, the prefix part and the window rows."""

    window_mask: int
    free_mask: int
    all_free: bool  # every window group is window-free: kept in the window part (no part would hold a window)
    plane_bytes: list[int]
    window_planes: list[int]  # planes of the window part that hold rows
    prefix: int
    window: int

    @classmethod
    def of(cls, layout: KVLayout, chunk_tokens: int) -> "Optional[_SplitBytes]":
        """None when nothing would be split off: no window group, or no window rows."""
        window_mask = sum(1 << g for g, geo in enumerate(layout.geometries) if geo.window_tokens is not None)
        free_mask = window_free_mask(layout, chunk_tokens)
        all_free = not window_mask & ~free_mask
        if all_free:
            free_mask = 0
        else:
            window_mask &= ~free_mask  # never needed at a full chunk's end: in neither part
        rows = max_group_rows(layout, chunk_tokens)
        plane_bytes = [rows[p.group_index] * p.row_bytes for p in layout.planes]
        window_planes = [i for i, p in enumerate(layout.planes) if (window_mask >> p.group_index) & 1 and plane_bytes[i]]
        if not window_planes:
            return None
        prefix = sum(b for b, p in zip(plane_bytes, layout.planes) if not ((window_mask | free_mask) >> p.group_index) & 1)
        return cls(window_mask, free_mask, all_free, plane_bytes, window_planes, prefix,
                   sum(plane_bytes[i] for i in window_planes))


def window_key(chunk_key: ChunkKey, piece: int) -> ChunkKey:
    """Key of piece ``piece`` of the window rows of the chunk keyed ``chunk_key``."""
    digest = blake3.blake3(_WINDOW_DOMAIN + bytes(chunk_key) + int(piece).to_bytes(2, "little")).digest()
    return ChunkKey(digest[: len(bytes(chunk_key))])


@dataclass(frozen=True)
class PartLayout:
    """How a layout's chunks split into a prefix part and window pieces.

    ``window_mask`` is 0 when the layout has no window group or parts are off
    (``split=False``): then the prefix part is the whole chunk.
    """

    prefix_mask: int
    window_mask: int
    pieces: tuple[tuple[int, ...], ...]  # plane indices of each window piece
    slot_bytes: int  # the largest object: a prefix part or one window piece
    prefix_bytes: int  # a full chunk's prefix part
    window_bytes: int  # a full chunk's window rows (all pieces)
    free_mask: int = 0  # window groups stored in no part: their restore window is 0 at every full chunk's end

    @property
    def split(self) -> bool:
        return self.window_mask != 0

    @classmethod
    def of(cls, layout: KVLayout, chunk_tokens: int, *, split: bool = True) -> "PartLayout":
        all_groups = (1 << layout.num_groups) - 1
        sb = _SplitBytes.of(layout, chunk_tokens) if split else None
        if sb is None:
            whole = max_chunk_payload_bytes(layout, chunk_tokens)
            return cls(all_groups, 0, (), max(whole, 1), whole, 0)
        plane_bytes, window_planes, window_mask, free_mask = sb.plane_bytes, sb.window_planes, sb.window_mask, sb.free_mask
        prefix, window = sb.prefix, sb.window
        slot = max(prefix, max(plane_bytes[i] for i in window_planes), -(-window // MAX_PIECES), 1)
        pieces: list[list[int]] = [[]]
        used = 0
        for i in window_planes:
            if used + plane_bytes[i] > slot and pieces[-1]:
                pieces.append([])
                used = 0
            pieces[-1].append(i)
            used += plane_bytes[i]
        return cls(all_groups & ~window_mask & ~free_mask, window_mask, tuple(tuple(p) for p in pieces), slot, prefix, window,
                   free_mask)

    def piece_planes(self, num_planes: int) -> list[np.ndarray]:
        """Per piece, a bool array over the layout's planes."""
        out = []
        for piece in self.pieces:
            sel = np.zeros(num_planes, np.bool_)
            sel[list(piece)] = True
            out.append(sel)
        return out


def window_free_mask(layout: KVLayout, chunk_tokens: int) -> int:
    """Window groups whose restore window is 0 at every full chunk's end (``GroupSpec.window_free_every``
    divides the chunk size): stored in no part. A restore point that is not such a multiple (a
    partial chunk's end) needs their rows, finds them in no part, and so is never a hit there."""
    # a multiple of the chunk size is one of N when the chunk size is
    return sum(1 << g for g, geo in enumerate(layout.geometries) if geo.window_tokens is not None and geo.window_free_at(chunk_tokens))
