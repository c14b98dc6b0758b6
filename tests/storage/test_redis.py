"""The Redis/Valkey tier against real redis-server processes started here (TCP, unix socket,
three-node cluster), and its failures: killed mid-write and mid-read, restarted, stalled
beyond the timeout, corrupt values. A failure is a miss and a counted error, never wrong
bytes, never an exception."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvconnect.errors import ConfigError, StorageError
from kvconnect.storage import redis_tier
from kvconnect.storage.redis_tier import RedisTier, cluster_nodes, parse_url
from kvconnect.throttled_warning import OnceWarnings

import kv_rig
from support.redis_server import RedisClusterNodes, RedisNode, redis_available
from chunk_items import FP, OTHER_FP, encoded, key_of, make_item

needs_redis = pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))
pytestmark = pytest.mark.redis

HANG_GUARD_S = 20.0  # generous: only catches a call that hangs, says nothing about speed


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    if redis_available() is not None:
        pytest.skip(redis_available())
    with RedisNode(tmp_path_factory.mktemp("redis")) as n:
        yield n


@pytest.fixture
def fresh(node):
    node.cli("flushall")
    return node


def wait_until(predicate, what: str, timeout_s: float = HANG_GUARD_S):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- configuration (no server needed) ------------------------------------------------
def test_url_forms():
    assert parse_url("valkey://h:1/0") == ("redis", "redis://h:1/0")
    assert parse_url("valkeys://h:1") == ("rediss", "rediss://h:1")
    assert parse_url("unix:///tmp/r.sock?db=2") == ("unix", "unix:///tmp/r.sock?db=2")
    assert parse_url("valkey-cluster://a:1,b:2")[0] == "redis-cluster"
    assert cluster_nodes("redis-cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001/") == ([("10.0.0.1", 7000), ("::1", 7001)], "u", "p@ss")
    for bad in ("lm://h:1", "h:6379", "redis-cluster://", "redis-cluster://host"):
        with pytest.raises(ConfigError):
            RedisTier(bad, FP)


def test_missing_redis_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(StorageError, match="pip install 'kvconnect\\[redis\\]'"):
        redis_tier._import_redis()


def test_store_down_at_start_is_a_miss_not_an_error():
    tier = RedisTier("redis://127.0.0.1:1/0", FP, timeout_s=0.5)  # nothing listens on port 1
    assert tier.masks([key_of(1)]) == [None]
    assert tier.put([make_item(1)]) == [False]
    assert tier.get([key_of(1)]) == [None]  # the breaker is open now: skipped, not retried
    s = tier.stats()
    assert s.errors == 1 and s.skipped_unhealthy == 2 and not tier.healthy()


# -- a real server -------------------------------------------------------------------
@needs_redis
@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_round_trip_one_key_per_chunk(fresh, via):
    tier = RedisTier(fresh.url if via == "tcp" else fresh.unix_url, FP)
    items = [make_item(i, payload_bytes=10_000 + i, mask=1 + i) for i in range(6)]
    assert tier.put(items) == [True] * 6
    keys = [it.key for it in items] + [key_of(77)]
    assert tier.masks(keys) == [1, 2, 3, 4, 5, 6, None]
    got = tier.get(keys)
    assert [bytes(g) for g in got[:-1]] == [encoded(it) for it in items] and got[-1] is None
    stored = sorted(fresh.cli("--raw", "keys", "*").split())
    assert stored == sorted(tier.redis_key(k).decode() for k in keys[:-1])
    assert all(bytes(FP).hex() in k for k in stored)
    assert RedisTier(fresh.url, OTHER_FP).masks(keys[:2]) == [None, None]  # another layout: other keys
    assert tier.delete([keys[0], key_of(77)]) == [True, False]
    assert tier.masks([keys[0]]) == [None]
    assert tier.stats().errors == 0
    tier.close()


@needs_redis
def test_corrupt_and_foreign_values_are_misses_and_deleted(fresh):
    import redis

    tier = RedisTier(fresh.url, FP)
    tier.put([make_item(i) for i in range(3)])
    raw = redis.Redis.from_url(fresh.url)
    bad = bytearray(raw.get(tier.redis_key(key_of(0))))
    bad[-1] ^= 0x40
    raw.set(tier.redis_key(key_of(0)), bytes(bad))
    raw.set(tier.redis_key(key_of(1)), encoded(make_item(1, fp=OTHER_FP)))  # wrong fingerprint inside
    raw.set(tier.redis_key(key_of(2)), b"garbage")
    assert tier.masks([key_of(0), key_of(1), key_of(2)]) == [1, None, None]  # header is fine for 0
    assert tier.get([key_of(0), key_of(1), key_of(2)]) == [None, None, None]
    assert tier.stats().corrupt == 3
    assert raw.exists(*[tier.redis_key(key_of(i)) for i in range(3)]) == 0
    raw.close()


@needs_redis
def test_killed_mid_write_and_mid_read_then_restarted(tmp_path):
    with RedisNode(tmp_path / "r") as node:
        tier = RedisTier(node.url, FP, timeout_s=5.0, retry_after_s=0.05, max_retry_after_s=0.2)
        items = [make_item(i, payload_bytes=1 << 20) for i in range(48)]
        wanted = {it.key: encoded(it) for it in items}
        assert tier.put(items[:1]) == [True]  # connected

        # Mid-write: the server stops reading (SIGSTOP) so the 48 MB pipeline is in flight,
        # blocked on full socket buffers, when the server is killed.
        result: dict = {}
        node.pause()
        writer = threading.Thread(target=lambda: result.setdefault("put", tier.put(items)))
        writer.start()
        wait_until(lambda: tier.stats().puts == 1 and writer.is_alive(), "the write to start")
        time.sleep(0.2)  # let the pipeline fill the socket buffers (any timing gives a failed put)
        node.kill()
        writer.join(HANG_GUARD_S)
        assert not writer.is_alive()
        assert result["put"] == [False] * 48  # the whole batch failed, nothing raised
        assert tier.stats().errors >= 1
        assert tier.get([key_of(0)]) == [None]  # dead store: a miss

        node.start()  # empty: nothing persisted
        wait_until(lambda: tier.put(items[:4]) == [True] * 4, "reconnect after restart")
        assert tier.put(items[4:]) == [True] * 44

        # Mid-read: the GETs are sent, the server stalls before answering, then dies.
        reads: list = []
        node.pause()
        reader = threading.Thread(target=lambda: reads.extend(tier.get([it.key for it in items])))
        reader.start()
        time.sleep(0.2)
        node.kill()
        reader.join(HANG_GUARD_S)
        assert not reader.is_alive() and reads == [None] * 48
        # And a kill while the replies stream: every value is a miss or exact, never mixed.
        node.start()
        wait_until(lambda: tier.put(items) == [True] * 48, "reconnect after the second restart")
        reads.clear()
        reader = threading.Thread(target=lambda: reads.extend(tier.get([it.key for it in items])))
        reader.start()
        node.kill()
        reader.join(HANG_GUARD_S)
        assert not reader.is_alive() and len(reads) == 48
        assert all(data is None or bytes(data) == wanted[k] for k, data in zip(wanted, reads))

        node.start()
        wait_until(lambda: tier.put(items[:1]) == [True], "reconnect after the third restart")
        assert bytes(tier.get([key_of(0)])[0]) == wanted[key_of(0)]
        tier.close()


@needs_redis
def test_stalled_store_beyond_timeout_is_a_miss_without_stalling(tmp_path):
    with RedisNode(tmp_path / "r") as node:
        layout = kv_rig.mla_layout()
        eng = kv_rig.make_engine(layout, remote_url=node.url, remote_timeout_s=0.3)
        n = 3 * kv_rig.CHUNK_TOKENS
        kv_rig.store_prompt(eng, 1, n)
        assert eng.storage.flush(HANG_GUARD_S)
        eng.pool.clear()
        tier = eng.storage.tiers[0]
        node.pause()
        try:
            t0 = time.monotonic()
            assert eng.lookup(kv_rig.tokens(1, n)) == 0
            assert kv_rig.retrieve_prompt(eng, 1, n) == 0
            kv_rig.store_prompt(eng, 2, n)  # the write-behind absorbs it; the step goes on
            assert time.monotonic() - t0 < HANG_GUARD_S
            assert tier.stats().errors >= 1 and not tier.healthy()
        finally:
            node.resume()
        wait_until(lambda: eng.lookup(kv_rig.tokens(1, n)) == n, "the store answering again")
        assert kv_rig.retrieve_prompt(eng, 1, n) == n
        eng.close()


@needs_redis
def test_engine_round_trip_through_a_three_node_cluster(tmp_path):
    with RedisClusterNodes(tmp_path / "cluster") as cluster:
        layout = kv_rig.mla_layout()
        eng = kv_rig.make_engine(layout, remote_url=cluster.url)
        n = 12 * kv_rig.CHUNK_TOKENS + 5
        assert kv_rig.store_prompt(eng, 3, n) == 12 * kv_rig.CHUNK_TOKENS
        assert eng.storage.flush(HANG_GUARD_S)
        per_node = [int(nd.cli("dbsize")) for nd in cluster.nodes]
        assert sum(per_node) == 12 and sum(c > 0 for c in per_node) >= 2  # spread over the shards
        eng.pool.clear()
        assert eng.lookup(kv_rig.tokens(3, n)) == 12 * kv_rig.CHUNK_TOKENS
        assert kv_rig.retrieve_prompt(eng, 3, n) == 12 * kv_rig.CHUNK_TOKENS
        eng.close()
        valkey = kv_rig.make_engine(layout, remote_url=cluster.url.replace("redis-cluster", "valkey-cluster"))
        assert kv_rig.retrieve_prompt(valkey, 3, n) == 12 * kv_rig.CHUNK_TOKENS
        valkey.close()


# -- a cluster whose shards fail separately -------------------------------------------
@pytest.fixture
def cache_cluster(tmp_path):
    """Three shards run as a cache: the shards that are up keep serving while one is down."""
    if redis_available() is not None:
        pytest.skip(redis_available())
    with RedisClusterNodes(tmp_path / "cluster", full_coverage=False) as cluster:
        yield cluster


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


@needs_redis
def test_cluster_shard_dead_or_stalled_is_a_miss_for_its_keys_only(cache_cluster):
    cluster = cache_cluster
    tier = RedisTier(cluster.url, FP, timeout_s=1.0, retry_after_s=0.3, max_retry_after_s=0.3)
    items = [make_item(i, mask=1 + i % 7) for i in range(30)]
    keys = [it.key for it in items]
    assert tier.put(items) == [True] * 30
    holder = [cluster.holder(tier.redis_key(k)) for k in keys]
    assert set(holder) == {0, 1, 2}
    victim = cluster.nodes[1]
    on_victim = [h == 1 for h in holder]
    expect_masks = [None if v else it.header.group_mask for it, v in zip(items, on_victim)]

    # Stalled (SIGSTOP): its keys miss after one timeout; the other shards' keys hit exactly.
    victim.pause()
    masks, took_s = timed(tier.masks, keys)
    assert masks == expect_masks and took_s < HANG_GUARD_S
    assert tier.stats().errors == 1  # one failed shard, not one error per key
    got, took_s = timed(tier.get, keys)  # the shard's breaker is open: skipped, no new wait
    assert took_s < 0.3 and tier.stats().skipped_unhealthy == 1
    assert [g is not None and bytes(g) == encoded(it) for g, it in zip(got, items)] == [not v for v in on_victim]
    assert tier.healthy()  # the store as a whole is up

    # Killed: the same, and writes to the live shards still land.
    victim.resume()
    victim.kill()
    time.sleep(0.35)  # past the shard's back-off: probed again, refused at once
    fresh = [make_item(i, version=1) for i in range(30)]
    assert tier.put(fresh) == [not v for v in on_victim]
    assert [g is not None for g in tier.get(keys)] == [not v for v in on_victim]

    # Back (empty, same slots): picked up again after its back-off, every key writable.
    victim.start()
    cluster.wait_ok()
    wait_until(lambda: tier.put(fresh) == [True] * 30, "the shard to be written again")
    assert [bytes(g) for g in tier.get(keys)] == [encoded(it) for it in fresh]
    tier.close()


@needs_redis
def test_cluster_without_any_shard_is_a_store_failure(cache_cluster):
    tier = RedisTier(cache_cluster.url, FP, timeout_s=0.5, retry_after_s=5.0)
    assert tier.put([make_item(i) for i in range(6)]) == [True] * 6
    for node in cache_cluster.nodes:
        node.kill()
    assert tier.masks([key_of(i) for i in range(6)]) == [None] * 6
    assert not tier.healthy()  # the whole store is skipped now, not probed shard by shard
    assert tier.get([key_of(0)]) == [None] and tier.stats().skipped_unhealthy == 1
    tier.close()


def _move_slot(cluster: RedisClusterNodes, redis_key: bytes, src: int, dst: int) -> None:
    """Migrate ``redis_key``'s slot (and its key) from node ``src`` to node ``dst``."""
    slot = cluster.nodes[0].cli("cluster", "keyslot", redis_key.decode()).strip()
    ids = [n.cli("cluster", "myid").strip() for n in cluster.nodes]
    a, b = cluster.nodes[src], cluster.nodes[dst]
    assert b.cli("cluster", "setslot", slot, "importing", ids[src]).strip() == "OK"
    assert a.cli("cluster", "setslot", slot, "migrating", ids[dst]).strip() == "OK"
    assert a.cli("migrate", "127.0.0.1", str(b.port), "", "0", "5000", "keys", redis_key.decode()).strip() == "OK"
    for node in cluster.nodes:
        node.cli("cluster", "setslot", slot, "node", ids[dst])
    cluster.wait_ok()


@needs_redis
def test_cluster_slot_moved_is_one_miss_then_followed(cache_cluster):
    cluster = cache_cluster
    tier = RedisTier(cluster.url, FP)
    items = [make_item(i) for i in range(12)]
    assert tier.put(items) == [True] * 12
    moved = items[0]
    src = cluster.holder(tier.redis_key(moved.key))
    _move_slot(cluster, tier.redis_key(moved.key), src, (src + 1) % 3)
    first = tier.get([it.key for it in items])  # the client's slot map is stale for one key
    assert first[0] is None and all(bytes(g) == encoded(it) for g, it in zip(first[1:], items[1:]))
    assert bytes(tier.get([moved.key])[0]) == encoded(moved)  # slot map refreshed: found
    assert tier.healthy()
    tier.close()


@needs_redis
def test_engine_prefix_hit_stops_at_the_first_chunk_on_a_dead_shard(cache_cluster, tmp_path):
    layout = kv_rig.mla_layout()
    eng = kv_rig.make_engine(layout, remote_url=cache_cluster.url)
    n = 12 * kv_rig.CHUNK_TOKENS + 5
    assert kv_rig.store_prompt(eng, 4, n) == 12 * kv_rig.CHUNK_TOKENS
    assert eng.storage.flush(HANG_GUARD_S)
    tier = next(t for t in eng.storage.tiers if isinstance(t, RedisTier))
    holders = [cache_cluster.holder(tier.redis_key(c.key)) for c in eng.chunks(kv_rig.tokens(4, n), include_partial=False)]
    first_lost = next(i for i, h in enumerate(holders) if h != holders[0])  # chunks before it live on
    victim = holders[first_lost]
    cache_cluster.nodes[victim].kill()
    eng.pool.clear()
    expected = first_lost * kv_rig.CHUNK_TOKENS
    assert 0 < expected < n
    assert eng.lookup(kv_rig.tokens(4, n)) == expected
    assert kv_rig.retrieve_prompt(eng, 4, n) == expected  # exact bytes for every loaded row
    eng.close()


@needs_redis
def test_cluster_shard_killed_under_concurrent_callers(cache_cluster):
    """Readers and writers on several threads while a shard dies and comes back: nothing
    raises, and every value read is the exact bytes of one version or a miss."""
    cluster = cache_cluster
    tier = RedisTier(cluster.url, FP, timeout_s=1.0, retry_after_s=0.05, max_retry_after_s=0.2)
    versions = {v: [make_item(i, payload_bytes=20_000, version=v) for i in range(24)] for v in range(2)}
    allowed = {it.key: set() for it in versions[0]}
    for v, items in versions.items():
        for it in items:
            allowed[it.key].add(encoded(it))
    assert tier.put(versions[0]) == [True] * 24
    keys = list(allowed)
    stop, errors, reads = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            try:
                for key, data in zip(keys, tier.get(keys)):
                    assert data is None or bytes(data) in allowed[key]
                tier.masks(keys)
                reads[0] += 1
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)
                return

    def writer():
        v = 0
        while not stop.is_set():
            try:
                tier.put(versions[v])
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return
            v ^= 1

    threads = [threading.Thread(target=reader) for _ in range(3)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    cluster.nodes[2].kill()
    time.sleep(1.0)
    cluster.nodes[2].start()
    cluster.wait_ok()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert reads[0] > 0
    wait_until(lambda: tier.put(versions[0]) == [True] * 24, "every shard to take writes again")
    tier.close()


# -- eviction policy (issue 26, item 9) ------------------------------------------------
@needs_redis
def test_a_store_that_never_evicts_is_warned_about_once(fresh, caplog, monkeypatch):
    """kvconnect sets no TTL and leaves old key generations to the store's eviction: a store
    without maxmemory, or with noeviction / volatile-*, would keep them forever. The tier
    says so once, at its first connection, with what to set."""
    monkeypatch.setattr(redis_tier, "_once", OnceWarnings(redis_tier.logger.warning))
    items = [make_item(i) for i in range(2)]
    for limit, policy, expected in (("0", "allkeys-lru", "never-evicts"), ("64mb", "noeviction", "never-evicts"),
                                    ("64mb", "volatile-lru", "never-evicts"), ("64mb", "allkeys-lru", "ok")):
        fresh.cli("config", "set", "maxmemory", limit)
        fresh.cli("config", "set", "maxmemory-policy", policy)
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvconnect.storage.redis_tier"):
            for _ in range(2):  # two tiers in one process: one warning
                tier = RedisTier(fresh.url, FP)
                assert tier.put(items) == [True, True]
                assert tier.eviction_check.startswith(expected), (limit, policy, tier.eviction_check)
                tier.close()
        warnings = [r.getMessage() for r in caplog.records if "never evicts" in r.getMessage()]
        assert len(warnings) == (expected == "never-evicts"), warnings
        if warnings:
            assert "allkeys-lru" in warnings[0] and policy in warnings[0]
        monkeypatch.setattr(redis_tier, "_once", OnceWarnings(redis_tier.logger.warning))
    fresh.cli("config", "set", "maxmemory", "0")
    fresh.cli("config", "set", "maxmemory-policy", "noeviction")
