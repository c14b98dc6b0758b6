"""The connector as vLLM-Ascend users enable it: through vLLM-Ascend's plugin registration and
vLLM 0.23's connector factory, on the caches vLLM-Ascend's own runner allocates."""

from __future__ import annotations

import dataclasses
import logging
import types

import numpy as np
import pytest

import harness
from kvconnect.errors import UnsupportedLayoutError


def _vllm_config(case, tmp_path):
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KVConnectConnector", kv_role="kv_both",
                           kv_connector_module_path="kvconnect.integrations.vllm",
                           kv_connector_extra_config={"chunk_size": 256, "max_local_cpu_size": 0.2,
                                                      "lookup_url": f"ipc://{tmp_path}/kvc"})
    vc = case.vllm_config
    return types.SimpleNamespace(
        kv_transfer_config=ktc, scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                              decode_context_parallel_size=1, data_parallel_rank=0),
        model_config=types.SimpleNamespace(model=f"tiny/{case.name}", revision=None),
        compilation_config=vc.compilation_config, cache_config=vc.cache_config)


def _create(case, role, tmp_path):
    import vllm_ascend
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    if "MooncakeConnectorV1" not in KVConnectorFactory._registry:
        vllm_ascend.register_connector()  # the vllm.general_plugins entry point's work (once per process)
    config = _vllm_config(case, tmp_path)
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert cls.__name__ == "KVConnectConnector" and supports_hma(cls)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    return KVConnectorFactory.create_connector(config, role, case.kv_cache_config)


def test_factory_resolves_kvconnect_with_hma_and_registers_deepseek_v4(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    case = harness.deepseek_v4(device="A3", num_blocks=12)
    worker = _create(case, KVConnectorRole.WORKER, tmp_path)
    try:
        worker.register_kv_caches(case.kv_caches)  # exactly what NPUModelRunner hands over
        stats = worker._worker.stats()
        assert stats["enabled"] == 1
        # C4 (attention + indexer K/scale), C128, two SWA groups, two compressor-state groups
        assert stats["num_groups"] == 6
        assert worker._worker.lookup(np.arange(600, dtype=np.int64)) == 0
    finally:
        worker.shutdown()
    scheduler = _create(case, KVConnectorRole.SCHEDULER, tmp_path)
    scheduler.shutdown()


def test_a_model_the_connector_cannot_serve_logs_one_warning_and_stays_off(tmp_path, caplog):
    """V3.2 with the indexer replicated over decode-context ranks: refused, one WARNING line
    naming the layer and the reason, no hit, nothing raised into vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    case = harness.deepseek_mla(variant="v32", dcp=2, num_blocks=12)
    worker = _create(case, KVConnectorRole.WORKER, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="kvconnect"):
            worker.register_kv_caches(case.kv_caches)
        # distinct records: pytest's capture handlers sit on both the kvconnect and the vllm logger (neither
        # propagates), and kvconnect routes its records through vLLM's tree, so caplog sees one record twice
        lines = list({id(r): r for r in caplog.records if r.name.startswith("kvconnect") and r.levelno >= logging.WARNING}.values())
        assert len(lines) == 1, [r.getMessage() for r in lines]
        message = lines[0].getMessage()
        assert lines[0].levelno == logging.WARNING
        assert "model.layers.0.self_attn.attn" in message and "replicated" in message
        assert worker._worker.stats()["enabled"] == 0
        assert worker._worker.lookup(np.arange(600, dtype=np.int64)) == 0
    finally:
        worker.shutdown()


def test_kv_events_take_vllm_023s_event_shapes():
    """vLLM 0.23 (vLLM-Ascend's base) has no ``MEDIUM_CPU`` and no ``ownership`` field: the
    connector's events are built from the fields this release declares."""
    import harness  # noqa: F401  (vLLM-Ascend's import stand-ins)
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from kvconnect.events import ChunkEvent
    from kvconnect.integrations.vllm import kv_events

    events = kv_events.to_vllm([
        ChunkEvent("stored", b"\x01" * 16, None, (5, 6, 7), "cpu"),
        ChunkEvent("stored", b"\x02" * 16, b"\x01" * 16, (8, 9, 10), "disk"),
        ChunkEvent("removed", b"\x01" * 16, None, (), "cpu"),
        ChunkEvent("cleared", b"", None, (), "cpu"),
    ])
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    assert events[0].token_ids == [5, 6, 7] and events[0].block_size == 3 and events[0].medium == "CPU"
    assert events[0].parent_block_hash is None and events[1].parent_block_hash == events[0].block_hashes[0]
    assert events[1].medium == "STORAGE" and events[2].medium == "CPU"


def test_v013_state_buffers_as_a_second_argument_turn_the_connector_off_without_raising(tmp_path, caplog):
    """vLLM-Ascend releases/v0.13.0 (DeepSeek V4, #8648) calls ``register_kv_caches(kv_caches,
    kv_states)``: its sliding-window and compressor states are per-request buffers
    ``[(max_num_reqs + 1) * multiple, block_size, dim]`` indexed by state ids, not blocks. That
    release runs in its own venv (tests/ascend013/test_connector.py, on its real ``kv_states``);
    here ``kv_states`` is a SYNTHETIC fixture with its shapes for one C4 layer, on 0.23's caches:
    any release handing kv_states over gets one WARNING, off, nothing raised."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    case = harness.deepseek_v4(device="A3", num_blocks=12)
    worker = _create(case, KVConnectorRole.WORKER, tmp_path)
    block_num, block_size, head_dim, index_dim = 2 * 3, 128, 512, 128
    kv_states = {"model.layers.2.self_attn": (
        torch.zeros(block_num, block_size, head_dim, dtype=torch.bfloat16),  # sliding window
        torch.zeros(block_num, block_size, 2 * head_dim), torch.zeros(block_num, block_size, 2 * head_dim),  # c4 kv / score
        torch.zeros(block_num, block_size, 2 * index_dim), torch.zeros(block_num, block_size, 2 * index_dim),  # indexer
    )}
    try:
        with caplog.at_level(logging.WARNING, logger="kvconnect"):
            worker.register_kv_caches(case.kv_caches, kv_states)
        lines = list({id(r): r for r in caplog.records if r.name.startswith("kvconnect") and r.levelno >= logging.WARNING}.values())
        assert len(lines) == 1 and "per-request state buffers" in lines[0].getMessage(), [r.getMessage() for r in lines]
        assert worker._worker.stats()["enabled"] == 0
        assert worker._worker.lookup(np.arange(600, dtype=np.int64)) == 0
    finally:
        worker.shutdown()
