"""tests/ascend: vLLM-Ascend 0.23.0.post1's real allocation code (venv from .ci/install_ascend.sh).

Skipped as a whole where vllm_ascend is not installed (the core run on the system python);
where it is installed, any failure to drive it fails the tests.
"""

import importlib.util
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # before torch: the installed torch_npu needs CANN

if importlib.util.find_spec("vllm_ascend") is None or importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    harness.setup()  # stand-ins first: nothing may import the real torch_npu after this
