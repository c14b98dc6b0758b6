"""The ``kvconnect`` command.

    kvconnect server --url ipc:///tmp/kvc.sock --size-gb 8     # the node's cache server
    kvconnect info   --url ipc:///tmp/kvc.sock                 # its counters, as JSON

Defaults come from the same configuration the engines read (``kvconnect.config``):
``--url`` from KVCONNECT_SERVER_URL (else ipc:///tmp/kvconnect.sock), ``--size-gb`` from
LMCACHE_MAX_LOCAL_CPU_SIZE, the token from KVCONNECT_SERVER_TOKEN or ``--token-file``
(``--token`` works too but shows in the process list).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Optional, Sequence

from .config import GB, Config
from .errors import KVConnectError

DEFAULT_URL = "ipc:///tmp/kvconnect.sock"


def _token(args: argparse.Namespace, config: Config) -> Optional[str]:
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            return f.read().strip() or None
    return args.token or config.server_token


def _serve(args: argparse.Namespace, config: Config) -> int:
    from .server.server import CacheServer

    server = CacheServer(
        args.url, int(args.size_gb * GB), page_bytes=args.page_kb * 1024, token=_token(args, config),
        allow_remote=args.allow_remote, lease_s=args.lease_s,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    info = server.segment.info
    logging.getLogger("kvconnect").info(
        "kvconnect server on %s: %d pages of %d KiB (%.2f GB) in /dev/shm/%s, lease %.1f s%s",
        server.url, info.num_pages, info.page_bytes // 1024, info.num_pages * info.page_bytes / GB, info.name,
        server.lease_s, ", token required" if server.token else "",
    )
    print(f"kvconnect server ready on {server.url}", flush=True)
    try:
        server.serve(stop)
    finally:
        server.close()
    return 0


def _info(args: argparse.Namespace, config: Config) -> int:
    from .server.client import SharedPoolClient

    client = SharedPoolClient(args.url, 1, token=_token(args, config), timeout_s=args.timeout_s)
    try:
        stats = client.server_stats()
    finally:
        client.close()
    if stats is None:
        print(f"no cache server answers on {args.url}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = Config.from_env()
    parser = argparse.ArgumentParser(prog="kvconnect", description="kvconnect: KV-cache offload for LLM serving engines")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("server", "run the node-level cache server"), ("info", "print a running server's counters")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--url", default=config.server_url or DEFAULT_URL, help="ipc:///path or tcp://127.0.0.1:PORT")
        p.add_argument("--token", default=None, help="shared secret (prefer KVCONNECT_SERVER_TOKEN or --token-file)")
        p.add_argument("--token-file", default=None, help="read the shared secret from this file")
        p.add_argument("-v", "--verbose", action="store_true")
    serve = sub.choices["server"]
    serve.add_argument("--size-gb", type=float, default=config.max_local_cpu_size, help="shared pool size, GB (default LMCACHE_MAX_LOCAL_CPU_SIZE)")
    serve.add_argument("--page-kb", type=int, default=64, help="allocation page, KiB (multiple of 4)")
    serve.add_argument("--lease-s", type=float, default=10.0, help="a silent client's pins are released after this")
    serve.add_argument("--allow-remote", action="store_true", help="allow a non-loopback tcp:// address (needs a token)")
    sub.choices["info"].add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return _serve(args, config) if args.command == "server" else _info(args, config)
    except KVConnectError as exc:
        print(f"kvconnect: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
