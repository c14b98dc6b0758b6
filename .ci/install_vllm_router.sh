#!/usr/bin/env bash
# Installs vLLM's prefill/decode router (`vllm-router` on PyPI: a Rust binary in a wheel) into
# .venv-router (git-ignored), for the P/D end-to-end tests (tests/integration/test_vllm_pd*.py)
# and benchmarks/vllm_pd.py.  A venv of its own: the router needs nothing of vLLM's and its
# Python deps must not move vLLM's.  Idempotent: a venv whose binary answers --help is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-router
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/vllm-router" --help >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q -U pip
    "$VENV/bin/python" -m pip install -q "vllm-router==$VLLM_ROUTER_VERSION"
fi
"$VENV/bin/vllm-router" --help >/dev/null
echo "vllm-router $VLLM_ROUTER_VERSION ok ($VENV/bin/vllm-router)"
