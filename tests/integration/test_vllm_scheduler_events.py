"""kvconnect's chunk events through vLLM's connector KV-event interface, published by vLLM's own
ZMQ event publisher (``KVEventsConfig(publisher="zmq")``) and read the way a KV-aware router
reads them (a SUB socket, msgspec-decoded ``KVEventBatch``)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK = 64


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama")  # conftest: built once per session


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events = []

    def collect(self, timeout_s: float = 2.0) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._sub.poll(100):
                _topic, _seq, payload = self._sub.recv_multipart()
                self.events.extend(self._decoder.decode(payload).events)
        return self.events

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


def test_chunks_stored_removed_and_cleared_reach_vllms_publisher(model_dir, tmp_path):
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
    from vllm_scheduler_rig import make_rig

    endpoint = f"ipc://{tmp_path}/kv-events"  # vLLM's publisher binds ipc endpoints (it connects to a tcp host)
    rig = make_rig(model_dir, chunk_size=CHUNK, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"),
        extra={"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05})
    sub = Subscriber(endpoint)
    try:
        time.sleep(0.5)  # a SUB socket sees only what is published after it joined
        tokens = np.random.default_rng(0).integers(3, 1000, 200)
        rig.add(tokens)
        rig.run()
        assert rig.engine.storage.flush(30.0)
        rig.step()  # an idle step carries what the save and disk threads recorded since
        events = sub.collect()
        ours = [e for e in events if isinstance(e, BlockStored) and (e.ownership or "").startswith("kvconnect")]
        cpu = [e for e in ours if e.ownership == "kvconnect-cpu"]
        disk = [e for e in ours if e.ownership == "kvconnect-disk"]
        assert [e.token_ids for e in cpu] == [tokens[i:i + CHUNK].tolist() for i in (0, 64, 128)]
        assert all(e.medium == "CPU" and e.block_size == CHUNK for e in cpu)
        assert cpu[0].parent_block_hash is None
        assert [e.parent_block_hash for e in cpu[1:]] == [e.block_hashes[0] for e in cpu[:-1]]
        # the disk tier's copies: same chunks, same hashes and tokens, medium STORAGE
        assert sorted(map(str, (e.block_hashes for e in disk))) == sorted(map(str, (e.block_hashes for e in cpu)))
        assert all(e.medium == "STORAGE" for e in disk) and {tuple(e.token_ids) for e in disk} == {tuple(e.token_ids) for e in cpu}
        # vLLM's own GPU-tier events are still there beside ours
        assert any(isinstance(e, BlockStored) and e.medium == "GPU" for e in events)

        assert rig.scheduler.reset_prefix_cache(reset_connector=True)
        rig.step()
        assert any(isinstance(e, AllBlocksCleared) for e in sub.collect())
        rig.assert_no_leak()
    finally:
        sub.close()
        rig.close()


def test_no_events_are_recorded_unless_vllms_kv_events_are_on(model_dir):
    from vllm_scheduler_rig import make_rig

    rig = make_rig(model_dir, chunk_size=CHUNK)
    try:
        rig.add(np.arange(3, 203))
        rig.run()
        assert rig.engine.events is None
        assert rig.worker.get_kv_connector_kv_cache_events() is None
    finally:
        rig.close()
