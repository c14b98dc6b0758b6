"""Fixtures for the SGLang tests (tests/sglang): the real SGLang 0.5.23 engine on CPU.

Skipped when ``sglang`` is not installed (the core CI run); run by ``.ci/run`` from
``.venv-sglang`` (``.ci/install_sglang.sh``), where a broken install fails them. The engine
runs in subprocesses with the TEST HARNESS stand-ins (``harness/``, see its sitecustomize)
on PYTHONPATH: the product patches nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    sys.path.insert(0, str(HERE))
    config.addinivalue_line("markers", "sglang: needs the real SGLang engine (installed by .ci/install_sglang.sh)")
