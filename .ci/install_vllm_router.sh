#!/usr/bin/env bash
# Installs vLLM's prefill/decode router (`vllm-router` on PyPI: a Rust binary in a wheel) into
# a cached venv linked as .venv-router (git-ignored; .ci/venv_cache.sh), for the P/D end-to-end tests (tests/integration/test_vllm_pd*.py)
# and benchmarks/vllm_pd.py.  A venv of its own: the router needs nothing of vLLM's and its
# Python deps must not move vLLM's.  Idempotent: a complete venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/venv_cache.sh

VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}

use_cached_venv .venv-router "$0"
if ! venv_complete; then
    "$PY" -m pip install -q -U pip
    "$PY" -m pip install -q "vllm-router==$VLLM_ROUTER_VERSION"
    "$VENV/bin/vllm-router" --help >/dev/null
    mark_venv_complete
fi
.venv-router/bin/vllm-router --help >/dev/null
echo "vllm-router $VLLM_ROUTER_VERSION ok (.venv-router/bin/vllm-router)"
