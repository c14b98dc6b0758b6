"""vLLM 0.23's own DeepSeek V4 layout (fp8_ds_mla, 576-B aligned pages, layers of different
groups sharing allocations) from its real allocation code, round-tripped through kvconnect.

Runs ``vllm_dsv4.py`` in a fresh process: vLLM-Ascend's platform patches (active in this
test process) must not touch vLLM's own planner and runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_vllm_own_deepseek_v4_round_trips():
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_dsv4.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    # vLLM's grouping: C4 and C128 MLA (and the C4 indexer) in one full group of 256-token blocks
    kinds = [(g[0], g[1], g[2], g[3]) for g in out["groups"]]
    assert kinds == [("MLAAttentionSpec", 256, 4, None), ("SlidingWindowMLASpec", 64, 1, 128),
                     ("SlidingWindowMLASpec", 64, 1, 128), ("SlidingWindowMLASpec", 4, 1, 8),
                     ("SlidingWindowMLASpec", 8, 1, 128)]
    assert out["layers"]["model.layers.1.attn"][:2] == [[420, 64, 584], [37440, 584, 1]]  # padded pages
    assert out["layers"]["model.layers.2.attn"][0] == [420, 2, 584]  # C128: 2 rows per 256-token block
    assert out["release"] == "vllm"
    # kvconnect splits vLLM's mixed-ratio group by ratio: C4 (+indexer), C128, SWA x2, two state groups
    assert [tuple(g[:3]) for g in out["kv_groups"]] == [(256, 4, None), (256, 128, None), (64, 1, 127),
                                                        (64, 1, 127), (4, 1, 7), (8, 1, 127)]
    # the C128 compressor state (block 8, window 128) holds no row at 128-aligned restore points
    assert out["window_free_every"] == [None, None, None, None, None, 128]
    assert out["lookup"] == 1280 and out["retrieved"] == 1280
    assert out["rows_compared"] > 1000 and out["mismatches"] == {}
