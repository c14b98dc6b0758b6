"""Chunk events (kvconnect.events): stored per tier with tokens and parents, removed on eviction,
cleared on reset; nothing recorded until enabled; bounded."""

from __future__ import annotations

import kv_rig
from kvconnect.events import ChunkEventLog

N = 4 * kv_rig.CHUNK_TOKENS


def test_stored_evicted_cleared_per_tier(tmp_path):
    layout = kv_rig.mla_layout()
    eng = kv_rig.make_engine(layout, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    kv_rig.store_prompt(eng, 0, N)
    assert eng.storage.flush(30.0)
    assert eng.events is None  # off until an adapter asks
    log = eng.enable_events()
    assert kv_rig.store_prompt(eng, 1, N) == N
    assert eng.storage.flush(30.0)
    events = log.drain()
    toks = kv_rig.tokens(1, N)
    keys = [bytes(c.key) for c in eng.chunks(toks, include_partial=False)]
    cpu = [e for e in events if e.kind == "stored" and e.medium == "cpu"]
    disk = [e for e in events if e.kind == "stored" and e.medium == "disk"]
    assert [e.key for e in cpu] == keys and [e.parent for e in cpu] == [None] + keys[:-1]
    assert [list(e.token_ids) for e in cpu] == [toks[i:i + kv_rig.CHUNK_TOKENS].tolist() for i in range(0, N, kv_rig.CHUNK_TOKENS)]
    assert sorted(e.key for e in disk) == sorted(keys) and all(e.token_ids for e in disk)
    # fill the pool until the prompt's chunks are evicted: each eviction is a "removed" event
    seed = 2
    while not any(e.kind == "removed" and e.key in keys for e in log.drain()):
        kv_rig.store_prompt(eng, seed, N)
        seed += 1
        assert seed < 200, "the pool never evicted"
    eng.reset()
    assert [e.kind for e in log.drain()][-1] == "cleared"
    eng.close()


def test_the_log_is_bounded():
    log = ChunkEventLog(max_events=3)
    log.removed("cpu", [b"a", b"b", b"c", b"d", b"e"])
    assert [e.key for e in log.drain()] == [b"c", b"d", b"e"] and log.dropped == 2
