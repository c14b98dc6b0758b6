"""A plain-torch reference of what rebuilt.py's rule rests on (issue 38 item 1(b)).

A one-layer model (tiny, random weights, float32) with the two engine-rebuilt structures vLLM
registers for DeepSeek V4.1 / Qwen4-exp / GLM-5-Next / Step5:

- a ratio-R gated compressor with a ring: each token's [kv, score] row goes to ring row p % C
  (C a multiple of R, as every registering model sizes it); the token closing a group (p + 1 % R
  == 0) pools the group's R ring rows with a per-channel softmax gate into one compressed row (the
  prefix-cacheable compressed cache). The ring itself is per request, never stored;
- a sliding window of W raw rows under bounded replay: after a hit at H the window's rows are
  recomputed over [H - W, H) (vLLM's ``Scheduler._mark_prefix_replay``), never stored.

Each token attends to the compressed rows of closed groups and to its window. Tokens are computed
one at a time (the same ops whatever the chunking), so a cold run and a resumed one are comparable
bit for bit. A resume at H restores the compressed cache byte-exact (what kvconnect stores), gives
the request a fresh ring full of garbage (NaN: vLLM claims a ring block it never zeroes) and
replays the window. At H = kR the outputs equal the cold run's bit for bit; at H != kR they differ
(the group closing after H reads ring rows written before H) unless the ring is restored too: the
negative control, and why ``KVLayout.resume_every`` puts every hit on the ring's period.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvconnect import Config, KVCacheEngine
from kvconnect.layout.kv_layout import KVLayout
from kvconnect.layout.spec import GroupSpec, RebuiltGroup
from support import zoo

VOCAB, DIM, RATIO, CAPACITY, WINDOW = 50, 16, 4, 8, 6


class Reference:
    """The model's weights and its per-request caches (compressed rows, ring, window rows)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = {name: torch.randn(shape, generator=g) * 0.3 for name, shape in dict(
            emb=(VOCAB, DIM), q=(DIM, DIM), k=(DIM, DIM), v=(DIM, DIM), kv=(DIM, DIM), gate=(DIM, DIM),
            out=(DIM, VOCAB)).items()}

    def fresh(self, max_tokens: int) -> dict:
        return dict(compressed=torch.full((max_tokens // RATIO, DIM), float("nan")),
                    ring=torch.full((CAPACITY, 2 * DIM), float("nan")),  # never zeroed
                    k=torch.full((max_tokens, DIM), float("nan")), v=torch.full((max_tokens, DIM), float("nan")))

    def window_rows(self, state: dict, tokens: np.ndarray, p: int) -> torch.Tensor:
        """Write token p's window K / V (what a bounded replay recomputes); return its embedding."""
        x = self.w["emb"][int(tokens[p])]
        state["k"][p], state["v"][p] = x @ self.w["k"], x @ self.w["v"]
        return x

    def step(self, state: dict, tokens: np.ndarray, p: int) -> torch.Tensor:
        """Compute token p: ring row, the group it closes, window rows, attention; its logits."""
        x = self.window_rows(state, tokens, p)
        state["ring"][p % CAPACITY] = torch.cat([x @ self.w["kv"], x @ self.w["gate"]])
        if (p + 1) % RATIO == 0:  # the closing token pools the group's ring rows
            rows = state["ring"][[(p - i) % CAPACITY for i in range(RATIO - 1, -1, -1)]]
            kv, score = rows[:, :DIM], rows[:, DIM:]
            state["compressed"][(p + 1) // RATIO - 1] = (torch.softmax(score, dim=0) * kv).sum(0)
        closed = (p + 1) // RATIO
        lo = max(0, p - WINDOW + 1)
        keys = torch.cat([state["compressed"][:closed], state["k"][lo:p + 1]])
        values = torch.cat([state["compressed"][:closed], state["v"][lo:p + 1]])
        q = x @ self.w["q"]
        attn = torch.softmax(keys @ q / math.sqrt(DIM), dim=0) @ values
        return attn @ self.w["out"]

    def cold(self, tokens: np.ndarray) -> tuple[list[torch.Tensor], list[dict]]:
        """Logits of every position, and the state after each prefix length (snapshots)."""
        state, logits, snaps = self.fresh(len(tokens)), [], [None]
        for p in range(len(tokens)):
            logits.append(self.step(state, tokens, p))
            snaps.append({k: v.clone() for k, v in state.items()})
        return logits, snaps

    def resumed(self, tokens: np.ndarray, hit: int, restored_compressed: torch.Tensor,
                ring: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Resume at ``hit``: compressed rows as restored, a fresh ring (or ``ring``), the window replayed."""
        state = self.fresh(len(tokens))
        state["compressed"][: hit // RATIO] = restored_compressed[: hit // RATIO]
        if ring is not None:
            state["ring"] = ring.clone()
        for p in range(max(0, hit - WINDOW), hit):  # bounded replay: the window's rows only
            self.window_rows(state, tokens, p)
        return [self.step(state, tokens, p) for p in range(hit, len(tokens))]


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def _through_kvconnect(compressed: torch.Tensor, tokens: np.ndarray, hit_upto: int) -> tuple[int, torch.Tensor]:
    """Store the compressed cache through kvconnect under a layout that names the ring and the
    replayed window as rebuilt groups; move the chunks to a fresh engine as a shared tier would,
    look up and retrieve into a fresh cache: (hit, the retrieved rows)."""
    block_tokens = 8  # 2 compressed rows a block
    blocks = len(tokens) // block_tokens + 1
    rebuilt = (RebuiltGroup(what=f"ring(capacity {CAPACITY})", resume_every=CAPACITY),
               RebuiltGroup(what=f"window {WINDOW}, bounded replay", resume_every=block_tokens))
    table = [np.arange(blocks, dtype=np.int64)]

    def engine_over(cache: torch.Tensor) -> KVCacheEngine:
        layout = KVLayout.from_tensors({"c": cache}, groups=[GroupSpec(block_size=block_tokens, compress_ratio=RATIO)],
                                       rebuilt=rebuilt)
        return KVCacheEngine(layout, Config(chunk_size=4, max_local_cpu_size=0.01))

    src = torch.zeros(blocks, block_tokens // RATIO, DIM)
    src.view(-1, DIM)[: len(compressed)] = compressed
    engine = engine_over(src)
    assert engine.store(tokens, table) == len(tokens)
    dst = torch.zeros_like(src)
    engine_dst = engine_over(dst)
    assert engine_dst.layout.fingerprint == engine.layout.fingerprint
    zoo.transplant(engine, engine_dst, tokens)
    hit = engine_dst.lookup(tokens[:hit_upto])
    assert engine_dst.retrieve(tokens[:hit_upto], table) == hit
    return hit, dst.view(-1, DIM)


@pytest.mark.parametrize("seed", [0, 1])
def test_restore_on_the_ring_period_equals_the_cold_run_bit_for_bit(seed):
    model = Reference(seed)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, 64)
    logits, snaps = model.cold(tokens)
    assert all(torch.isfinite(x).all() for x in logits)
    for hit in (8, 16, 24, 40):  # multiples of the ring's capacity (and its period)
        restored = snaps[hit]["compressed"].clone()
        after = model.resumed(tokens, hit, restored)
        assert _bits_equal(after, logits[hit:]), hit


@pytest.mark.parametrize("hit", [9, 13, 27, 42])
def test_off_the_period_the_fresh_ring_breaks_the_run_unless_restored(hit):
    """The negative control: the group open at ``hit`` closes reading ring rows written before it."""
    model = Reference(0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 64)
    logits, snaps = model.cold(tokens)
    restored = snaps[hit]["compressed"].clone()
    fresh = model.resumed(tokens, hit, restored)
    assert not _bits_equal(fresh, logits[hit:])
    with_ring = model.resumed(tokens, hit, restored, ring=snaps[hit]["ring"])
    assert _bits_equal(with_ring, logits[hit:])


def test_kvconnect_restores_the_compressed_rows_only_on_the_period():
    """The compressed cache through kvconnect (chunks of 4 tokens, rebuilt groups needing multiples
    of 8): a lookup of 45 tokens hits 40, and the resume from kvconnect's rows equals the cold run."""
    model = Reference(3)
    tokens = np.random.default_rng(3).integers(0, VOCAB, 48)
    logits, snaps = model.cold(tokens)
    hit, rows = _through_kvconnect(snaps[-1]["compressed"], tokens, 45)
    assert hit == 40
    assert torch.equal(rows[: hit // RATIO], snaps[hit]["compressed"][: hit // RATIO])
    assert _bits_equal(model.resumed(tokens, hit, rows.clone()), logits[hit:])
