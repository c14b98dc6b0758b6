"""README's SGLang try-it path: examples/try_sglang_on_cpu.py as a newcomer runs it (no harness
variables set: the script itself reruns SGLang with the CPU stand-ins), run unchanged under the
real SGLang 0.5.23 engine: one prompt, flush_cache, the same prompt served from kvconnect (L3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt", reason="SGLang is not installed (.ci/install_sglang.sh)")

from engine_runs import REPO  # noqa: E402

pytestmark = pytest.mark.sglang


def test_try_sglang_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LMCACHE_", "KVCONNECT_", "SGLANG_")) and k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(REPO / "examples" / "try_sglang_on_cpu.py"), "--dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=540, cwd=str(tmp_path))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "OK: the repeated prompt was served from kvconnect" in text
    assert '"storage_backend": "KVConnectStorage"' in text and '"storage": 64' in text  # 4 of the prompt's 5 pages
    assert "--hicache-storage-backend dynamic" in text  # the server form is printed for the user
