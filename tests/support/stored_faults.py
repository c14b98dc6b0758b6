"""TEST HARNESS: faults made in the bytes a ``KVCacheEngine`` stored, as a wrong row model would.

Issue 39 item 4 asks that a verified restore (kvconnect/restore/verify.py) catch what
checksums cannot: bytes that survived storage but are not the rows the model reads. These
functions rewrite the payload of an engine's stored objects in its CPU pool (a private pool
keeps no checksum of its own; lower tiers are not used where these run), in the chunk
format's plane-major order (``header.plane_rows``):

- ``swap_planes``: two planes of one row width exchange their rows (K and V, or two layers):
  a plane table off by one;
- ``shift_block``: every plane's rows move by one (row i holds row i + 1's bytes): a block
  table read one block late;
- ``layout_rule``: each row's two halves change places: the row layout an engine release
  changed (vLLM 0.26's packed layout broke restores that way: LMCache 4463) while the
  fingerprint stayed;
- ``state_from``: a window piece (a recurrent-state snapshot) replaced by the one stored for
  another chunk end: a snapshot from the wrong position.

Every function returns how many objects it changed; 0 means the fault could not be made.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

FAULTS = ("swap_planes", "shift_block", "layout_rule")


def _objects(engine, tokens, *, pieces: bool):
    from kvconnect.restore.parts import window_key

    out = []
    for c in engine.chunks(np.asarray(tokens, np.int64), include_partial=False):
        keys = [c.key]
        if pieces and engine.parts.split:
            keys = [window_key(c.key, p) for p in range(len(engine.parts.pieces))]
        entries = engine.pool.acquire(keys, touch=False)
        out += [(c, e) for e in entries if e is not None]
        engine.pool.release(entries)
    return out


def _planes(engine, entry):
    """(plane index, byte offset, rows, row bytes) of each plane the object holds."""
    rb = [p.row_bytes for p in engine.layout.planes]
    rows = [n for _, n in entry.header.plane_rows]
    offs = np.cumsum([0] + [n * b for n, b in zip(rows, rb)])
    return [(i, int(offs[i]), rows[i], rb[i]) for i in range(len(rb)) if rows[i]]


def _rewrite(engine, tokens, change: Callable, *, pieces: bool = False) -> int:
    changed = 0
    for _, entry in _objects(engine, tokens, pieces=pieces):
        view = engine.pool.slot_view(entry.slot)
        before = view[: entry.header.payload_bytes].clone()
        change(view, _planes(engine, entry))
        changed += int(not bool((view[: entry.header.payload_bytes] == before).all()))
    return changed


def swap_planes(engine, tokens) -> int:
    def change(view, planes):
        for a in range(len(planes)):
            for b in range(a + 1, len(planes)):
                (_, oa, na, ra), (_, ob, nb, rbb) = planes[a], planes[b]
                if ra == rbb:
                    size = min(na, nb) * ra
                    tmp = view[oa: oa + size].clone()
                    view[oa: oa + size] = view[ob: ob + size]
                    view[ob: ob + size] = tmp
                    return
    return _rewrite(engine, tokens, change)


def shift_block(engine, tokens) -> int:
    def change(view, planes):
        for _, off, n, rb in planes:
            if n > 1:
                rows = view[off: off + n * rb].clone().view(n, rb)
                view[off: off + n * rb] = rows.roll(-1, dims=0).reshape(-1)
    return _rewrite(engine, tokens, change)


def layout_rule(engine, tokens) -> int:
    def change(view, planes):
        for _, off, n, rb in planes:
            half = rb // 2
            rows = view[off: off + n * rb].clone().view(n, rb)
            view[off: off + n * rb] = torch_cat_halves(rows, half).reshape(-1)
    return _rewrite(engine, tokens, change)


def torch_cat_halves(rows, half: int):
    import torch

    return torch.cat([rows[:, half: 2 * half], rows[:, :half], rows[:, 2 * half:]], dim=1)


def state_from(engine, tokens, other_tokens) -> int:
    """Each window piece of ``tokens``' chunks (a recurrent-state snapshot) replaced by the same
    piece stored for ``other_tokens``' last chunk that has one: a snapshot of another position.
    Pieces are read through the engine's storage (a lower tier's are promoted into the pool)."""
    from kvconnect.restore.parts import window_key

    storage, pool, pieces = engine.storage, engine.pool, range(len(engine.parts.pieces))
    donor_chunks = engine.chunks(np.asarray(other_tokens, np.int64), include_partial=False)
    changed = 0
    for c in engine.chunks(np.asarray(tokens, np.int64), include_partial=False):
        for p in pieces:
            (entry,) = storage.acquire([window_key(c.key, p)])
            if entry is None:
                continue
            for d in reversed(donor_chunks):
                (donor,) = storage.acquire([window_key(d.key, p)])
                ok = donor is not None and donor.slot != entry.slot and donor.header.payload_bytes == entry.header.payload_bytes
                if ok:
                    n = entry.header.payload_bytes
                    view, theirs = pool.slot_view(entry.slot), pool.slot_view(donor.slot)
                    if not bool((view[:n] == theirs[:n]).all()):
                        view[:n] = theirs[:n]
                        changed += 1
                storage.release([donor])
                if ok:
                    break
            storage.release([entry])
    return changed


def apply(engine, tokens, fault: str) -> int:
    return {"swap_planes": swap_planes, "shift_block": shift_block, "layout_rule": layout_rule}[fault](engine, tokens)
