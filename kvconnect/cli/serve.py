"""``kvconnect server`` (the node's cache server) and ``kvconnect info`` (its counters)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Optional

from ..metrics.catalogue import Figures
from ..metrics.figures import server_figures
from ..metrics.prometheus import collector, start_exporter
from ..config import GB, Config

DEFAULT_URL = "ipc:///tmp/kvconnect.sock"


def add_parsers(sub, config: Config) -> None:
    for name, helptext in (("server", "run the node-level cache server"), ("info", "print a running server's counters")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--url", default=config.server_url or DEFAULT_URL,
                       help="ipc:///path or tcp://127.0.0.1:PORT (default %(default)s: KVCONNECT_SERVER_URL, else "
                            f"{DEFAULT_URL})")
        p.add_argument("--token", default=None, help="shared secret (prefer KVCONNECT_SERVER_TOKEN or --token-file)")
        p.add_argument("--token-file", default=None, help="read the shared secret from this file")
        p.add_argument("-v", "--verbose", action="store_true")
    serve = sub.choices["server"]
    serve.add_argument("--size-gb", type=float, default=config.max_local_cpu_size, help="shared pool size, GB (default LMCACHE_MAX_LOCAL_CPU_SIZE)")
    serve.add_argument("--page-kb", type=int, default=64, help="allocation page, KiB (multiple of 4)")
    serve.add_argument("--lease-s", type=float, default=10.0, help="a silent client's pins are released after this")
    serve.add_argument("--allow-remote", action="store_true", help="allow a non-loopback tcp:// address (needs a token)")
    serve.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                       help="ipc://: also answer processes of this uid (repeatable; they must be able to open the socket "
                            "and the segment: give them --allow-group or an ACL). Default: only the server's own uid")
    serve.add_argument("--allow-group", default=None, metavar="GROUP",
                       help="ipc://: also answer members of this group (name or gid); the socket file and the segment "
                            "become mode 0660 owned by it")
    serve.add_argument("--max-sessions-per-peer", type=int, default=None,
                       help="client sessions one peer (a uid, or all holders of the token) may hold at once (default 1024)")
    serve.add_argument("--metrics-port", type=int, default=config.server_metrics_port,
                       help="Prometheus exporter port (default KVCONNECT_SERVER_METRICS_PORT; 0: off), on KVCONNECT_METRICS_HOST")
    serve.add_argument("--mooncake-segment-gb", type=float, default=None,
                       help="hold this much of the node's memory for the Mooncake Store named by LMCACHE_REMOTE_URL="
                            "mooncakestore://HOST:PORT (default: global_segment_size of MOONCAKE_CONFIG_PATH, else 1 GB; "
                            "0: hold nothing). Engines using this server contribute nothing themselves")
    info = sub.choices["info"]
    info.add_argument("--timeout-s", type=float, default=2.0)
    info.add_argument("--json", action="store_true", help="machine-readable counters")


def _token(args: argparse.Namespace, config: Config) -> Optional[str]:
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            return f.read().strip() or None
    return args.token or config.server_token


def run(args: argparse.Namespace, config: Config) -> int:
    return _serve(args, config) if args.command == "server" else _info(args, config)


def _serve(args: argparse.Namespace, config: Config) -> int:
    import dataclasses

    from ..server.admission import DEFAULT_MAX_SESSIONS_PER_PEER, PeerPolicy, group_id
    from ..server.server import CacheServer

    peers = PeerPolicy(allow_uids=frozenset(args.allow_uid), allow_gid=None if args.allow_group is None else group_id(args.allow_group),
                       max_sessions_per_peer=args.max_sessions_per_peer or DEFAULT_MAX_SESSIONS_PER_PEER)
    server = CacheServer(
        args.url, int(args.size_gb * GB), page_bytes=args.page_kb * 1024, token=_token(args, config),
        allow_remote=args.allow_remote, lease_s=args.lease_s, eviction=config.eviction, peers=peers,
    )
    holder = _mooncake_holder(args, config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    info = server.segment.info
    logging.getLogger("kvconnect").info(
        "kvconnect server on %s: %d pages of %d KiB (%.2f GB) in /dev/shm/%s, lease %.1f s, %s eviction%s",
        server.url, info.num_pages, info.page_bytes // 1024, info.num_pages * info.page_bytes / GB, info.name,
        server.lease_s, server.index.eviction, ", token required" if server.token else "",
    )
    if args.metrics_port:
        collector().add(lambda: _server_figures(server), "server")
        start_exporter(dataclasses.replace(config, metrics_port=args.metrics_port))
    if holder is not None:
        h = holder.status()
        print(f"kvconnect server holds a {h['segment_bytes'] / GB:.2f} GB Mooncake segment for master {h['master']} "
              f"({h['protocol']}, as {h['local_hostname']})", flush=True)
    print(f"kvconnect server ready on {server.url}", flush=True)
    try:
        server.serve(stop)
    finally:
        server.close()
        if holder is not None:
            holder.close()
    return 0


def _mooncake_holder(args: argparse.Namespace, config: Config):
    """The node's Mooncake segment holder when LMCACHE_REMOTE_URL names a Mooncake master."""
    from ..storage.mooncake.config import DEFAULT_SEGMENT_BYTES, is_mooncake_url, make_spec, read_config_file

    if not is_mooncake_url(config.remote_url):
        if args.mooncake_segment_gb:
            raise SystemExit("--mooncake-segment-gb needs LMCACHE_REMOTE_URL=mooncakestore://HOST:PORT")
        return None
    spec = make_spec(config.remote_url, config.mooncake_config_path, has_node_server=False)
    if args.mooncake_segment_gb is not None:
        segment = int(args.mooncake_segment_gb * GB)
    elif "global_segment_size" in read_config_file(config.mooncake_config_path):
        segment = spec.global_segment_bytes
    else:
        segment = DEFAULT_SEGMENT_BYTES
    if segment <= 0:
        return None
    from ..server.mooncake_holder import MooncakeHolder

    return MooncakeHolder(spec.with_segment(segment))


def _server_figures(server) -> Optional[Figures]:
    from ..server.index import STATS_FIELDS

    for _ in range(3):  # read from the exporter's thread while the server loop runs: retry a torn read
        try:
            return server_figures(dict(zip(STATS_FIELDS, server.index.stats(None))))
        except RuntimeError:
            continue
    return None


def _info(args: argparse.Namespace, config: Config) -> int:
    from ..server.client import SharedPoolClient

    token = _token(args, config)
    client = SharedPoolClient(args.url, 1, token=token, timeout_s=args.timeout_s, warn_unreachable=False)
    try:
        stats = client.server_stats()
    finally:
        client.close()
    if stats is None:
        socket_path = args.url[len("ipc://"):] if args.url.startswith("ipc://") else None
        if socket_path is not None and not os.path.exists(socket_path):
            print(f"no cache server on {args.url}: there is no socket at {socket_path} (start one with "
                  f"`kvconnect server --url {args.url}`)", file=sys.stderr)
            return 1
        if token is None:
            why = ("no token was given: if the server was started with one (KVCONNECT_SERVER_TOKEN, --token-file), "
                   "pass the same; it drops frames without the right token, which looks like no answer")
        else:
            why = "is it running there, and is the token the server's? It drops frames with a wrong token, which looks like no answer"
        print(f"no cache server answers on {args.url} within {args.timeout_s:g} s: {why}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2) if args.json else human_info(args.url, stats))
    return 0


def human_info(url: str, s: dict) -> str:
    size, used = s["num_pages"] * s["page_bytes"], s["used_pages"] * s["page_bytes"]
    pct = 100.0 * used / size if size else 0.0
    rows = [
        ("server", url),
        ("pool", f"{used / GB:.2f} of {size / GB:.2f} GB used ({pct:.1f}%), {s['num_pages']} pages of {s['page_bytes'] // 1024} KiB"),
        ("chunks", f"{s['num_entries']} stored, {s['pinned_entries']} pinned by readers, {s['reserved_runs']} writes in progress"),
        ("clients", f"{s['num_clients']} connected, {s['expired_clients']} expired (lease ran out)"),
        ("evictions", f"{s['evictions']} chunks (the server's KVCONNECT_EVICTION policy), "
                      f"{s['reserve_shortfalls']} writes found no unpinned room"),
        ("commits", str(s["commits"])),
        ("refused", f"{s['refused_requests']} malformed or unauthenticated requests"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
