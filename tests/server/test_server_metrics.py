"""The opt-in Prometheus exporters: ``kvconnect server --metrics-port`` and an engine's
process with KVCONNECT_METRICS_PORT, scraped over HTTP on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from support.server_rig import REPO, clean_env, socket_dir, stop_process

pytest.importorskip("prometheus_client")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _value(text: str, prefix: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return float(line.rsplit(" ", 1)[1])


def test_server_exporter(tmp_path):
    port = _free_port()
    with socket_dir() as d:
        cmd = [sys.executable, "-m", "kvconnect.cli", "server", "--url", f"ipc://{d}/kvc.sock", "--size-gb", str(16 / 1024),
               "--metrics-port", str(port)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=clean_env(), cwd=REPO)
        try:
            text = _scrape(port)
            assert 15 << 20 < _value(text, 'kvconnect_server_capacity_bytes{instance="server"}') <= 16 << 20
            assert _value(text, 'kvconnect_server_used_bytes{instance="server"}') == 0
            assert _value(text, 'kvconnect_server_clients{instance="server"}') == 0
            # an engine on the server stores two chunks: the server's figures move
            env = clean_env(KVCONNECT_SERVER_URL=f"ipc://{d}/kvc.sock", LMCACHE_CHUNK_SIZE="32", KVCONNECT_MODEL_NAME="test/server-metrics")
            engine = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env, cwd=str(tmp_path))
            try:
                assert engine.stdout.readline().decode().strip() == "ready", engine.stderr.read().decode()[-3000:]
                text = _scrape(port)
                assert _value(text, 'kvconnect_server_entries{instance="server"}') == 2
                assert _value(text, 'kvconnect_server_used_bytes{instance="server"}') > 0
                assert _value(text, 'kvconnect_server_clients{instance="server"}') == 1
            finally:
                engine.stdin.close()
                engine.wait(timeout=30)
        finally:
            stop_process(proc)


ENGINE_SCRIPT = """
import sys, time, numpy as np, torch
from kvconnect import GroupSpec, KVCacheEngine, KVLayout
from kvconnect.server import make_pool
kv = {"l0": torch.zeros(2, 8, 16, 2, 16, dtype=torch.bfloat16)}
engine = KVCacheEngine(KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=16)]), pool_factory=make_pool)
engine.store(np.arange(64), list(range(4)))
engine.lookup(np.arange(64))
print("ready", flush=True)
sys.stdin.readline()
"""


def test_engine_exporter_is_opt_in_on_loopback(tmp_path):
    port = _free_port()
    env = clean_env(KVCONNECT_METRICS_PORT=str(port), LMCACHE_CHUNK_SIZE="32", LMCACHE_MAX_LOCAL_CPU_SIZE="0.01")
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=str(tmp_path))
    try:
        assert proc.stdout.readline().decode().strip() == "ready", proc.stderr.read().decode()[-3000:]
        text = _scrape(port)
        assert _value(text, 'kvconnect_lookup_hit_tokens_total{instance="engine-0"}') == 64
        assert _value(text, 'kvconnect_stored_chunks_total{instance="engine-0"}') == 2
        with pytest.raises(OSError):  # bound to loopback only
            host = socket.gethostbyname(socket.gethostname())
            if host.startswith("127."):
                raise OSError("no non-loopback address to try")
            urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
