"""A second process on the Mooncake Store, for tests: run as a script, driven over stdin/stdout.

    python mooncake_peer.py hold MASTER SEGMENT_BYTES
        contribute a segment through kvconnect's node-level holder; print {"ready": true};
        exit when stdin closes
    python mooncake_peer.py store-hybrid MASTER SEGMENT_BYTES SEED
        an engine on a DeepSeek-V4-like hybrid layout (sliding window + compress-4 +
        compress-128 groups) whose Mooncake tier contributes the segment: store a prompt,
        flush, print {"stored": N, ...}; keep the segment until stdin closes
    python mooncake_peer.py put-foreign MASTER NAME SIZE
        write SIZE bytes of 0xAB under the object NAME with a raw Mooncake client (no
        segment of its own), print {"rc": code}
    python mooncake_peer.py remove MASTER NAME...
        remove the objects NAME... (forced) with a raw Mooncake client, print {"rc": [codes]}:
        what an eviction of one object does, on demand

Every client binds loopback (MC_TCP_BIND_ADDRESS, set by the test's environment).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]  # this checkout's kvconnect

HYBRID = "dsv4-flash"
HYBRID_CHUNK = 256
HYBRID_TOKENS = 3 * HYBRID_CHUNK + 40


def hybrid_case(seed: int):
    """The same case, tokens and block tables in every process (a pure function of ``seed``)."""
    import numpy as np

    from support import zoo

    rng = np.random.default_rng(seed)
    case = zoo.build(HYBRID, max_tokens=HYBRID_TOKENS, seed=seed)
    tokens = zoo.random_tokens(rng, HYBRID_TOKENS)
    bounds = zoo.chunk_bounds_ref(HYBRID_TOKENS, HYBRID_CHUNK, False)
    tables = zoo.random_tables(case, HYBRID_TOKENS, rng, keep=zoo.window_keep(case, bounds))
    return case, tokens, bounds, tables, rng


def hybrid_engine(case, remote_url: str, segment_bytes: int, tmp: str, *, model: str = "", timeout_s: float = 5.0):
    """An engine with a small private pool and the Mooncake tier (segment of ``segment_bytes``)."""
    import os

    from kvconnect import KVCacheEngine

    from support import zoo

    path = os.path.join(tmp, f"mooncake-{os.getpid()}-{segment_bytes}.json")
    with open(path, "w") as f:
        json.dump({"global_segment_size": segment_bytes, "protocol": "tcp"}, f)
    layout = case.layout(model_name=model) if model else case.layout()
    config = zoo.small_config(HYBRID_CHUNK, remote_url=remote_url, mooncake_config_path=path, remote_timeout_s=timeout_s)
    return KVCacheEngine(layout, config)


def wait_connected(tier, timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not tier.connected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main(argv: list[str]) -> int:
    mode, master = argv[0], argv[1]
    if mode == "hold":
        from kvconnect.server.mooncake_holder import MooncakeHolder
        from kvconnect.storage.mooncake.config import MooncakeSpec

        holder = MooncakeHolder(MooncakeSpec(master_address=master, global_segment_bytes=int(argv[2])))
        print(json.dumps({"ready": holder.wait_connected(60)}), flush=True)
        sys.stdin.read()
        holder.close()
        return 0
    if mode == "store-hybrid":
        import tempfile

        segment, seed = int(argv[2]), int(argv[3])
        case, tokens, bounds, tables, _ = hybrid_case(seed)
        with tempfile.TemporaryDirectory() as tmp:
            engine = hybrid_engine(case, "mooncakestore://" + master, segment, tmp)
            tier = engine.storage.tiers[0]
            ok = wait_connected(tier)
            stored = engine.store(tokens, tables)
            flushed = engine.storage.flush(60)
            print(json.dumps({"connected": ok, "stored": stored, "flushed": flushed,
                              "written": engine.storage.tier_stats()["tiers"][0]["writer"]["written"],
                              "window_pieces": engine.stats.window_pieces_stored}), flush=True)
            sys.stdin.read()
            engine.close()
        return 0
    if mode == "remove":
        from kvconnect.storage.mooncake.config import MooncakeSpec, import_store

        store = import_store(MooncakeSpec(master_address=master))()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
        print(json.dumps({"rc": list(store.batch_remove(argv[2:], True))}), flush=True)
        store.close()
        return 0
    if mode == "put-foreign":
        import numpy as np

        from kvconnect.storage.mooncake.config import MooncakeSpec, import_store

        store = import_store(MooncakeSpec(master_address=master))()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
        data = np.full(int(argv[3]), 0xAB, dtype=np.uint8)
        store.register_buffer(data.ctypes.data, data.nbytes)
        (rc,) = store.batch_upsert_from([argv[2]], [data.ctypes.data], [data.nbytes])
        print(json.dumps({"rc": rc}), flush=True)
        store.close()
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
