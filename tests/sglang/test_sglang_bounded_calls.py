"""Every call SGLang's HiCache storage threads make to kvconnect returns well inside the 10 s
SGLang waits for those threads (``_stop_storage_threads`` joins each for 10 s at
``flush_cache``; a thread still inside a backend call then fails the flush with "Failed to
stop HiCache storage threads cleanly"), even when the Mooncake master behind kvconnect has
stopped answering (SIGSTOP).

Real SGLang 0.5.23 host pool classes and a real ``mooncake_master``; no engine start. The
calls are the ones SGLang's threads make: batch_exists (prefetch thread), batch_get_v1
(prefetch I/O thread), batch_set_v1 (backup thread), and clear (flush_cache itself). Before
kvconnect bounded each Mooncake RPC by ``remote_timeout_s`` (``MC_RPC_TIMEOUT_MS``), a read
met by a stalled master took Mooncake's 30 s.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")
from support.mooncake_master import MooncakeMaster, mooncake_available  # noqa: E402

from host_pools import backend, fill, idx, keys, mha_pool, page, storage_config  # noqa: E402

pytestmark = pytest.mark.sglang

SGLANG_JOIN_S = 10.0  # what SGLang waits for each storage thread at flush_cache
BOUND_S = SGLANG_JOIN_S / 4  # what one backend call may take here, stalled master and loaded machine included


def test_backend_calls_return_within_sglangs_bound_while_the_mooncake_master_stalls(tmp_path, monkeypatch):
    reason = mooncake_available()
    if reason:
        pytest.skip(reason)
    # the product's own bound (remote_timeout_s), not the storage tests' fixed one
    monkeypatch.delenv("MC_RPC_TIMEOUT_MS", raising=False)
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with MooncakeMaster(tmp_path / "master") as master:
        holder_json = tmp_path / "holder.json"
        holder_json.write_text(json.dumps({"global_segment_size": 64 << 20, "protocol": "tcp"}))
        reader_json = tmp_path / "reader.json"
        reader_json.write_text(json.dumps({"global_segment_size": 0, "protocol": "tcp"}))
        common = dict(remote_url=master.url, remote_timeout_s=1.0, local_disk=None)
        pool = mha_pool("page_first_direct")
        fill(pool)
        ks = keys(3, "stall")
        writer = backend(pool, storage_config(tmp_path, mooncake_config_path=str(holder_json), **common))
        assert _connected(writer), "the writer's Mooncake client did not connect"
        assert writer.batch_set_v1(ks, idx([0, 1, 2])) == [True] * 3
        assert writer.flush(20)
        other = mha_pool("page_first_direct")
        reader = backend(other, storage_config(tmp_path, mooncake_config_path=str(reader_json), **common))
        assert _connected(reader), "the reader's Mooncake client did not connect"
        try:
            assert reader.batch_exists(ks) == 3  # a lookup answered: the pages are in Mooncake
            master.pause()
            try:
                timings = {}
                for name, call in (("batch_get_v1", lambda: reader.batch_get_v1(ks, idx([4, 5, 6]))),
                                   ("batch_exists", lambda: reader.batch_exists(keys(3, "fresh"))),
                                   ("batch_set_v1", lambda: reader.batch_set_v1(keys(2, "new"), idx([7, 8]))),
                                   ("clear", reader.clear)):
                    start = time.monotonic()
                    call()
                    timings[name] = time.monotonic() - start
            finally:
                master.resume()
            assert all(t < BOUND_S for t in timings.values()), timings
            # whatever a stalled read returned, nothing was lost: a fresh reader loads every page
            third_pool = mha_pool("page_first_direct")
            third = backend(third_pool, storage_config(tmp_path, mooncake_config_path=str(reader_json), **common))
            try:
                assert _connected(third), "a client set up after the stall did not connect"
                deadline = time.monotonic() + 30.0
                while third.batch_exists(ks) < 3:
                    assert time.monotonic() < deadline, "the pages did not survive the stall"
                    time.sleep(0.2)
                assert third.batch_get_v1(ks, idx([4, 5, 6])) == [True] * 3
                assert all(page(third_pool, 4 + i).equal(page(pool, i)) for i in range(3))
            finally:
                third.close()
        finally:
            master.resume()
            reader.close()
            writer.close()


def _connected(b, timeout_s: float = 90.0) -> bool:
    """Whether the backend's Mooncake client connected within ``timeout_s``: a setup refused by a
    master still busy after its stall is retried after 1, 2, 4, ... s (SETUP_RETRY_S), so a loaded
    machine can need more than 30 s; the bound under test is the calls', not this one."""
    tier = b._store.engine.storage.tiers[0]
    deadline = time.monotonic() + timeout_s
    while not tier.connected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
