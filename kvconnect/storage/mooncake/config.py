"""How kvconnect reaches a Mooncake Store: the master URL, the client settings, the import.

``LMCACHE_REMOTE_URL=mooncakestore://HOST:PORT`` names the master (LMCache's scheme). The
other client settings come from the JSON file named by ``MOONCAKE_CONFIG_PATH`` (read by
``kvconnect/config.py``; the path arrives here as ``Config.mooncake_config_path``), with the
keys Mooncake's own integrations read:

| JSON key              | default        | meaning |
|-----------------------|----------------|---------|
| local_hostname        | 127.0.0.1      | address other clients reach this one at (its transfer engine binds it) |
| metadata_server       | P2PHANDSHAKE   | Mooncake metadata service; P2PHANDSHAKE needs none |
| protocol              | tcp            | ``tcp``, ``rdma`` or ``ascend`` (the transfer engine's transport) |
| device_name           | ""             | RDMA / Ascend devices, e.g. ``mlx5_0,mlx5_1`` (empty for tcp) |
| global_segment_size   | see below      | bytes this process contributes to the store (its *segment*) |
| local_buffer_size     | 0              | Mooncake's own staging buffer; kvconnect moves chunks zero-copy and needs none |
| master_server_address | from the URL   | ignored when the URL names the master (the URL wins) |

Sizes may be integers (bytes) or strings such as ``"4 GB"`` / ``"512MB"`` (as Mooncake's
files spell them).

Who contributes memory (docs/storage.md, "Mooncake"): an engine process contributes
``global_segment_size`` when the file gives it; without it, an engine contributes
``DEFAULT_SEGMENT_BYTES`` when it has no node server, and nothing when it uses one
(``server_url`` set): the node's ``kvconnect server`` is then the holder, so engine restarts
do not erase the node's cache.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ...throttled_warning import RepeatingWarning
from ...errors import ConfigError, StorageError
from ..host_memory import check_fits_host

SCHEME = "mooncakestore"
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: a size past it is a typo, never a host's memory
DEFAULT_SEGMENT_BYTES = 1 << 30
PROTOCOLS = ("tcp", "rdma", "ascend")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


@dataclass(frozen=True, kw_only=True)
class MooncakeSpec:
    """Everything ``MooncakeDistributedStore.setup`` takes, validated."""

    master_address: str  # host:port of mooncake_master
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_bytes: int = DEFAULT_SEGMENT_BYTES
    local_buffer_bytes: int = 0

    def with_segment(self, segment_bytes: int) -> "MooncakeSpec":
        import dataclasses

        return dataclasses.replace(self, global_segment_bytes=segment_bytes)


def is_mooncake_url(url: Optional[str]) -> bool:
    return bool(url) and url.lower().startswith(SCHEME + "://")


def parse_master(url: str) -> str:
    """``host:port`` of a ``mooncakestore://host:port`` URL; ConfigError otherwise."""
    rest = url.partition("://")[2].rstrip("/")
    host, colon, port = rest.rpartition(":")
    if not is_mooncake_url(url) or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
        raise ConfigError(f"remote_url (LMCACHE_REMOTE_URL) {url!r}: expected mooncakestore://HOST:PORT (the master)")
    return f"{host}:{port}"


def parse_bytes(value: Any, what: str) -> int:
    """Bytes from an int or a string like ``"4 GB"``; ConfigError when neither."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, (int, float)) and value >= 0:
        number, unit = value, 1
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{what}: expected a size such as 4294967296 or '4 GB', got {value!r}")
        number, unit = float(m.group(1)), _UNITS[m.group(2).lower()]
    if not math.isfinite(number) or number * unit > MAX_SIZE_BYTES:
        raise ConfigError(f"{what}: {value!r} is beyond any host (at most {MAX_SIZE_BYTES >> 40} TiB); "
                          "give the bytes this process should use, e.g. '4 GB'")
    return int(number * unit)


def master_listening(address: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at the master's ``host:port``.

    Probed before ``setup``: with no master, Mooncake's setup retries for ~90 s and does not
    notice a master that starts meanwhile; a probe first lets a client join within its
    retry pause of the master's start.
    """
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


MIN_RPC_TIMEOUT_S = 0.5  # floor of the RPC bound kvconnect gives Mooncake (MC_RPC_TIMEOUT_MS)
PROBE_EVERY_S = 0.5  # how often a client looks for an absent master
SETUP_RETRY_S = (1.0, 30.0)  # pause after a failed setup, doubling up to the second figure


def connect_store(spec: MooncakeSpec, store_cls, wait_stop, log, on_setup=None) -> Optional[Any]:
    """A set-up store, or None when ``wait_stop(seconds)`` (waits, True = give up) says stop.

    Runs on a background thread: probes the master until it listens, then calls ``setup``
    (which blocks while it registers this client and mounts its segment); a failed setup is
    retried after a growing pause. ``log`` is told about each failed setup; ``on_setup(True)``
    / ``on_setup(False)`` mark a ``setup`` call starting (the master answered the probe) and failing.
    """
    pause = SETUP_RETRY_S[0]
    absent = RepeatingWarning(log)  # an absent master must not look like a cache that never hits
    while True:
        if not master_listening(spec.master_address):
            absent.failed(f"kvconnect: no Mooncake master listens at {spec.master_address} (LMCACHE_REMOTE_URL); "
                          "the Mooncake tier misses until one does (start mooncake_master, or fix the address)")
            if wait_stop(PROBE_EVERY_S):
                return None
            continue
        absent.cleared()
        store = store_cls()
        if on_setup is not None:
            on_setup(True)
        try:
            rc = store.setup(spec.local_hostname, spec.metadata_server, spec.global_segment_bytes,
                             spec.local_buffer_bytes, spec.protocol, spec.device_name, spec.master_address)
        except Exception as exc:  # arguments the binding refuses
            rc = f"{type(exc).__name__}: {exc}"
        if rc == 0:
            return store  # the caller ends the setup phase once it has adopted the store
        if on_setup is not None:
            on_setup(False)
        log(f"kvconnect: Mooncake setup with master {spec.master_address} returned {rc}; retrying in {pause:.0f} s")
        if wait_stop(pause):
            return None
        pause = min(SETUP_RETRY_S[1], pause * 2)


def read_config_file(path: Optional[str]) -> Mapping[str, Any]:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"MOONCAKE_CONFIG_PATH={path!r} cannot be read: {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"MOONCAKE_CONFIG_PATH={path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"MOONCAKE_CONFIG_PATH={path!r} must hold a JSON object")
    return data


def make_spec(url: str, config_path: Optional[str], *, has_node_server: bool) -> MooncakeSpec:
    """The client settings for ``url`` plus the file at ``config_path``; ConfigError when bad."""
    master = parse_master(url)
    data = read_config_file(config_path)
    where = f"MOONCAKE_CONFIG_PATH={config_path!r}"
    protocol = str(data.get("protocol", "tcp")).lower()
    if protocol not in PROTOCOLS:
        raise ConfigError(f"{where}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if "global_segment_size" in data:
        segment = parse_bytes(data["global_segment_size"], f"{where}: global_segment_size")
        check_fits_host(segment, f"{where}: global_segment_size = {data['global_segment_size']!r}")
    else:
        segment = 0 if has_node_server else DEFAULT_SEGMENT_BYTES
    local_buffer = parse_bytes(data.get("local_buffer_size", 0), f"{where}: local_buffer_size")
    # Mooncake allocates its staging buffer at setup and retries std::bad_alloc forever when the
    # host cannot give it: refuse what never fits, alone and together with the segment
    check_fits_host(local_buffer, f"{where}: local_buffer_size = {data.get('local_buffer_size')!r}")
    check_fits_host(segment + local_buffer, f"{where}: global_segment_size + local_buffer_size")
    local_hostname = str(data.get("local_hostname", "127.0.0.1")) or "127.0.0.1"
    return MooncakeSpec(
        master_address=master,
        local_hostname=local_hostname,
        metadata_server=str(data.get("metadata_server", "P2PHANDSHAKE")),
        protocol=protocol,
        device_name=str(data.get("device_name", "")),
        global_segment_bytes=segment,
        local_buffer_bytes=local_buffer,
    )


def import_store(spec: Optional[MooncakeSpec] = None, *, rpc_timeout_s: Optional[float] = None):
    """``mooncake.store.MooncakeDistributedStore``; StorageError saying how to install it.

    ``rpc_timeout_s`` bounds each of the client's RPCs to the master (see
    ``_bind_transfer_engine``); None leaves Mooncake's default (30 s).
    """
    _bind_transfer_engine(spec, rpc_timeout_s)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:  # also raised when libibverbs1 is missing
        raise StorageError(
            "the Mooncake tier (mooncakestore://) needs Mooncake: apt-get install libibverbs1 && "
            f"pip install mooncake-transfer-engine-non-cuda (or the CUDA build) [{exc}]"
        ) from exc
    return MooncakeDistributedStore


def _bind_transfer_engine(spec: Optional[MooncakeSpec], rpc_timeout_s: Optional[float] = None) -> None:
    """Bind Mooncake's TCP listener to ``local_hostname`` unless the operator chose an address.

    Mooncake's transfer engine reads ``MC_TCP_BIND_ADDRESS`` (its own variable, not
    kvconnect configuration) and binds every interface without it; kvconnect's network
    servers bind loopback by default, so the default here is the address peers are told to
    use (127.0.0.1 unless the Mooncake file names another). Set before the engine starts.
    """
    host = spec.local_hostname if spec is not None else "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        host = "127.0.0.1"  # a DNS name: bind loopback unless MC_TCP_BIND_ADDRESS says otherwise
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    if rpc_timeout_s is not None:
        # Mooncake waits 30 s for a master that stopped answering, then returns -901; an
        # engine's step must not: each RPC is bounded by the tier's remote_timeout_s (at
        # least MIN_RPC_TIMEOUT_S, so a loaded master is not taken for a dead one). Read by
        # Mooncake when a client is created: the first tier of a process sets it.
        timeout_ms = int(max(MIN_RPC_TIMEOUT_S, rpc_timeout_s) * 1000)
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(timeout_ms))

