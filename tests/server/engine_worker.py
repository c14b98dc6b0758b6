"""A second engine process for the cache-server tests (run by server_rig.run_worker).

    engine_worker.py store URL NAME:CHUNK:TOKENS:SEED...   store zoo prompts through the server
    engine_worker.py hold URL SLOT_BYTES RESERVE KEYHEX...  pin keys, reserve runs, then hang

``store`` prints one JSON line per prompt: {"stored": tokens stored, "connected": bool}; each
prompt has its own engine (layouts differ), closed before the next one.
``hold`` prints "holding <pins> <reserved>" and sleeps (at most 60 s) until it is killed.
"""

from __future__ import annotations

import json
import sys
import time

from support import server_rig
from kvconnect import Config, KVCacheEngine
from kvconnect.server import make_pool
from kvconnect.server.client import SharedPoolClient


def store(url: str, name: str, chunk: int, num_tokens: int, seed: int) -> None:
    case, tokens, tables, _ = server_rig.prompt(name, chunk, num_tokens, seed)
    config = Config(chunk_size=chunk, num_threads=2, server_url=url, remote_timeout_s=5.0)
    engine = KVCacheEngine(case.layout(), config, pool_factory=make_pool)
    stored = engine.store(tokens, tables)
    connected = engine.pool.connected
    engine.close()
    print(json.dumps({"stored": stored, "connected": connected}), flush=True)


def hold(url: str, slot_bytes: int, reserve: int, keys: list[bytes]) -> None:
    client = SharedPoolClient(url, slot_bytes, timeout_s=5.0)
    pins = sum(e is not None for e in client.acquire(keys))
    slots = client.reserve(reserve)
    print(f"holding {pins} {len(slots)}", flush=True)
    time.sleep(60)  # the heartbeat thread keeps the lease alive until the test kills us


if __name__ == "__main__":
    role, url, *rest = sys.argv[1:]
    if role == "store":
        for spec in rest:
            name, chunk, num_tokens, seed = spec.split(":")
            store(url, name, int(chunk), int(num_tokens), int(seed))
    else:
        hold(url, int(rest[0]), int(rest[1]), [bytes.fromhex(k) for k in rest[2:]])
