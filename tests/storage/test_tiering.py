"""StorageManager tiering: lookups walk pool -> disk -> remote in batches, hits are verified
and promoted into the pool, commits write through asynchronously with a bounded queue, and
a failing or slow tier is a miss, never an exception or a blocked step."""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import pytest

from kvconnect.chunks import chunk_format
from kvconnect.errors import ConfigError
from kvconnect.layout.spec import ChunkKey
from kvconnect.storage import ChunkPool, StorageManager
from kvconnect.storage.disk import DiskTier
from kvconnect.storage.tier import Breaker, LowerTier, StoreItem

import kv_rig
from support.redis_server import RedisNode, redis_available
from chunk_items import FP, encoded, key_of, make_item

HANG_GUARD_S = 20.0
SLOT_BYTES = 8192


class MemoryTier(LowerTier):
    """An in-process tier that records calls; ``gate`` blocks puts, ``fail`` makes calls raise."""

    name = "memory"

    def __init__(self) -> None:
        super().__init__(FP)
        self.data: dict[ChunkKey, bytes] = {}
        self.calls: list[tuple[str, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def _enter(self, op: str, n: int) -> None:
        self.calls.append((op, n))
        if self.fail:
            raise RuntimeError(f"{op} failed on purpose")

    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        self._enter("masks", len(keys))
        return [chunk_format.decode_header(self.data[k]).group_mask if k in self.data else None for k in keys]

    def get(self, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]:
        self._enter("get", len(keys))
        return [self.data.get(k) for k in keys]

    def put(self, items: Sequence[StoreItem]) -> list[bool]:
        self._enter("put", len(items))
        self.gate.wait(HANG_GUARD_S)
        for it in items:
            self.data[it.key] = it.sealed_header() + bytes(it.payload)
        return [True] * len(items)

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._enter("delete", len(keys))
        return [self.data.pop(k, None) is not None for k in keys]


def commit(manager: StorageManager, item: StoreItem) -> None:
    (slot,) = manager.reserve(1)
    manager.pool.slot_view(slot)[: item.header.payload_bytes].numpy()[:] = item.payload
    manager.commit(item.key, item.header, slot)


def pool_bytes(manager: StorageManager, key: ChunkKey) -> bytes:
    (entry,) = manager.pool.acquire([key])
    try:
        return chunk_format.encode(entry.header, manager.pool.entry_view(entry).numpy())
    finally:
        manager.pool.release([entry])


@pytest.fixture
def two_tiers(tmp_path):
    disk = DiskTier(str(tmp_path), FP, 1 << 24)
    remote = MemoryTier()
    manager = StorageManager(ChunkPool(16 * SLOT_BYTES, SLOT_BYTES), FP, [disk, remote])
    yield manager, disk, remote
    manager.close()


def test_commit_writes_through_to_every_tier(two_tiers):
    manager, disk, remote = two_tiers
    items = [make_item(i, mask=1 + i % 2) for i in range(5)]
    for it in items:
        commit(manager, it)
    assert manager.flush(HANG_GUARD_S)
    assert [bytes(d) for d in disk.get([it.key for it in items])] == [encoded(it) for it in items]
    assert [remote.data[it.key] for it in items] == [encoded(it) for it in items]
    writer_stats = [t["writer"] for t in manager.tier_stats()["tiers"]]
    assert [(w["written"], w["failed"], w["dropped_full"]) for w in writer_stats] == [(5, 0, 0), (5, 0, 0)]
    assert manager.pool.stats().extra["pinned"] == 0  # every write-behind pin released


def test_write_behind_computes_each_chunks_checksum_once_for_all_tiers(two_tiers, monkeypatch):
    """Issue 39 item 3: the disk's and the remote's writers share one checksum per chunk."""
    manager, disk, remote = two_tiers
    real, calls = chunk_format.compute_checksum, []
    monkeypatch.setattr(chunk_format, "compute_checksum", lambda header, payload: calls.append(header.key) or real(header, payload))
    items = [make_item(i) for i in range(4)]
    for it in items:
        commit(manager, it)
    assert manager.flush(HANG_GUARD_S)
    assert sorted(calls) == sorted(it.key for it in items)  # once per chunk, not once per tier
    monkeypatch.setattr(chunk_format, "compute_checksum", real)
    assert [bytes(d) for d in disk.get([it.key for it in items])] == [encoded(it) for it in items]  # verified on read
    assert [remote.data[it.key] for it in items] == [encoded(it) for it in items]


def test_masks_walk_tiers_in_order_batched(two_tiers):
    manager, disk, remote = two_tiers
    commit(manager, make_item(0, mask=1))  # pool (and, written through, below)
    manager.flush(HANG_GUARD_S)
    disk.put([make_item(1, mask=2)])
    remote.data[key_of(2)] = encoded(make_item(2, mask=3))
    remote.calls.clear()
    keys = [key_of(i) for i in range(5)]
    assert manager.masks(keys) == [1, 2, 3, None, None]
    assert remote.calls == [("masks", 3)]  # one batched call with only the keys still missing
    assert len(manager.pool) == 1  # masks promotes nothing


def test_acquire_promotes_verified_hits_and_fills_upper_tiers(two_tiers):
    manager, disk, remote = two_tiers
    disk.put([make_item(1)])
    remote.data[key_of(2)] = encoded(make_item(2))
    remote.data[key_of(3)] = encoded(make_item(3))
    entries = manager.acquire([key_of(i) for i in range(5)])
    try:
        assert [e is not None for e in entries] == [False, True, True, True, False]
        for i in (1, 2, 3):
            assert pool_bytes(manager, key_of(i)) == encoded(make_item(i))
    finally:
        manager.release(entries)
    assert manager.promotions == 3
    manager.flush(HANG_GUARD_S)
    assert disk.masks([key_of(2), key_of(3)]) == [1, 1]  # remote hits now cached on disk
    assert key_of(1) not in remote.data  # a disk hit is not pushed down again


def test_promotion_batches_bound_memory(tmp_path):
    remote = MemoryTier()
    manager = StorageManager(ChunkPool(16 * SLOT_BYTES, SLOT_BYTES), FP, [remote])
    manager._fetch_batch = 3
    for i in range(8):
        remote.data[key_of(i)] = encoded(make_item(i))
    entries = manager.acquire([key_of(i) for i in range(8)])
    assert all(e is not None for e in entries)
    assert [c for c in remote.calls if c[0] == "get"] == [("get", 3), ("get", 3), ("get", 2)]
    manager.release(entries)
    manager.close()


def test_no_free_slot_means_a_miss_not_a_wait(tmp_path):
    remote = MemoryTier()
    manager = StorageManager(ChunkPool(2 * SLOT_BYTES, SLOT_BYTES), FP, [remote])
    remote.data[key_of(9)] = encoded(make_item(9))
    held = manager.reserve(2)  # every slot owned by a writer
    assert manager.acquire([key_of(9)]) == [None]
    assert manager.promotion_failures == 1
    manager.abort(held)
    (entry,) = manager.acquire([key_of(9)])
    assert entry is not None
    manager.release([entry])
    manager.close()


def test_full_write_queue_drops_and_never_blocks():
    slow = MemoryTier()
    slow.gate.clear()  # the tier hangs on put
    manager = StorageManager(ChunkPool(8 * SLOT_BYTES, SLOT_BYTES), FP, [slow],
                             max_pending_write_bytes=2 * 4096, max_queued_writes=1)
    items = [make_item(i) for i in range(6)]
    t0 = time.monotonic()
    for it in items:
        commit(manager, it)
    assert time.monotonic() - t0 < HANG_GUARD_S
    w = manager.tier_stats()["tiers"][0]["writer"]
    # 2 pinned + 1 queued unpinned (+ at most 1 more if the thread took a batch early).
    assert w["submitted"] + w["dropped_full"] == 6 and w["dropped_full"] >= 2
    assert manager.pool.stats().extra["pinned"] <= 2  # the byte bound caps pinned pool memory
    slow.gate.set()
    assert manager.flush(HANG_GUARD_S)
    w = manager.tier_stats()["tiers"][0]["writer"]
    assert w["written"] == w["submitted"] == len(slow.data)
    assert all(slow.data[it.key] == encoded(it) for it in items if it.key in slow.data)
    assert manager.pool.stats().extra["pinned"] == 0
    manager.close()


def test_unpinned_queued_write_evicted_before_its_turn_is_counted():
    slow = MemoryTier()
    slow.gate.clear()
    manager = StorageManager(ChunkPool(2 * SLOT_BYTES, SLOT_BYTES), FP, [slow], max_pending_write_bytes=4096)
    commit(manager, make_item(0))  # pinned: the thread blocks on it
    # alone: a thread slow to wake would batch item 1 with it and pin both slots of the pool
    deadline = time.monotonic() + HANG_GUARD_S
    while ("put", 1) not in slow.calls:
        assert time.monotonic() < deadline, "the writer never took item 0"
        time.sleep(0.01)
    for i in (1, 2, 3):
        commit(manager, make_item(i))  # unpinned: 1 and 2 are evicted by later commits
    slow.gate.set()
    assert manager.flush(HANG_GUARD_S)
    w = manager.tier_stats()["tiers"][0]["writer"]
    assert w["written"] + w["evicted_before_write"] == w["submitted"] == 4
    assert key_of(0) in slow.data and key_of(3) in slow.data and w["evicted_before_write"] >= 1
    assert all(slow.data[k] == encoded(make_item(int.from_bytes(k, "little"))) for k in slow.data)
    manager.close()


def test_a_raising_tier_is_a_miss():
    broken = MemoryTier()
    broken.data[key_of(1)] = encoded(make_item(1))
    broken.fail = True
    manager = StorageManager(ChunkPool(4 * SLOT_BYTES, SLOT_BYTES), FP, [broken])
    assert manager.masks([key_of(1)]) == [None]
    assert manager.acquire([key_of(1)]) == [None]
    assert manager.export_chunk(key_of(1)) is None
    commit(manager, make_item(2))
    assert manager.flush(HANG_GUARD_S)
    assert manager.tier_failures == 3
    assert manager.tier_stats()["tiers"][0]["writer"]["failed"] == 1
    manager.close()


def test_drop_and_export_reach_lower_tiers(two_tiers):
    manager, disk, remote = two_tiers
    commit(manager, make_item(4))
    manager.flush(HANG_GUARD_S)
    manager.pool.clear()
    assert manager.export_chunk(key_of(4)) == encoded(make_item(4))  # served from disk
    manager.drop(key_of(4))
    manager.flush(HANG_GUARD_S)
    assert disk.masks([key_of(4)]) == [None] and key_of(4) not in remote.data
    assert manager.masks([key_of(4)]) == [None] and manager.corrupt_chunks == 1


def test_import_chunk_writes_through(two_tiers):
    manager, disk, remote = two_tiers
    assert manager.import_chunk(encoded(make_item(6)), key_of(6))
    manager.flush(HANG_GUARD_S)
    assert bytes(disk.get([key_of(6)])[0]) == encoded(make_item(6)) == remote.data[key_of(6)]


def test_breaker_backs_off_and_recovers():
    breaker = Breaker(retry_after_s=0.05, max_retry_after_s=0.1)
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow()
    deadline = time.monotonic() + HANG_GUARD_S
    while not breaker.allow():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    breaker.success()
    assert breaker.allow() and not breaker.open


def test_config_builds_tiers_and_rejects_bad_urls(tmp_path):
    layout = kv_rig.mla_layout()
    eng = kv_rig.make_engine(layout, local_disk=str(tmp_path), max_local_disk_size=0.0)
    assert eng.storage.tiers == []  # a disk path without a size: off (and logged)
    eng.close()
    with pytest.raises(ConfigError):
        kv_rig.make_engine(layout, remote_url="memcached://h:1")


@pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))
def test_engine_pool_disk_redis_end_to_end(tmp_path):
    with RedisNode(tmp_path / "redis") as node:
        layout = kv_rig.mla_layout()
        cfg = dict(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01, remote_url=node.url)
        eng = kv_rig.make_engine(layout, **cfg)
        n = 6 * kv_rig.CHUNK_TOKENS
        assert kv_rig.store_prompt(eng, 4, n) == n
        assert eng.storage.flush(HANG_GUARD_S)
        disk, remote = eng.storage.tiers
        assert len(disk) == 6 and int(node.cli("dbsize")) == 6
        # Only on the remote: the disk lost its copies (e.g. another machine stored them).
        disk.delete(list(eng.chunks(kv_rig.tokens(4, n), include_partial=False)[i].key for i in range(6)))
        eng.pool.clear()
        assert eng.lookup(kv_rig.tokens(4, n)) == n
        assert kv_rig.retrieve_prompt(eng, 4, n) == n
        assert eng.storage.flush(HANG_GUARD_S) and len(disk) == 6  # promoted hits cached on disk
        # A repeated store of a stored prompt writes nothing new anywhere.
        puts = (disk.stats().puts, remote.stats().puts)
        kv_rig.store_prompt(eng, 4, n)
        eng.storage.flush(HANG_GUARD_S)
        assert (disk.stats().puts, remote.stats().puts) == puts
        eng.close()
