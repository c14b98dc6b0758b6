#!/usr/bin/env bash
# Installs what the storage-tier tests need: redis-server + redis-cli (Debian package; the
# tests start and stop their own servers on loopback ports, the system service is not used)
# and the redis Python client (with the hiredis parser). Idempotent.
set -euo pipefail
PY=${PYTHON:-python3}
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
if ! $PY -c "import redis, hiredis" >/dev/null 2>&1; then
    $PY -m pip install -q --disable-pip-version-check "redis>=5" hiredis
fi
redis-server --version
$PY -c "import redis; print('redis-py', redis.__version__)"
