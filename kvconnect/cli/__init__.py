"""The ``kvconnect`` command.

    kvconnect server  --url ipc:///tmp/kvc.sock --size-gb 8     # the node's cache server
    kvconnect info    --url ipc:///tmp/kvc.sock [--json]        # its counters
    kvconnect inspect --preset deepseek-v4-flash --tokens 1M    # a model's KV layout and sizes
    kvconnect inspect --config path/to/config.json --tp 8
    kvconnect bench   --preset llama-3.1-8b --layers 4          # transfer benchmark on that layout

Defaults come from the same configuration the engines read (``kvconnect.config``):
``--url`` from KVCONNECT_SERVER_URL (else ipc:///tmp/kvconnect.sock), ``--size-gb`` from
LMCACHE_MAX_LOCAL_CPU_SIZE, ``--chunk-size`` from LMCACHE_CHUNK_SIZE, the token from
KVCONNECT_SERVER_TOKEN or ``--token-file`` (``--token`` works too but shows in the process list).

Exit codes: 0 done; 1 the server did not answer (``info``); 2 bad input (a typed
KVConnectError, or a usage error from argparse), nothing done.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from ..config import Config
from ..errors import KVConnectError
from . import bench, inspect, serve

DEFAULT_URL = serve.DEFAULT_URL


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        config = Config.from_env()
    except KVConnectError as exc:
        print(f"kvconnect: {exc}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="kvconnect", description="kvconnect: KV-cache offload for LLM serving engines")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"server": serve, "info": serve, "inspect": inspect, "bench": bench}
    serve.add_parsers(sub, config)
    inspect.add_parser(sub, config)
    bench.add_parser(sub, config)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    try:
        return commands[args.command].run(args, config)
    except KVConnectError as exc:
        print(f"kvconnect {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvconnect inspect --json | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not fail again
        return 141  # what a shell reports for a writer killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
