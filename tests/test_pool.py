"""The CPU pool: LRU, pins, accounting, and an engine under concurrent pressure.

Under pressure several threads store, look up and retrieve overlapping prompts through one
engine whose pool holds fewer chunks than the prompts need. Every retrieve is checked byte
for byte: each restored chunk equals one stored version of that chunk, rows past the hit
are untouched, nothing deadlocks (bounded joins) and no slot or pin leaks.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from support import zoo
from kvconnect import KVCacheEngine
from kvconnect.transfer import dispatch
from kvconnect.chunks.chunk_format import ChunkHeader
from kvconnect.storage import ChunkPool

SLOT = 64


def _header(key: bytes, payload_bytes: int = SLOT) -> ChunkHeader:
    return ChunkHeader(fingerprint=bytes(16), key=key, token_start=0, token_end=1, group_mask=1,
                       plane_rows=((0, 1),), payload_bytes=payload_bytes)


def _put(pool: ChunkPool, key: bytes, fill: int) -> bool:
    slots = pool.reserve(1)
    if not slots:
        return False
    pool.slot_view(slots[0]).fill_(fill)
    pool.commit(key, _header(key), slots[0])
    return True


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _free_slots_are_distinct(pool: ChunkPool) -> None:
    """Reserve every free slot at once: no slot may come back twice (a double free would)."""
    free = pool.num_slots - pool.stats().used_slots
    slots = pool.reserve(free)
    assert len(slots) == len(set(slots)) == free
    pool.abort(slots)


def test_lru_eviction_order():
    pool = ChunkPool(4 * SLOT, SLOT, eviction="lru")
    for i in range(4):
        assert _put(pool, _key(i), i)
    pool.release(pool.acquire([_key(0), _key(7)]))  # touch 0 (7 is a miss): 1 is now least recent
    assert pool.masks([_key(1)]) == [1]  # masks() does not touch
    assert _put(pool, _key(9), 9)
    assert pool.masks([_key(i) for i in (0, 1, 2, 3, 9)]) == [1, None, 1, 1, 1]
    assert _put(pool, _key(10), 10)
    assert pool.masks([_key(i) for i in (0, 2, 3)]) == [1, None, 1]
    assert pool.stats().evictions == 2


def test_pinned_entries_survive_eviction_remove_clear_and_replace():
    pool = ChunkPool(3 * SLOT, SLOT)
    evicted = []
    pool.on_evict.append(lambda e: evicted.append(e.key))
    assert _put(pool, _key(0), 0xAA)
    (pinned,) = pool.acquire([_key(0)])
    view = pool.entry_view(pinned)
    for i in range(1, 10):  # pressure: every other entry comes and goes
        assert _put(pool, _key(i), i)
    assert _key(0) not in evicted and bool((view == 0xAA).all())
    assert pool.remove(_key(0)) is True
    pool.clear()
    assert pool.stats().used_slots == 1  # dropped from the index, its slot still held
    assert _put(pool, _key(0), 0x55)  # a new version of the same key
    assert _put(pool, _key(20), 1) and _put(pool, _key(21), 2)  # the last one evicts key 0's new version
    assert pool.masks([_key(0), _key(20), _key(21)]) == [None, 1, 1]
    assert bool((view == 0xAA).all()), "a pinned entry's bytes changed"
    assert pool.stats().used_slots == 3
    pool.release([pinned])
    assert pool.stats().used_slots == 2
    assert pool.stats().extra["pinned"] == 0
    _free_slots_are_distinct(pool)


def test_reserve_shortfall_when_everything_is_pinned():
    pool = ChunkPool(2 * SLOT, SLOT)
    _put(pool, _key(0), 0)
    _put(pool, _key(1), 1)
    pins = pool.acquire([_key(0), _key(1)])
    assert pool.reserve(1) == []  # never spins, never evicts a pin
    assert pool.stats().reserve_shortfalls == 1
    pool.release(pins)
    assert len(pool.reserve(2)) == 2


def test_commit_replacing_a_pinned_entry_frees_its_slot_once():
    pool = ChunkPool(4 * SLOT, SLOT)
    _put(pool, _key(0), 1)
    (old,) = pool.acquire([_key(0)])
    _put(pool, _key(0), 2)  # replaced while pinned
    assert pool.stats().used_slots == 2
    pool.release([old])
    assert pool.stats().used_slots == 1
    with pytest.raises(AssertionError):
        pool.release([old])  # a second release is an internal error, not a silent double free
    _free_slots_are_distinct(pool)
    (new,) = pool.acquire([_key(0)])
    assert bool((pool.entry_view(new) == 2).all())
    pool.release([new])


def test_commit_refuses_a_payload_larger_than_a_slot():
    pool = ChunkPool(2 * SLOT, SLOT)
    (slot,) = pool.reserve(1)
    with pytest.raises(ValueError):
        pool.commit(_key(0), _header(_key(0), SLOT + 1), slot)
    pool.abort([slot])
    assert pool.stats().used_slots == 0


def test_many_cycles_return_to_baseline():
    pool = ChunkPool(5 * SLOT, SLOT)
    for cycle in range(50):
        for i in range(8):
            _put(pool, _key(cycle * 8 + i), i)
        pins = pool.acquire([_key(cycle * 8 + 7), _key(cycle * 8 + 6)])
        pool.clear()
        pool.release(pins)
        assert pool.stats().used_slots == 0 and len(pool) == 0
    _free_slots_are_distinct(pool)


# ---------------------------------------------------------------------------------------
# an engine under pressure


CHUNK, N = 64, 192
NUM_PROMPTS, NUM_THREADS, OPS_PER_THREAD = 4, 4, 40


class Pressure:
    """One llama-like engine; per prompt two source versions in their own blocks; per
    thread a private destination region. The pool holds 5 chunks of the 12 in play."""

    def __init__(self, rng):
        blocks = NUM_PROMPTS * 2 * (N // 16) + NUM_THREADS * (N // 16)
        self.case = zoo.llama("flash", max_tokens=(blocks // 2) * 16, num_layers=1)
        layout = self.case.layout()
        chunk_bytes = CHUNK * sum(p.row_bytes for p in layout.planes)
        config = zoo.small_config(CHUNK, max_local_cpu_size=5 * chunk_bytes / (1 << 30))
        self.engine = KVCacheEngine(layout, config)
        assert self.engine.pool.num_slots == 5
        self.prompts = [zoo.random_tokens(rng, N) for _ in range(NUM_PROMPTS)]
        self.src = [[None, None] for _ in range(NUM_PROMPTS)]
        used: list = []  # every region gets blocks of its own
        for p in range(NUM_PROMPTS):
            for v in range(2):
                self.src[p][v] = zoo.random_tables(self.case, N, rng, avoid=[used])
                used += self.src[p][v][0]
        self.dst = []
        for _ in range(NUM_THREADS):
            self.dst.append(zoo.random_tables(self.case, N, rng, avoid=[used]))
            used += self.dst[-1][0]
        self.planes = zoo.reference_planes(self.case)
        # what each version of each chunk holds, per plane: [n rows, row bytes]
        self.versions = [[[self._rows(self.src[p][v], j) for v in range(2)] for j in range(N // CHUNK)] for p in range(NUM_PROMPTS)]

    def _rows(self, tables, chunk_index):
        r = torch.arange(chunk_index * CHUNK, (chunk_index + 1) * CHUNK)
        b = torch.as_tensor(tables[0])[r // 16]
        return [plane.get(b, r % 16).clone() for plane in self.planes]

    def clear_dst(self, t):
        r = torch.arange(N)
        b = torch.as_tensor(self.dst[t][0])[r // 16]
        for plane in self.planes:
            plane.put(b, r % 16, 0)

    def check_dst(self, t, p, hit):
        for j in range(N // CHUNK):
            got = self._rows(self.dst[t], j)
            if j < hit // CHUNK:
                assert any(all(torch.equal(a, b) for a, b in zip(got, self.versions[p][j][v])) for v in range(2)), (
                    f"thread {t} prompt {p} chunk {j}: restored bytes are no stored version"
                )
            else:
                assert all(not g.any() for g in got), f"thread {t}: rows past the hit {hit} were written"


def test_engine_under_concurrent_pressure(rng):
    w = Pressure(rng)
    errors: list = []
    hits = [0] * NUM_THREADS

    def worker(t: int, seed: int) -> None:
        local = np.random.default_rng(seed)
        try:
            for _ in range(OPS_PER_THREAD):
                p, v = int(local.integers(NUM_PROMPTS)), int(local.integers(2))
                op = local.choice(["store", "store", "lookup", "retrieve", "retrieve"])
                if op == "store":
                    stored = w.engine.store(w.prompts[p], w.src[p][v])
                    assert 0 <= stored <= N and stored % CHUNK == 0
                elif op == "lookup":
                    hit = w.engine.lookup(w.prompts[p])
                    assert 0 <= hit <= N and hit % CHUNK == 0
                else:
                    w.clear_dst(t)
                    hit = w.engine.retrieve(w.prompts[p], w.dst[t])
                    assert 0 <= hit <= N and hit % CHUNK == 0
                    hits[t] += hit
                    w.check_dst(t, p, hit)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t, int(rng.integers(2**31))), daemon=True) for t in range(NUM_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "deadlock: a worker did not finish"
    if errors:
        raise errors[0]
    for p in range(NUM_PROMPTS):  # retrieves wrote their regions, never a source block
        for v in range(2):
            for j in range(N // CHUNK):
                assert all(torch.equal(a, b) for a, b in zip(w._rows(w.src[p][v], j), w.versions[p][j][v]))
    stats = w.engine.pool.stats()
    assert stats.extra["pinned"] == 0, "pins leaked"
    assert stats.used_slots == len(w.engine.pool) <= 5, "slots leaked"
    assert stats.evictions > 0, "the test applied no pressure"
    assert sum(hits) > 0, "the test never restored anything"
    _free_slots_are_distinct(w.engine.pool)
    w.engine.pool.clear()
    assert w.engine.pool.stats().used_slots == 0


def test_eviction_during_retrieve_keeps_the_pinned_entry(rng, monkeypatch):
    """Between pinning and copying, the pool is flooded, cleared and the same keys are
    re-stored with other bytes: the retrieve still copies the version it pinned."""
    w = Pressure(rng)
    engine = w.engine
    assert engine.store(w.prompts[0], w.src[0][0]) == N
    real_scatter = dispatch.scatter
    calls = []

    def interfering_scatter(*args, **kwargs):
        calls.append(1)
        for p in (1, 2, 3):
            engine.store(w.prompts[p], w.src[p][0])  # evicts every unpinned entry
        engine.pool.clear()
        assert engine.store(w.prompts[0], w.src[0][1]) <= N  # version 1 under the same keys, if room
        return real_scatter(*args, **kwargs)

    monkeypatch.setattr(dispatch, "scatter", interfering_scatter)
    w.clear_dst(0)
    assert engine.retrieve(w.prompts[0], w.dst[0]) == N
    assert calls == [1]
    for j in range(N // CHUNK):
        got = w._rows(w.dst[0], j)
        assert all(torch.equal(a, b) for a, b in zip(got, w.versions[0][j][0])), f"chunk {j} is not the pinned version"
    assert engine.pool.stats().extra["pinned"] == 0
    monkeypatch.setattr(dispatch, "scatter", real_scatter)
    engine.pool.clear()
    assert engine.pool.stats().used_slots == 0


def test_store_does_not_evict_its_own_prefix(rng):
    """A full pool, and a prompt sharing chunk 0 with the stored one: making room for the new
    chunks evicts other entries, never the chunk this prompt starts with."""
    case = zoo.llama("flash", max_tokens=600, num_layers=1)
    layout = case.layout()
    chunk_bytes = CHUNK * sum(p.row_bytes for p in layout.planes)
    engine = KVCacheEngine(layout, zoo.small_config(CHUNK, max_local_cpu_size=4 * chunk_bytes / (1 << 30)))
    a = zoo.random_tokens(rng, 4 * CHUNK)
    assert engine.store(a, zoo.random_tables(case, len(a), rng)) == 4 * CHUNK
    b = np.concatenate([a[:CHUNK], zoo.random_tokens(rng, 3 * CHUNK)])
    assert engine.store(b, zoo.random_tables(case, len(b), rng)) == 4 * CHUNK
    assert engine.lookup(b) == 4 * CHUNK
    assert engine.lookup(a) == CHUNK
    assert engine.pool.stats().extra["pinned"] == 0


@pytest.mark.parametrize("looked_up", [True, False])
def test_a_lookup_hit_is_evicted_last(looked_up, rng):
    """Between an engine's lookup and its retrieve other requests store: the chunks of the
    hit were touched by the lookup, so the pool evicts other (older) entries first."""
    case = zoo.llama("flash", max_tokens=600, num_layers=1)
    layout = case.layout()
    chunk_bytes = CHUNK * sum(p.row_bytes for p in layout.planes)
    engine = KVCacheEngine(layout, zoo.small_config(CHUNK, max_local_cpu_size=4 * chunk_bytes / (1 << 30)))
    a, b, c = (zoo.random_tokens(rng, 2 * CHUNK) for _ in range(3))
    for prompt in (a, b):  # the pool is full, a is the least recently used
        assert engine.store(prompt, zoo.random_tables(case, len(prompt), rng)) == 2 * CHUNK
    if looked_up:
        assert engine.lookup(a) == 2 * CHUNK
    assert engine.store(c, zoo.random_tables(case, len(c), rng)) == 2 * CHUNK  # evicts two chunks
    kept, lost = (a, b) if looked_up else (b, a)
    assert engine.lookup(kept) == 2 * CHUNK and engine.lookup(lost) == 0
    assert engine.pool.stats().extra["pinned"] == 0
