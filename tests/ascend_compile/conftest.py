"""tests/ascend_compile: kvconnect's Triton kernels through triton-ascend's real compiler (A2, A3, A5).

Runs in the ``.venv-triton-ascend`` venv (.ci/install_triton_ascend.sh) with its own root
(``--confcutdir tests/ascend_compile``: that venv has no torch, which the suite's conftest needs).
Skipped as a whole where ``triton`` is not triton-ascend (the core run: plain Triton).
"""

import importlib.util
import os
import sys

collect_ignore_glob = []
try:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("ascendnpuir") is None:
        raise ImportError
    from triton.backends import backends

    if "ascend" not in backends:
        raise ImportError
except ImportError:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
