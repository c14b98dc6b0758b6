"""The connector on what vLLM-Ascend 0.13.0rc3's runner hands over for DeepSeek V4:
``register_kv_caches(kv_caches, kv_states)`` (``NPUModelRunner.initialize_kv_cache``), created
through vLLM 0.13's connector factory. The block-addressed caches translate (test_round_trip
proves their restores byte-exact), but the sliding-window and compressor states live in
``kv_states``, one buffer slot per running request (``KVStateManager``), which no block id
addresses: a hit would resume with stale states. So: no hit, one WARNING naming the release
and why, nothing raised."""

from __future__ import annotations

import logging
import types

import numpy as np

import harness013 as h


def _connector(case, role, tmp_path):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ktc = KVTransferConfig(kv_connector="KVConnectConnector", kv_role="kv_both",
                           kv_connector_module_path="kvconnect.integrations.vllm",
                           kv_connector_extra_config={"chunk_size": 256, "max_local_cpu_size": 0.2,
                                                      "lookup_url": f"ipc://{tmp_path}/kvc"})
    vc = case.vllm_config
    config = types.SimpleNamespace(
        kv_transfer_config=ktc, scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                              decode_context_parallel_size=1, data_parallel_rank=0),
        model_config=types.SimpleNamespace(model="tiny/deepseek-v4-013", revision=None),
        compilation_config=vc.compilation_config, cache_config=vc.cache_config)
    cls = KVConnectorFactory.get_connector_class(ktc)
    assert cls.__name__ == "KVConnectConnector"
    return KVConnectorFactory.create_connector(config, role, case.kv_cache_config)


def test_kv_states_refuse_hits_with_one_warning_naming_the_release(tmp_path, caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    case = h.deepseek_v4()
    worker = _connector(case, KVConnectorRole.WORKER, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="kvconnect"):
            worker.register_kv_caches(case.kv_caches, case.kv_states)  # exactly the runner's call
        lines = list({id(r): r for r in caplog.records
                      if r.name.startswith("kvconnect") and r.levelno >= logging.WARNING}.values())
        assert len(lines) == 1, [r.getMessage() for r in lines]
        text = lines[0].getMessage()
        assert "off for this model" in text and "vllm-ascend 0.13" in text and "per request slot" in text
        assert "stale" in text and f"kv_states of {len(case.kv_states)} layers" in text
        # the block-addressed part is recognised: both compressed groups translate
        assert "Compress128AttentionSpec, Compress4AttentionSpec" in text and "translate to 2 kvconnect groups" in text
        assert worker._worker.stats()["enabled"] == 0
        assert worker._worker.lookup(np.arange(600, dtype=np.int64)) == 0
    finally:
        worker.shutdown()
