"""The node cache server end to end: real processes, real kills, byte-exact restores.

- two engine processes share one server: stored by one, restored byte-exact by the other
  (two layouts with different chunk sizes in the same pool);
- a client killed mid-operation (holding pins and reservations): released within the lease;
- the server killed with clients attached: misses and counted errors, no exception, then
  the clients reconnect to the restarted server (new segment) and work again;
- eviction (LRU order), eviction listeners and a pool full of pinned entries across clients;
- token and address policy, a second server on a live socket, ``kvconnect info``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from support import server_rig
from support import zoo
from kvconnect import Config, KVCacheEngine
from kvconnect.chunks.chunk_format import ChunkHeader
from kvconnect.cli import main as cli_main
from kvconnect.errors import ConfigError
from kvconnect.server import make_pool
from kvconnect.server.client import SharedPoolClient
from kvconnect.server.protocol import Limits
from kvconnect.server.index import STATS_FIELDS
from kvconnect.server.server import CacheServer
from kvconnect.server.shm import SHM_DIR, segment_name
from support.server_rig import PAGE, server_thread, socket_dir, wait_until

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")

FP = b"F" * 16


@pytest.fixture(scope="module")
def server_proc():
    """One ``kvconnect server`` process (16 MB, lease 1 s) for the tests that do not kill it."""
    with socket_dir() as d:
        url = f"ipc://{d}/kvc.sock"
        proc = server_rig.start_server_process(url, os.path.join(d, "server.log"))
        try:
            yield url
        finally:
            assert server_rig.stop_process(proc) == 0, "the server did not exit cleanly on SIGTERM"
            assert not os.path.exists(os.path.join(SHM_DIR, segment_name(url))), "segment left behind"


def write_entry(client: SharedPoolClient, key: bytes, fill: int, payload_bytes: int = PAGE) -> bool:
    slots = client.reserve(1)
    if not slots:
        return False
    client.slot_view(slots[0])[:payload_bytes] = fill
    header = ChunkHeader(fingerprint=FP, key=key, token_start=0, token_end=64, group_mask=1,
                         plane_rows=((0, 4),), payload_bytes=payload_bytes)
    return client.commit(key, header, slots[0]).live


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


# --- two engines, two processes -----------------------------------------------------------

CASES = [("gemma3-swa", 32, 100, 11), ("dsv4-flash", 256, 600, 12)]  # different chunk (slot) sizes


def test_two_engine_processes_share_the_pool(server_proc):
    out = server_rig.run_worker(["store", server_proc, *[f"{name}:{chunk}:{n}:{seed}" for name, chunk, n, seed in CASES]])
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [(r["connected"], r["stored"]) for r in results] == [(True, (n // c) * c) for _, c, n, _ in CASES]

    for name, chunk, n, seed in CASES:  # this process never saw the source bytes
        case, tokens, src_tables, bounds = server_rig.prompt(name, chunk, n, seed)
        boundary = zoo.expected_boundary(case, bounds, zoo.store_masks(case, src_tables, bounds))
        assert boundary > 0
        dst = case.clone(fill=0)
        # the public engine with a server URL reaches the server by itself (no pool_factory: issue 41)
        engine = KVCacheEngine(dst.layout(), Config(chunk_size=chunk, num_threads=2, server_url=server_proc, remote_timeout_s=5.0))
        try:
            assert engine.pool.connected
            assert engine.lookup(tokens) == boundary  # the worker's close() left the shared entries alone
            dst_tables = server_rig.restore_tables(case, name, n, boundary, seed)
            expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, boundary)
            assert engine.retrieve(tokens, dst_tables) == boundary
            assert dst.first_difference(expected) is None, name
            assert engine.pool.stats().extra["pinned"] == 0
            other = zoo.random_tokens(np.random.default_rng(seed + 7), n)
            assert engine.lookup(other) == 0
        finally:
            engine.close()


# --- a client killed while it holds pins and reservations -----------------------------------


def test_killed_client_pins_and_reservations_are_released_within_the_lease(server_proc):
    client = SharedPoolClient(server_proc, PAGE, timeout_s=5.0, fingerprint=FP)
    try:
        keys = [key(100 + i) for i in range(3)]
        assert all(write_entry(client, k, 0x40 + i) for i, k in enumerate(keys))
        base = client.server_stats()
        proc = server_rig.subprocess.Popen(
            [server_rig.sys.executable, os.path.join(os.path.dirname(__file__), "engine_worker.py"), "hold", server_proc,
             str(PAGE), "2", *[k.hex() for k in keys]],
            stdout=server_rig.subprocess.PIPE, env=server_rig.clean_env(), cwd=server_rig.REPO)
        try:
            assert server_rig.read_line(proc, 60).split() == ["holding", "3", "2"]
            held = client.server_stats()
            assert held["pinned_entries"] == base["pinned_entries"] + 3
            assert held["reserved_runs"] == base["reserved_runs"] + 2
            # alive and heartbeating: two leases later it still holds everything
            assert not wait_until(lambda: client.server_stats()["pinned_entries"] < held["pinned_entries"], 2.5)
            server_rig.kill(proc)
        finally:
            server_rig.kill(proc)
        assert wait_until(lambda: client.server_stats()["pinned_entries"] == base["pinned_entries"]
                          and client.server_stats()["reserved_runs"] == base["reserved_runs"], 10.0)
        after = client.server_stats()
        assert after["used_pages"] == base["used_pages"] and after["expired_clients"] >= 1
        # the formerly pinned entries are ordinary LRU entries again, with their bytes intact
        entries = client.acquire(keys)
        assert [int(client.entry_view(e)[0]) for e in entries] == [0x40, 0x41, 0x42]
        client.release(entries)
    finally:
        client.close()


# --- the server killed with clients attached ------------------------------------------------


def test_server_killed_then_restarted(clean_env):
    name, chunk, n = "llama-flash", 64, 200
    case, tokens, src_tables, bounds = server_rig.prompt(name, chunk, n, 5)
    with socket_dir() as d:
        url, log = f"ipc://{d}/kvc.sock", os.path.join(d, "server.log")
        proc = server_rig.start_server_process(url, log)
        engine = KVCacheEngine(case.layout(), Config(chunk_size=chunk, num_threads=2, server_url=url, remote_timeout_s=0.5),
                               pool_factory=make_pool)
        holder = SharedPoolClient(url, PAGE, timeout_s=0.5, fingerprint=FP)
        try:
            assert engine.store(tokens, src_tables) == 3 * chunk
            assert engine.lookup(tokens) == 3 * chunk
            assert write_entry(holder, key(1), 0x11)
            pinned = holder.acquire([key(1)])
            assert pinned[0] is not None

            server_rig.kill(proc)
            before = case.snapshot()
            assert engine.lookup(tokens) == 0  # a timeout, counted; then misses at once
            assert engine.store(tokens, src_tables) == 0
            dst_tables = server_rig.restore_tables(case, name, n, 3 * chunk, 5)
            assert engine.retrieve(tokens, dst_tables) == 0
            assert case.same_bytes(before), "a failed retrieve wrote into the engine's memory"
            counters = engine.pool.stats().extra["client"]
            assert counters["timeouts"] + counters.get("lost_heartbeats", 0) >= 1
            assert counters["calls_while_disconnected"] >= 1

            proc = server_rig.start_server_process(url, log)
            assert wait_until(lambda: engine.pool.connected, 15.0), "engine did not reconnect"
            assert engine.lookup(tokens) == 0  # a new server starts empty
            assert engine.store(tokens, src_tables) == 3 * chunk
            dst = case.clone(fill=0)
            reader = KVCacheEngine(dst.layout(), Config(chunk_size=chunk, num_threads=2, server_url=url, remote_timeout_s=2.0),
                                    pool_factory=make_pool)
            try:
                expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, 3 * chunk)
                assert reader.retrieve(tokens, dst_tables) == 3 * chunk
                assert dst.first_difference(expected) is None
            finally:
                reader.close()

            # a client still holding a pin of the dead server does not re-map under the engine's feet
            assert not wait_until(lambda: holder.connected, 1.5)
            holder.release(pinned)
            assert wait_until(lambda: holder.connected, 15.0)
            assert holder.masks([key(1)]) == [None] and write_entry(holder, key(1), 0x22)
            assert engine.pool.stats().extra["client"]["connects"] == 2
        finally:
            holder.close()
            engine.close()
            server_rig.stop_process(proc)


# --- eviction across clients, in-process server ---------------------------------------------


def test_lru_eviction_listeners_and_full_pool_across_clients():
    # LRU order is what the assertions below spell out (the default policy: test_server_index.py)
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", size_bytes=PAGE * 33, eviction="lru") as server:
        url = server.url
        big = SharedPoolClient(url, 4 * PAGE, timeout_s=5.0, fingerprint=FP)  # 8 slots of 4 pages
        small = SharedPoolClient(url, PAGE, timeout_s=5.0, fingerprint=FP)
        evicted: list = []
        big.on_evict.append(lambda e: evicted.append((e.key, int(big.entry_view(e)[0]), int(big.entry_view(e)[-1]))))
        try:
            assert big.num_slots == 8 and small.num_slots == 32
            for i in range(8):
                assert write_entry(big, key(i), i + 1, 4 * PAGE)
            reserved = big.reserve(1)  # full: evicts key 0, reported to the listener with its bytes intact
            assert len(reserved) == 1 and evicted == [(key(0), 1, 1)]
            pins = big.acquire([key(i) for i in range(1, 8)])
            assert all(e is not None for e in pins)
            assert small.reserve(3) == []  # every page pinned or reserved: refused at once, no spin
            big.abort(reserved)
            got = small.reserve(10)
            assert len(got) == 4  # only the 4 aborted pages: pinned runs are never taken
            small.abort(got)
            assert [int(big.entry_view(e)[0]) for e in pins] == list(range(2, 9))  # pinned bytes intact
            big.release(pins)
            got = small.reserve(5)  # 4 free pages + the LRU entry (key 1) evicted for the fifth
            assert len(got) == 5 and small.masks([key(1), key(2)]) == [None, 1]
            small.abort(got)
            stats = small.server_stats()
            assert stats["pinned_entries"] == 0 and stats["reserve_shortfalls"] >= 2 and stats["used_pages"] == 24
            assert len(small) == 6
        finally:
            big.close()
            small.close()


def test_batches_larger_than_the_frame_and_key_limits():
    """Requests split at max_keys; an acquire reply that would pass the frame limit comes
    back in parts and the client asks again: every entry arrives, pinned once."""
    limits = Limits(max_frame_bytes=1024, max_keys=4)
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", limits=limits) as server:
        client = SharedPoolClient(server.url, PAGE, timeout_s=5.0, fingerprint=FP, limits=limits)
        try:
            keys = [key(i) for i in range(11)]
            assert all(write_entry(client, k, i) for i, k in enumerate(keys))
            assert client.masks(keys + [key(99)]) == [1] * 11 + [None]
            entries = client.acquire(keys)
            assert [int(client.entry_view(e)[0]) for e in entries] == list(range(11))
            assert client.server_stats()["pinned_entries"] == 11
            client.release(entries)
            assert client.server_stats()["pinned_entries"] == 0
            slots = client.reserve(9)
            assert len(slots) == 9
            client.abort(slots)
            assert client.server_stats()["reserved_runs"] == 0
        finally:
            client.close()


def test_cli_policy_second_server_and_info(capsys):
    assert cli_main(["server", "--url", "tcp://0.0.0.0:5999", "--size-gb", "0.01"]) == 2
    assert "token" in capsys.readouterr().err
    assert cli_main(["server", "--url", "tcp://0.0.0.0:5999", "--size-gb", "0.01", "--token", "t"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock") as server:
        with pytest.raises(ConfigError, match="already serves"):
            CacheServer(server.url, 1 << 20)
        assert cli_main(["info", "--url", server.url, "--json"]) == 0
        out = capsys.readouterr().out
        assert out.endswith("}\n")  # a shell prompt after it starts on its own line
        info = json.loads(out)
        assert info["num_pages"] == server.index.allocator.num_pages and info["page_bytes"] == PAGE
        assert cli_main(["info", "--url", server.url]) == 0  # human-readable by default
        text = capsys.readouterr().out
        assert f"{info['num_pages']} pages of {PAGE // 1024} KiB" in text and "evictions" in text
        assert text.endswith("requests\n") and not text.endswith("\n\n")  # the last line ends, once
    assert cli_main(["info", "--url", f"ipc://{d}/kvc.sock", "--timeout-s", "0.2"]) == 1


def test_a_pool_larger_than_the_host_is_refused_as_the_engine_refuses_it(capsys, tmp_path):
    """``kvconnect server --size-gb N`` past the host's memory: the engine's check (storage.host_memory),
    a clear error and exit 2, before any shared memory is reserved."""
    from kvconnect.storage import host_memory

    room, why = host_memory.host_room()
    size_gb = int((room + (4 << 30)) / (1 << 30)) + 0.5  # x.5: printed as given whatever the room (never "24" for "24.0")
    with socket_dir() as d:
        assert cli_main(["server", "--url", f"ipc://{d}/kvc.sock", "--size-gb", f"{size_gb:.1f}"]) == 2
        err = capsys.readouterr().err
        assert f"the server's pool (--size-gb, LMCACHE_MAX_LOCAL_CPU_SIZE) = {size_gb:.1f} GB asks for" in err, err
        assert why in err and "lower --size-gb" in err
        assert not os.path.exists(os.path.join(SHM_DIR, segment_name(f"ipc://{d}/kvc.sock")))
        with pytest.raises(ConfigError, match="host memory"):
            CacheServer(f"ipc://{d}/kvc.sock", int(size_gb * (1 << 30)), shm_dir=str(tmp_path))
        assert list(tmp_path.iterdir()) == []


def test_server_help_names_its_default_url(capsys, monkeypatch):
    monkeypatch.delenv("KVCONNECT_SERVER_URL", raising=False)
    with pytest.raises(SystemExit):
        cli_main(["server", "--help"])
    assert "(default ipc:///tmp/kvconnect.sock: KVCONNECT_SERVER_URL" in " ".join(capsys.readouterr().out.split())


def test_make_pool_picks_the_private_pool_without_a_server_url():
    from kvconnect.server import close_pool, make_pool
    from kvconnect.storage import ChunkPool

    pool = make_pool(Config(max_local_cpu_size=1 / 1024), PAGE, pin_memory=False)
    assert isinstance(pool, ChunkPool) and pool.num_slots == 256
    close_pool(pool)
    assert len(pool) == 0


def test_a_server_url_in_the_environment_is_enough_for_the_public_engine():
    """KVCONNECT_SERVER_URL (and a model identity, a shared tier's requirement) and nothing else:
    the engine's default pool is the server's, and what one engine stores the other finds there."""
    case, tokens, tables, _ = server_rig.prompt("llama-flash", 64, 128, seed=3)
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock") as server:
        env = {"KVCONNECT_SERVER_URL": server.url, "LMCACHE_CHUNK_SIZE": "64", "KVCONNECT_NUM_THREADS": "1"}
        with pytest.raises(ConfigError, match="KVCONNECT_MODEL_NAME"):
            KVCacheEngine(case.layout(model_name=""), Config.from_env(env))
        env["KVCONNECT_MODEL_NAME"] = "zoo/llama-flash@test"
        writer = KVCacheEngine(case.layout(model_name=""), Config.from_env(env))
        reader = KVCacheEngine(case.layout(model_name=""), Config.from_env(env))
        try:
            assert isinstance(writer.pool, SharedPoolClient) and writer.pool.connected
            assert writer.store(tokens, tables) == 128
            # commits are posted without a reply; the server reads a client's requests in order, so
            # the writer's own next call is answered after both commits were read
            assert writer.lookup(tokens) == 128
            assert server.index.stats(None)[STATS_FIELDS.index("num_entries")] == 2  # in the server's pool
            assert reader.lookup(tokens) == 128  # another engine finds them there
        finally:
            writer.close()
            reader.close()


def test_an_engine_given_the_private_pool_factory_refuses_a_server_url():
    """``pool_factory=private_pool`` with ``server_url`` set would share nothing: refused before
    anything is allocated."""
    from kvconnect.storage.pool_protocol import private_pool

    case = zoo.build("llama-flash", max_tokens=64)
    with pytest.raises(ConfigError, match="leave pool_factory at its default"):
        KVCacheEngine(case.layout(), Config(chunk_size=64, model_name="m", server_url="ipc:///tmp/kvc-never-started.sock"),
                      pool_factory=private_pool)
