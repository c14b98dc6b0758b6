"""A second engine process, started fresh, gets hits from the disk tier and from Redis for
prompts a first process stored, and every retrieved byte is exact.

Each process is this file run as a script (``store`` or ``retrieve``), configured only
through LMCACHE_* / KVCONNECT_* environment variables, as a deployment would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SEEDS = (11, 12, 13)
CHUNKS = (4, 7, 2)


def run_child(mode: str, env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_"))}
    env.update({"LMCACHE_CHUNK_SIZE": "32", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05", "KVCONNECT_NUM_THREADS": "1"})
    env.update(env_extra)
    out = subprocess.run([sys.executable, str(HERE / "test_second_process.py"), mode], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"{mode} child failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fresh_process_hits_disk_and_redis(tmp_path):
    from support.redis_server import RedisNode, redis_available

    reason = redis_available()
    disk = {"LMCACHE_LOCAL_DISK": str(tmp_path / "disk"), "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.05"}
    if reason is not None:
        pytest.skip(reason)
    with RedisNode(tmp_path / "redis") as node:
        remote = {"LMCACHE_REMOTE_URL": node.url}
        stored = run_child("store", {**disk, **remote})
        want = [c * 32 for c in CHUNKS]
        assert stored["stored"] == want and stored["pending_at_exit"] == 0
        from_disk = run_child("retrieve", disk)
        assert from_disk["lookup"] == want and from_disk["loaded"] == want
        assert from_disk["tiers"] == [["disk", sum(CHUNKS)]]
        from_redis = run_child("retrieve", remote)
        assert from_redis["loaded"] == want and from_redis["tiers"] == [["remote", sum(CHUNKS)]]


def _child(mode: str) -> None:
    sys.path.insert(0, str(HERE))
    import kv_rig
    from kvconnect import Config, KVCacheEngine

    layout = kv_rig.mla_layout()
    engine = KVCacheEngine(layout, Config.from_env())
    result: dict = {}
    if mode == "store":
        result["stored"] = [kv_rig.store_prompt(engine, s, c * 32 + 5) for s, c in zip(SEEDS, CHUNKS)]
        engine.close()  # flushes the write-behind queues
        result["pending_at_exit"] = sum(w.stats().pending for w in engine.storage.writers)
    else:
        result["lookup"] = [engine.lookup(kv_rig.tokens(s, c * 32 + 5)) for s, c in zip(SEEDS, CHUNKS)]
        # retrieve_prompt asserts every restored byte and that nothing else was written
        result["loaded"] = [kv_rig.retrieve_prompt(engine, s, c * 32 + 5, offset=9) for s, c in zip(SEEDS, CHUNKS)]
        result["tiers"] = [[t.name, t.stats().get_hits] for t in engine.storage.tiers]
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1])
