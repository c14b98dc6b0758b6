"""The cache server's bookkeeping without sockets: page allocator, eviction policies, pins, leases.

The allocator is checked against a page bitmap under random alloc/free sequences; the
index against the pool contract (pinned entries never evicted or reused, a full pool of
pinned entries refuses instead of spinning, a dead client's pins and reservations come
back, memory returns to its baseline).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.server.allocator import PageAllocator
from kvconnect.server.index import STATS_FIELDS, CacheIndex, RequestError

FP_A, FP_B = b"A" * 16, b"B" * 16
PAGE = 4096
ROWS = b"\x00\x00\x00\x00\x04\x00\x00\x00" * 2  # two planes, rows [0, 4): (u32, u32) pairs


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def header(key: bytes, payload_bytes: int, fingerprint: bytes = FP_A, mask: int = 1) -> list:
    return [fingerprint, key, 0, 64, mask, ROWS, payload_bytes, 0]


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def stats(index: CacheIndex, fingerprint=None) -> dict:
    return dict(zip(STATS_FIELDS, index.stats(fingerprint)))


def store(index, client, i, payload_bytes=PAGE, fingerprint=FP_A):
    (slot,), _ = index.reserve(client, 1)
    return index.commit(client, key(i), header(key(i), payload_bytes, fingerprint), slot)


# --- allocator -------------------------------------------------------------------------


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 1000)), max_size=120))
def test_allocator_matches_a_page_bitmap(ops):
    num_pages = 40
    alloc = PageAllocator(num_pages)
    used = np.zeros(num_pages, bool)
    runs: list[tuple[int, int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc or not runs:
            first = alloc.alloc(n)
            free_runs = [s for s in range(num_pages - n + 1) if not used[s : s + n].any()]
            if first is None:
                assert not free_runs, "a free run existed but alloc refused"
                continue
            assert first == free_runs[0], "first fit"
            used[first : first + n] = True
            runs.append((first, n))
        else:
            first, n = runs.pop(pick % len(runs))
            alloc.free(first, n)
            used[first : first + n] = False
        assert alloc.free_pages == num_pages - used.sum()
        # extents are maximal: no two free extents touch
        assert alloc.num_extents == int(np.sum(np.diff(np.concatenate([[1], used.astype(int)])) == -1))
    for first, n in runs:
        alloc.free(first, n)
    assert alloc.free_pages == num_pages and alloc.num_extents == 1 and alloc.largest_run() == num_pages


def test_allocator_refuses_double_and_out_of_range_frees():
    alloc = PageAllocator(10)
    a = alloc.alloc(4)
    alloc.free(a, 4)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a, 4)
    b = alloc.alloc(2)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b, 3)  # overlaps a free page
    with pytest.raises(ValueError, match="outside"):
        alloc.free(9, 2)
    with pytest.raises(ValueError):
        alloc.alloc(0)
    assert alloc.free_pages == 8


# --- index -----------------------------------------------------------------------------


def make(num_pages=8, lease_s=5.0, eviction="lru"):
    """An index; LRU unless asked (the assertions on eviction order below are LRU's)."""
    clock = FakeClock()
    return CacheIndex(num_pages, PAGE, lease_s=lease_s, clock=clock, eviction=eviction), clock


def test_lru_eviction_spares_pinned_and_recent_entries():
    index, _ = make(num_pages=4)
    c = index.hello(b"c" * 16, 1, FP_A, PAGE)
    ids = [store(index, c, i) for i in range(4)]
    pinned = index.acquire(c, [key(0)], 1 << 20)  # 0 pinned
    index.acquire(c, [key(1)], 1 << 20)  # 1 touched (most recent) ...
    index.release(c, [pinned[0][0] + 1])  # ... and released again
    slots, evicted = index.reserve(c, 2)
    assert len(slots) == 2
    assert [e.key for e in evicted] == [key(2), key(3)]  # least recently used first, 0 is pinned
    assert index.masks([key(i) for i in range(4)]) == [1, 1, None, None]
    assert {s for s in slots} == {e.first_page for e in evicted}
    assert ids[0] in index.by_id


def test_full_pool_of_pinned_entries_refuses_without_spinning():
    index, _ = make(num_pages=3)
    c = index.hello(b"c" * 16, 1, FP_A, PAGE)
    for i in range(3):
        store(index, c, i)
    index.acquire(c, [key(0), key(1), key(2)], 1 << 20)
    slots, evicted = index.reserve(c, 5)
    assert slots == [] and evicted == []
    assert stats(index)["reserve_shortfalls"] == 1 and stats(index)["num_entries"] == 3


def test_replaced_entry_keeps_its_pages_until_the_reader_releases():
    index, _ = make(num_pages=2)
    c = index.hello(b"c" * 16, 1, FP_A, PAGE)
    old = store(index, c, 7)
    ((entry_id, old_page, _),) = index.acquire(c, [key(7)], 1 << 20)
    new = store(index, c, 7)  # replaces the pinned entry: its run must not be reused yet
    slots, evicted = index.reserve(c, 2)
    assert [e.entry_id for e in evicted] == [new] and old_page not in slots and len(slots) == 1
    assert index.masks([key(7)]) == [None]
    index.release(c, [entry_id])  # the reader is done: now the old run comes back
    assert entry_id == old and index.reserve(c, 1)[0] == [old_page]
    index.abort(c, sorted(c.reserved))
    assert stats(index)["used_pages"] == 0 and not index.by_id


def test_mixed_run_lengths_evict_until_a_contiguous_run_fits():
    index, _ = make(num_pages=6)
    small = index.hello(b"s" * 16, 1, FP_A, PAGE)  # 1 page per chunk
    big = index.hello(b"b" * 16, 2, FP_B, 3 * PAGE)  # 3 pages per chunk
    for i in range(6):
        store(index, small, i)
    slots, evicted = index.reserve(big, 1)
    assert len(slots) == 1 and len(evicted) == 3  # the three LRU small entries made the run
    assert index.masks([key(i) for i in range(6)]) == [None, None, None, 1, 1, 1]
    assert [e.key for e in evicted] == [key(0), key(1), key(2)]


def test_commit_checks_ownership_key_fingerprint_and_size():
    index, _ = make()
    a = index.hello(b"a" * 16, 1, FP_A, PAGE)
    b = index.hello(b"b" * 16, 2, FP_A, PAGE)
    (slot,), _ = index.reserve(a, 1)
    with pytest.raises(RequestError, match="not reserved"):
        index.commit(b, key(1), header(key(1), 10), slot)
    assert slot in a.reserved  # another client's attempt changes nothing
    for bad, reason in ((header(key(2), 10), "key"), (header(key(1), 10, FP_B), "fingerprint"),
                        (header(key(1), PAGE + 1), "exceeds")):
        (slot,), _ = index.reserve(a, 1) if slot not in a.reserved else ((slot,), [])
        with pytest.raises(RequestError, match=reason):
            index.commit(a, key(1), bad, slot)
        assert slot not in a.reserved and stats(index)["used_pages"] == 0  # a refused commit gives the run back
    (slot,), _ = index.reserve(a, 1)
    index.commit(a, key(1), header(key(1), PAGE), slot)
    with pytest.raises(RequestError, match="not reserved"):  # a slot commits once
        index.commit(a, key(2), header(key(2), PAGE), slot)
    assert stats(index)["used_pages"] == 1 and index.masks([key(1)]) == [1]


def test_release_of_pins_not_held_is_ignored():
    index, _ = make()
    a = index.hello(b"a" * 16, 1, FP_A, PAGE)
    b = index.hello(b"b" * 16, 2, FP_A, PAGE)
    entry_id = store(index, a, 1)
    index.acquire(a, [key(1)], 1 << 20)
    assert index.release(b, [entry_id, entry_id, 999]) == 0  # b holds nothing: no effect
    assert stats(index)["pinned_entries"] == 1
    assert index.release(a, [entry_id, entry_id]) == 1  # a held one pin
    assert stats(index)["pinned_entries"] == 0


def test_expired_client_loses_pins_and_reservations():
    index, clock = make(num_pages=4, lease_s=2.0)
    live = index.hello(b"l" * 16, 1, FP_A, PAGE)
    dead = index.hello(b"d" * 16, 2, FP_A, PAGE)
    for i in range(2):
        store(index, live, i)
    index.acquire(dead, [key(0), key(1)], 1 << 20)
    index.reserve(dead, 2)
    clock.now_s = 1.5
    index.touch(live.client_id)
    assert index.expire() == []
    clock.now_s = 2.5
    assert index.expire() == [dead.client_id]
    s = stats(index)
    assert (s["pinned_entries"], s["reserved_runs"], s["used_pages"], s["num_clients"]) == (0, 0, 2, 1)
    assert len(index.reserve(live, 4)[0]) == 4  # the formerly pinned entries are evictable again


def test_hello_with_another_layout_starts_a_clean_session():
    index, _ = make()
    c = index.hello(b"c" * 16, 1, FP_A, PAGE)
    index.reserve(c, 2)
    again = index.hello(b"c" * 16, 1, FP_A, PAGE)
    assert again is c and len(c.reserved) == 2  # same layout: a lease refresh
    fresh = index.hello(b"c" * 16, 1, FP_A, 2 * PAGE)
    assert fresh is not c and not fresh.reserved and stats(index)["used_pages"] == 0


def test_clear_is_per_namespace_and_counts_follow():
    index, _ = make(num_pages=8)
    a = index.hello(b"a" * 16, 1, FP_A, PAGE)
    b = index.hello(b"b" * 16, 2, FP_B, PAGE)
    for i in range(3):
        store(index, a, i, fingerprint=FP_A)
    for i in range(10, 12):
        store(index, b, i, fingerprint=FP_B)
    assert stats(index, FP_A)["namespace_entries"] == 3 and stats(index, FP_B)["namespace_entries"] == 2
    assert index.clear(FP_A) == 3
    assert stats(index, FP_A)["namespace_entries"] == 0 and stats(index)["num_entries"] == 2
    assert index.remove(key(10)) and not index.remove(key(10))
    assert index.clear(None) == 1 and stats(index)["used_pages"] == 0


def test_acquire_reply_stays_within_its_byte_budget():
    index, _ = make(num_pages=8)
    c = index.hello(b"c" * 16, 1, FP_A, PAGE)
    for i in range(6):
        store(index, c, i)
    first = index.acquire(c, [key(i) for i in range(6)], 400)
    assert 0 < len(first) < 6  # partial: the client asks again for the rest
    rest = index.acquire(c, [key(i) for i in range(len(first), 6)], 1 << 20)
    assert len(first) + len(rest) == 6 and all(item is not None for item in first + rest)


@given(st.lists(st.tuples(st.sampled_from(["store", "pin", "unpin", "reserve", "abort", "drop"]), st.integers(0, 11)), max_size=80))
def test_random_sessions_return_memory_to_baseline(ops):
    """Whatever clients do, once they are gone every page is free or held by a live entry."""
    index, _ = make(num_pages=10)
    clients = [index.hello(bytes([i]) * 16, i, FP_A, (1 + i) * PAGE) for i in range(3)]
    held: list = [[] for _ in clients]
    for op, i in ops:
        c = i % 3
        state = clients[c]
        if state.client_id not in index.clients:
            continue
        if op == "store":
            slots, _ = index.reserve(state, 1)
            if slots:
                index.commit(state, key(i), header(key(i), PAGE), slots[0])
        elif op == "pin":
            held[c] += [item[0] for item in index.acquire(state, [key(i)], 1 << 20) if item is not None]
        elif op == "unpin" and held[c]:
            index.release(state, [held[c].pop()])
        elif op == "reserve":
            index.reserve(state, 1)
        elif op == "abort":
            index.abort(state, sorted(state.reserved)[:1])
        elif op == "drop":
            index.drop_client(state)
        live_pages = sum(e.num_pages for e in index.entries.values())
        dead_pinned = sum(e.num_pages for e in index.by_id.values() if not e.live)
        reserved = sum(len(s.reserved) * s.run_pages for s in index.clients.values())
        assert live_pages + dead_pinned + reserved == stats(index)["used_pages"]
    for state in list(index.clients.values()):
        index.drop_client(state)
    assert stats(index)["used_pages"] == sum(e.num_pages for e in index.entries.values())
    assert all(e.refs == 0 for e in index.entries.values())
    index.clear(None)
    assert stats(index)["used_pages"] == 0 and index.allocator.num_extents == 1


def test_client_sessions_are_bounded_and_expire():
    clock = FakeClock()
    index = CacheIndex(8, PAGE, lease_s=1.0, clock=clock, max_clients=3)
    for i in range(3):
        index.hello(bytes([i]) * 16, i, FP_A, PAGE)
    with pytest.raises(RequestError, match="sessions"):
        index.hello(b"x" * 16, 9, FP_A, PAGE)
    index.hello(bytes([0]) * 16, 0, FP_A, PAGE)  # an existing session still refreshes
    clock.now_s = 2.0
    assert len(index.expire()) == 3
    index.hello(b"x" * 16, 9, FP_A, PAGE)
    assert stats(index)["num_clients"] == 1


def test_sessions_belong_to_their_principal_and_are_bounded_per_principal():
    clock = FakeClock()
    index = CacheIndex(8, PAGE, lease_s=1.0, clock=clock, max_clients=5, max_clients_per_principal=2)
    mine = index.hello(b"m" * 16, 1, FP_A, PAGE, principal="uid:0")
    index.hello(b"a" * 16, 2, FP_A, PAGE, principal="uid:65534")
    index.hello(b"b" * 16, 3, FP_A, PAGE, principal="uid:65534")
    with pytest.raises(RequestError, match="limit"):
        index.hello(b"c" * 16, 4, FP_A, PAGE, principal="uid:65534")
    index.hello(b"d" * 16, 5, FP_A, PAGE, principal="uid:0")  # another peer still gets in
    with pytest.raises(RequestError, match="another peer"):
        index.touch(mine.client_id, "uid:65534")  # a session is usable only by the peer that opened it
    with pytest.raises(RequestError, match="another peer"):
        index.hello(mine.client_id, 1, FP_A, PAGE, principal="uid:65534")
    assert index.touch(mine.client_id, "uid:0") is mine
    index.drop_client(index.clients[b"a" * 16])
    index.hello(b"c" * 16, 4, FP_A, PAGE, principal="uid:65534")  # a dropped session frees its peer's share
    assert stats(index)["num_clients"] == 4 and stats(index)["refused_sessions"] == 1


def test_the_default_policy_is_s3fifo_and_keeps_part_of_a_cycle_lru_loses():
    """The issue's small-pool case on the shared pool: 10 prefixes of 10 chunks cycled through
    a pool of 60 one-page entries. Each request looks its prefix up (acquire + release: a use)
    and stores the chunks it missed; LRU evicts every prefix just before its next turn."""
    assert CacheIndex(8, PAGE, lease_s=10.0).eviction == "s3fifo"
    hits = {}
    for policy in ("s3fifo", "lru"):
        index, _ = make(num_pages=60, eviction=policy)
        c = index.hello(b"c" * 16, 1, FP_A, PAGE)
        found = 0
        for request in range(80):
            keys = [key(1000 * (request % 10) + j) for j in range(10)]
            got = index.acquire(c, keys, 1 << 20)
            present = 0
            for entry in got:  # the prefix hit ends at the first missing chunk
                if entry is None:
                    break
                present += 1
            found += present
            index.release(c, [e[0] for e in got if e is not None])
            for k in keys[present:]:
                (slot,), _ = index.reserve(c, 1)
                index.commit(c, k, header(k, PAGE), slot)
        hits[policy] = found
        assert stats(index)["pinned_entries"] == 0 and stats(index)["num_entries"] <= 60
    assert hits["lru"] == 0 and hits["s3fifo"] > 100, hits


@pytest.mark.parametrize("policy", ["s3fifo", "arc", "2q", "lru"])
def test_every_policy_spares_pinned_entries_on_the_server(policy):
    index, _ = make(num_pages=8, eviction=policy)
    c = index.hello(b"c" * 16, 1, FP_A, PAGE)
    rng = np.random.default_rng(3)
    for i in range(200):
        pinned = [e for e in index.acquire(c, [key(int(k)) for k in rng.integers(0, 12, 3)], 1 << 20) if e is not None]
        got, _ = index.reserve(c, 1)  # full from the 9th store on: evicts one unpinned entry
        assert all(index.by_id[e[0]].live for e in pinned)  # pinned entries were spared
        if got:
            k = key(i % 12 + 100 * (i % 3))
            index.commit(c, k, header(k, PAGE), got[0])
        index.release(c, [e[0] for e in pinned])
    assert stats(index)["pinned_entries"] == 0 and stats(index)["used_pages"] <= 8
