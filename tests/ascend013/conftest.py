"""tests/ascend013: vLLM-Ascend 0.13.0rc3's real DeepSeek V4 code (venv from .ci/install_ascend013.sh).

Skipped as a whole where that release is not installed (the core run, the 0.23 venv); where it
is, any failure to drive it fails the tests.
"""

import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # before torch: the installed torch_npu needs CANN


def _installed() -> bool:
    from importlib import metadata

    try:
        return metadata.version("vllm_ascend") == "0.13.0rc3"
    except metadata.PackageNotFoundError:
        return False


if not _installed():
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness013

    harness013.setup()  # stand-ins first: nothing may import the real torch_npu after this
