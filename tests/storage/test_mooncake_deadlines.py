"""The Mooncake read deadline, against a real ``mooncake_master`` and a real segment holder
(``kvconnect server --mooncake-segment-gb``): it holds whatever the transport does, and it
never cuts a healthy read short.

- A stalled holder (SIGSTOP) used to hold a read for 60 s (Mooncake's transfer retries, not
  bounded by ``MC_RPC_TIMEOUT_MS``): the read now returns when its budget ends, the pool slots
  the abandoned transfer may still write stay out of the pool until it returns, and every
  chunk reads back verified once the holder resumes.
- A 100-chunk read on a healthy link used to load the 64 chunks its first batch held and drop
  the rest (a constant deadline): the budget now grows with the bytes asked for.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch

from support.mooncake_master import MooncakeMaster, NodeHolder, client_env, mooncake_available
from mooncake_peer import wait_connected

from kvconnect import Config, GroupSpec, KVCacheEngine, KVLayout

_REASON = mooncake_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
os.environ.update({k: v for k, v in client_env().items() if k.startswith(("MC_", "GLOG_"))})

CHUNK = 256
BLOCK = 16
NUM_CHUNKS = 100  # two 64-chunk batches
LAYERS = 16  # 4.7 MB a chunk: the first batch (300 MB) takes longer than 0.1 s on any link
STALL_BOUND_S = 30.0  # the old read held for 60 s; the budget here is ~8 s


def _engine(master, tmp_path, name: str, timeout_s: float) -> KVCacheEngine:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"global_segment_size": 0, "protocol": "tcp"}))  # the holder has the memory
    kv = {f"layers.{i}": torch.zeros(CHUNK // BLOCK, BLOCK, 576, dtype=torch.bfloat16) for i in range(LAYERS)}
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=BLOCK)], model_name="deadline-test@r1")
    config = Config(chunk_size=CHUNK, max_local_cpu_size=0.6, num_threads=1, remote_url=master.url,
                    mooncake_config_path=str(path), remote_timeout_s=timeout_s)
    engine = KVCacheEngine(layout, config)
    assert wait_connected(engine.storage.tiers[0])
    return engine


def _prompts() -> list[np.ndarray]:
    return [np.random.default_rng([i, 31]).integers(0, 32000, CHUNK, dtype=np.int64) for i in range(NUM_CHUNKS)]


@pytest.fixture
def stored(tmp_path):
    """100 one-chunk prompts written by an engine that has exited, held by a node server."""
    with MooncakeMaster(tmp_path / "master") as master:
        holder = NodeHolder(master, tmp_path / "node", 1.0)
        try:
            writer = _engine(master, tmp_path, "writer", 2.0)
            try:
                for i, tensor in enumerate(writer.layout.tensors):
                    tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape,
                                                                 generator=torch.Generator().manual_seed(i),
                                                                 dtype=torch.uint8))
                for tokens in _prompts():
                    assert writer.store(tokens, [list(range(CHUNK // BLOCK))]) == CHUNK
                assert writer.storage.flush(120)
                assert writer.storage.tiers[0].stats().puts == NUM_CHUNKS
            finally:
                writer.close()
            yield master, holder
        finally:
            holder.stop()


def _seen_and_healthy(tier, keys) -> None:
    """The tier has read every chunk's header (a lookup of a fresh tier also opens its transport
    to the holder, which a 0.1 s lookup may not wait for) and its breaker is closed."""
    deadline = time.monotonic() + 60
    while not all(m is not None for m in tier.masks(keys)) or not tier.healthy():
        assert time.monotonic() < deadline, "the lookups never answered"
        time.sleep(0.1)


def _keys(engine) -> list:
    return [engine.chunks(tokens, include_partial=False)[0].key for tokens in _prompts()]


def test_a_large_read_on_a_healthy_link_is_not_cut_short(stored, tmp_path):
    """remote_timeout_s 10 ms and ~470 MB asked for: a constant deadline read the first batch
    (64 chunks) and dropped the rest; the budget of the bytes reads all 100, verified. (The
    read is the tier's, on the reader's free pool slots: a 10 ms lookup is another matter.)"""
    master, _ = stored
    reader = _engine(master, tmp_path, "reader", 0.01)
    tier = reader.storage.tiers[0]
    try:
        keys = _keys(reader)
        _seen_and_healthy(tier, keys)
        slots = reader.pool.reserve(NUM_CHUNKS)
        assert len(slots) == NUM_CHUNKS
        headers = tier.read_many_into(keys, [memoryview(reader.pool.slot_view(s).numpy()) for s in slots])
        reader.pool.abort(slots)
        assert sum(h is not None for h in headers) == NUM_CHUNKS  # each verified (checksum) by the tier
        # ``short_reads`` counts reads stopped between batches; ``cut_short`` is not checked:
        # a 10 ms lookup of _seen_and_healthy the caller stopped waiting for may still be
        # running on its worker and count its own cut after any snapshot taken here
        assert tier.counters["short_reads"] == 0
        assert tier.stats().corrupt == 0
        assert tier.reader.read_budget_s(NUM_CHUNKS * reader.pool.slot_bytes) > 50 * tier.timeout_s
    finally:
        reader.close()


def test_a_stalled_segment_holder_costs_the_read_budget_not_a_minute(stored, tmp_path):
    master, holder = stored
    reader = _engine(master, tmp_path, "reader", 1.0)
    tier, pool = reader.storage.tiers[0], reader.pool
    try:
        keys = _keys(reader)
        assert all(m is not None for m in reader.storage.masks(keys))  # headers seen: masks now ask the master only
        os.kill(holder.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            entries = reader.storage.acquire(keys)
            elapsed = time.monotonic() - start
            assert all(e is None for e in entries)
            assert elapsed < STALL_BOUND_S, elapsed  # a hang guard: the budget is ~3 s, the old read 60 s
            assert tier.counters["reads_abandoned"] == 1 and tier.counters["short_reads"] == 1
            # the slots the abandoned transfer may still write are not in the pool's free list
            free = pool.reserve(pool.num_slots)
            pool.abort(free)
            assert len(free) < pool.num_slots
        finally:
            os.kill(holder.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while True:  # the abandoned transfer returns once the holder runs again; its slots come back
            free = pool.reserve(pool.num_slots)
            pool.abort(free)
            if len(free) == pool.num_slots:
                break
            assert time.monotonic() < deadline, "the abandoned read's slots never came back"
            time.sleep(0.2)
        deadline = time.monotonic() + 60
        while not tier.healthy():
            assert time.monotonic() < deadline, "the tier did not recover"
            time.sleep(0.1)
        entries = reader.storage.acquire(keys)
        try:
            assert sum(e is not None for e in entries) == NUM_CHUNKS  # every chunk survived, verified
        finally:
            reader.storage.release(entries)
        assert tier.stats().corrupt == 0
    finally:
        reader.close()
