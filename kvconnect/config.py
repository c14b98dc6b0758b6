"""Configuration: the one module that reads the environment.

Follows LMCache's names so users can switch without relearning. Precedence, lowest to
highest: defaults, the YAML file named by ``LMCACHE_CONFIG_FILE``, ``LMCACHE_*`` /
``KVCONNECT_*`` environment variables. Adapters may pass the same keys (YAML spelling) as
a mapping, e.g. vLLM's ``kv_connector_extra_config``, through ``Config.from_dict``.

| environment variable           | YAML key             | type  | default | meaning |
|--------------------------------|----------------------|-------|---------|---------|
| LMCACHE_CHUNK_SIZE             | chunk_size           | int   | 0       | tokens per chunk; 0 (unset): chosen from the layout, 256 wherever 256 fits (kvconnect/layout/chunk_size.py) |
| LMCACHE_LOCAL_CPU              | local_cpu            | bool  | true    | keep a CPU pool |
| LMCACHE_MAX_LOCAL_CPU_SIZE     | max_local_cpu_size   | float | 5.0     | CPU pool size, GB |
| LMCACHE_LOCAL_DISK             | local_disk           | str   | none    | disk tier directory (``file://`` optional) |
| LMCACHE_MAX_LOCAL_DISK_SIZE    | max_local_disk_size  | float | 0.0     | disk tier size, GB |
| KVCONNECT_LOCAL_DISK_FSYNC     | local_disk_fsync     | bool  | false   | fsync each disk-tier file before its rename (survives power loss) |
| LMCACHE_REMOTE_URL             | remote_url           | str   | none    | remote tier (``redis://``, ``rediss://``, ``unix://``, ``redis-cluster://``, or ``mooncakestore://HOST:PORT``: a Mooncake master) |
| MOONCAKE_CONFIG_PATH           | mooncake_config_path | str   | none    | Mooncake client settings (JSON, Mooncake's own keys; kvconnect/storage/mooncake/config.py) |
| LMCACHE_SAVE_UNFULL_CHUNK      | save_unfull_chunk    | bool  | false   | also store a prompt's partial last chunk |
| LMCACHE_SAVE_DECODE_CACHE      | save_decode_cache    | bool  | false   | engine adapters also store the chunks generated tokens complete |
| KVCONNECT_NUM_THREADS          | num_threads          | int   | min(8, cpus) | CPU kernel threads |
| KVCONNECT_MODEL_NAME           | model_name           | str   | ""      | the model's identity (name@revision), folded into the layout fingerprint; required with a shared tier (remote_url, server_url) unless the layout is named |
| KVCONNECT_REMOTE_TIMEOUT_S     | remote_timeout_s     | float | 1.0     | bound on every remote-tier call (>= 0.001; below 0.05 a warning: most calls will miss) |
| KVCONNECT_SERVER_URL           | server_url           | str   | none    | node-level cache server (``ipc://`` or loopback ``tcp://``) |
| KVCONNECT_SERVER_TOKEN         | server_token         | str   | none    | shared secret for the cache server |
| KVCONNECT_LOOKUP_TOKEN         | lookup_token         | str   | none    | vLLM: shared secret of the scheduler <-> worker lookup channel; required for a ``tcp://`` ``lookup_url`` (docs/vllm.md, "Lookup channel") |
| KVCONNECT_CUDA_TRANSFER        | cuda_transfer        | str   | kernel  | CUDA route: ``kernel`` (zero-copy) or ``staged`` (device ring + copy engines; docs/gpu.md) |
| KVCONNECT_TRANSFER_ROUTE       | transfer_route       | str   | auto    | transfer backend for any device: ``auto`` (per device, docs/gpu.md), ``compiled`` (the CPU/CUDA kernel; CUDA's variant from KVCONNECT_CUDA_TRANSFER), ``triton``, ``torch`` |
| KVCONNECT_METRICS_PORT         | metrics_port         | int   | 0       | Prometheus exporter port of an engine's process (0: off; docs/operations.md) |
| KVCONNECT_METRICS_HOST         | metrics_host         | str   | 127.0.0.1 | exporter address (loopback; another address exposes the figures to the network) |
| KVCONNECT_SERVER_METRICS_PORT  | server_metrics_port  | int   | 0       | Prometheus exporter port of ``kvconnect server`` (0: off) |
| KVCONNECT_EVICTION             | eviction             | str   | s3fifo  | CPU pool eviction policy: ``s3fifo``, ``arc``, ``2q`` or ``lru`` (kvconnect/storage/eviction.py) |
| KVCONNECT_MIN_LOAD_TOKENS      | min_load_tokens      | int   | 0       | engine adapters do not report a hit that loads fewer tokens beyond the engine's own prefix cache; 0: one chunk (chunk_size); 1: every hit (docs/vllm.md, "Small loads") |
| KVCONNECT_LOG_INTERVAL_S       | log_interval_s       | float | 60.0    | engine adapters log a hit / save summary at most this often (0: never) |
| KVCONNECT_POOL_PREFAULT        | pool_prefault        | bool  | true    | map the CPU pool's pages in the background after allocation, so stores do not pay first-touch page faults (kvconnect/storage/host_memory.py) |
| KVCONNECT_PD_WAIT_TIMEOUT_S    | pd_wait_timeout_s    | float | 5.0     | P/D decode side: how long a request whose prefill a producer names waits for its chunks in the shared tier before it is recomputed (docs/vllm.md, "Prefill/decode disaggregation") |
| KVCONNECT_PD_POLL_INTERVAL_S   | pd_poll_interval_s   | float | 0.005   | P/D decode side: at most one shared-tier lookup per waiting request per this interval |
| KVCONNECT_RESTORE_INTERVAL_TOKENS | restore_interval_tokens | int | 4096 | hybrid layouts: also keep window/state rows (the window part) every this many tokens of a stored prompt, besides its end and branch points (the first chunk end at or past each multiple); 0: at every chunk end (docs/design.md, "Restore points") |
| KVCONNECT_READ_TP_SIZES        | read_tp_sizes        | str   | 1,2,4,8 | head-sharded KV (GQA/MHA) and Gated DeltaNet state pages: on a miss, also read chunks that ranks of these other TP sizes wrote, cutting this rank's heads and state ranges out of theirs (comma-separated; empty: off; docs/design.md, "The identity of a chunk") |
| KVCONNECT_STEP_END_WINDOW_PARTS | step_end_window_parts | bool | false | hybrid layouts: also keep the window part where an engine's prefill step ends (vLLM's chunked prefill), first evicted: it serves a request that diverges exactly there while it lives, at one window part per step (docs/performance.md, "Through vLLM") |
| KVCONNECT_SKIP_LAST_N_TOKENS   | skip_last_n_tokens   | int   | 0       | vLLM adapter: the lookup leaves a request's last N prompt tokens out, so a hit never covers them (LMCache's vLLM key of the same name) |
| KVCONNECT_VERIFY_RATE          | verify_rate          | float | 0.0     | vLLM adapter: the fraction (0..1) of lookups that would hit which serve no hit; the engine computes the prefix and its fresh rows are compared with the stored chunks (kvconnect/restore/verify.py, docs/operations.md "Restores verified in production"); 0: off |
| KVCONNECT_VERIFY_FIRST         | verify_first         | int   | -1      | vLLM adapter: after start, every hit is verified until this many checks have passed (-1: 8 when verify_rate > 0, else 0) |

Every number is checked once (``check_number`` over ``NUMERIC_RANGES``): NaN, infinities
and values out of range are a ``ConfigError`` naming the setting. Values are parsed as
LMCache parses them, or refused with a ``ConfigError``: booleans are
``true``/``false``/``1``/``0`` (LMCache reads any other word, ``yes`` and ``on`` included, as
false: kvconnect refuses them); an environment value in matching quotes (``"1024"``) is
unquoted; ``local_disk`` may carry LMCache's comma-separated list when it names one
directory (several are refused: the disk tier has one). ``local_cpu: false`` means what it
means in LMCache: no CPU cache, the disk and remote tiers still work (the pool of
``max_local_cpu_size`` is then only the buffer they are written and read through).
LMCache's other names (``kvconnect/lmcache_names.py``, docs/migrating.md) are read where the
meaning maps (``min_retrieve_tokens``, ``cache_policy``, ``lookup_timeout_ms``,
``extra_config``) and otherwise warned about once, naming what kvconnect does instead, unless
the value is one under which LMCache does what kvconnect does (``enable_p2p: false``;
``lmcache_names.AS_KVCONNECT``): only a setting that changes behaviour is warned about.
LMCache's vLLM keys of ``kv_connector_extra_config`` (``lmcache.<key>``,
``discard_partial_chunks``, ``skip_last_n_tokens``) are read by ``Config.from_vllm_extra_config``.
Warnings are once per process; ``quiet=True`` reads without them (a vLLM worker: the scheduler
process reads the same settings and warns).

Variables kvconnect does not read but sets for a library it loads: when a Mooncake tier
connects, ``kvconnect/storage/mooncake/config.py`` gives Mooncake's native client its own
``MC_TCP_BIND_ADDRESS`` (loopback unless the master's host is an address), ``MC_LOG_LEVEL``
(WARNING) and ``MC_RPC_TIMEOUT_MS`` (from ``remote_timeout_s``), each only where the operator
has not set it (``os.environ.setdefault``): those are Mooncake's settings, not kvconnect's.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from . import lmcache_names
from .errors import ConfigError
from .throttled_warning import OnceWarnings

logger = logging.getLogger(__name__)

GB = 1 << 30
_TRUE = {"1", "true"}  # LMCache's _to_bool: these are true, every other word false
_FALSE = {"0", "false", ""}
CUDA_TRANSFERS = ("kernel", "staged")  # kvconnect.transfer.cuda.route_tuning
TRANSFER_ROUTES = ("auto", "compiled", "triton", "torch")  # kvconnect.transfer.dispatch.route_backend
EVICTION_POLICIES = ("s3fifo", "arc", "2q", "lru")  # kvconnect.storage.eviction.POLICIES

DEFAULT_VERIFY_FIRST = 8  # verify_first when unset and verify_rate > 0: the first hits after a start (a new engine release, a new layout) are all checked
MAX_SIZE_GB = float(1 << 20)  # 1 PiB: a size past it is a typo, never a host's memory or disk
MAX_TOKENS = 1 << 31
# A remote call cannot finish in less than a millisecond (1e-6 s once turned Mooncake into all
# misses without a word); under REMOTE_TIMEOUT_WARN_S it can, but rarely does on a loaded host.
REMOTE_TIMEOUT_FLOOR_S = 0.001
REMOTE_TIMEOUT_WARN_S = 0.05
# every numeric setting: (lowest, highest, lowest excluded). One check (``check_number``) reads
# this table, so no setting can be NaN, infinite, or out of range: NaN compares false with every
# bound, and a remote timeout of NaN once turned every shared-tier lookup off without an error.
NUMERIC_RANGES: dict[str, tuple[float, float, bool]] = {
    "chunk_size": (0, 1 << 20, False),  # 0: chosen from the layout
    "max_local_cpu_size": (0, MAX_SIZE_GB, False),
    "max_local_disk_size": (0, MAX_SIZE_GB, False),
    "num_threads": (0, 4096, True),
    "remote_timeout_s": (REMOTE_TIMEOUT_FLOOR_S, 3600, False),
    "metrics_port": (0, 65535, False),
    "server_metrics_port": (0, 65535, False),
    "log_interval_s": (0, 1e9, False),
    "min_load_tokens": (0, MAX_TOKENS, False),
    "pd_wait_timeout_s": (0, 3600, False),
    "pd_poll_interval_s": (0, 60, False),
    "restore_interval_tokens": (0, MAX_TOKENS, False),
    "skip_last_n_tokens": (0, MAX_TOKENS, False),
    "verify_rate": (0, 1, False),
    "verify_first": (-1, MAX_TOKENS, False),
}
_LMCACHE_NAMED = {"chunk_size", "max_local_cpu_size", "max_local_disk_size", "local_cpu", "local_disk", "remote_url",
                  "save_unfull_chunk", "save_decode_cache"}


def variable_of(name: str) -> str:
    """The environment variable of setting ``name`` (LMCache's name where it has one)."""
    return ("LMCACHE_" if name in _LMCACHE_NAMED else "KVCONNECT_") + name.upper()


def check_number(name: str, value: Any, *, low: float, high: float, low_open: bool = False) -> None:
    """ConfigError unless ``value`` is a finite number in range (``(low, high]`` with
    ``low_open``, else ``[low, high]``): the one validation of every numeric setting."""
    where = f"{name} ({variable_of(name)})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    if (value <= low if low_open else value < low) or value > high:
        bounds = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
        raise ConfigError(f"{where} must be {bounds}, got {value!r}")


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True, kw_only=True)
class Config:
    chunk_size: int = 0  # 0: chosen from the layout when an engine is built (layout/chunk_size.py)
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: Optional[str] = None
    max_local_disk_size: float = 0.0
    local_disk_fsync: bool = False
    remote_url: Optional[str] = None
    save_unfull_chunk: bool = False
    save_decode_cache: bool = False
    num_threads: int = dataclasses.field(default_factory=_default_threads)
    model_name: str = ""
    remote_timeout_s: float = 1.0
    server_url: Optional[str] = None
    server_token: Optional[str] = None
    lookup_token: Optional[str] = None
    cuda_transfer: str = "kernel"
    transfer_route: str = "auto"
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    server_metrics_port: int = 0
    eviction: str = "s3fifo"
    log_interval_s: float = 60.0
    min_load_tokens: int = 0  # 0: chunk_size (effective_min_load_tokens)
    pool_prefault: bool = True
    pd_wait_timeout_s: float = 5.0
    pd_poll_interval_s: float = 0.005
    mooncake_config_path: Optional[str] = None
    restore_interval_tokens: int = 4096  # restore points (kvconnect/restore/parts.py); 0: every chunk end
    step_end_window_parts: bool = False  # short-lived restore points at prefill step ends (restore/points.py)
    skip_last_n_tokens: int = 0  # vLLM adapter: lookups leave the prompt's last N tokens out (LMCache's vLLM key)
    read_tp_sizes: str = "1,2,4,8"  # other TP sizes whose head-sharded / range-split chunks a miss reads (restore/other_tp.py)
    verify_rate: float = 0.0  # vLLM adapter: share of would-be hits recomputed and compared (restore/verify.py); 0: off
    verify_first: int = -1  # checks that must pass after start before only verify_rate samples; -1: auto

    def __post_init__(self) -> None:
        for name, (low, high, low_open) in NUMERIC_RANGES.items():
            check_number(name, getattr(self, name), low=low, high=high, low_open=low_open)
        if self.remote_timeout_s < REMOTE_TIMEOUT_WARN_S and (self.remote_url or self.server_url):
            warn_once(f"remote_timeout_s:{self.remote_timeout_s}",
                      "kvconnect: KVCONNECT_REMOTE_TIMEOUT_S is %g s: a remote-tier or cache-server call slower than that "
                      "is a miss, and a Redis or Mooncake round trip on a loaded host often is; expect most remote "
                      "lookups to miss (the default is 1 s)", self.remote_timeout_s)
        if not self.metrics_host:
            raise ConfigError("metrics_host (KVCONNECT_METRICS_HOST) must not be empty")
        if self.cuda_transfer not in CUDA_TRANSFERS:
            raise ConfigError(f"cuda_transfer (KVCONNECT_CUDA_TRANSFER) must be one of {', '.join(CUDA_TRANSFERS)}, got {self.cuda_transfer!r}")
        if self.transfer_route not in TRANSFER_ROUTES:
            raise ConfigError(f"transfer_route (KVCONNECT_TRANSFER_ROUTE) must be one of {', '.join(TRANSFER_ROUTES)}, got {self.transfer_route!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction (KVCONNECT_EVICTION) must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.local_disk is not None:
            object.__setattr__(self, "local_disk", _one_disk_path(self.local_disk))
        _ = self.other_tp_sizes  # a list that is not TP sizes is refused here, at start

    @property
    def other_tp_sizes(self) -> tuple[int, ...]:
        """``read_tp_sizes`` as TP sizes, in the order given, each once."""
        out: list[int] = []
        for part in self.read_tp_sizes.split(","):
            part = part.strip()
            if not part:
                continue
            if not part.isdigit() or not 1 <= int(part) <= 4096:
                raise ConfigError(f"read_tp_sizes (KVCONNECT_READ_TP_SIZES) must list TP sizes from 1 to 4096 separated "
                                  f"by commas, got {self.read_tp_sizes!r}")
            if int(part) not in out:
                out.append(int(part))
        return tuple(out)

    @property
    def verify_first_checks(self) -> int:
        """How many passed checks the first hits after start must give before sampling takes over:
        ``verify_first``, or when it is -1 (unset) DEFAULT_VERIFY_FIRST with verification on, 0 with it off."""
        if self.verify_first >= 0:
            return self.verify_first
        return DEFAULT_VERIFY_FIRST if self.verify_rate > 0 else 0

    @property
    def effective_min_load_tokens(self) -> int:
        return self.min_load_tokens or self.chunk_size

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GB)

    @property
    def has_lower_tier(self) -> bool:
        """A disk tier (a directory and a size) or a remote tier is configured."""
        return bool(self.remote_url) or (bool(self.local_disk) and self.max_local_disk_bytes > 0)

    @property
    def private_pool_bytes(self) -> int:
        """Bytes of an engine's private CPU pool. Every chunk passes through it: with
        ``local_cpu`` false (LMCache: no CPU cache) it is only the buffer the disk and remote
        tiers are written and read through, and 0 when there is no such tier (nothing is kept
        anywhere, as in LMCache)."""
        return self.max_local_cpu_bytes if self.local_cpu or self.has_lower_tier else 0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config", base: Optional["Config"] = None,
                  environment: bool = False, quiet: bool = False) -> "Config":
        """A Config from YAML-spelled keys (``LMCACHE_``/``KVCONNECT_`` prefixes allowed).

        LMCache's names are read where the meaning maps (``lmcache_names.ALIASES``,
        ``extra_config``); every other name is warned about once, naming what kvconnect does
        instead (LMCache files carry many). A kvconnect key wins over an LMCache alias of it.
        ``environment``: values are environment strings, unquoted as LMCache unquotes them.
        ``quiet``: read without warnings (another process of the same engine warns).
        """
        warn = _quiet if quiet else warn_once
        fields = {f.name: f for f in dataclasses.fields(cls)}
        updates: dict[str, Any] = {}
        aliased: dict[str, Any] = {}
        for key, raw in values.items():
            name = _name_of(key, fields)
            if environment and isinstance(raw, str):
                raw = _unquote(raw)
            where = f"{key} ({source})"
            if name in fields and not _lmcache_meaning(key, name):
                updates[name] = _parse(name, raw, fields[name], where)
            elif name in lmcache_names.ALIASES:
                target = lmcache_names.ALIASES[name]
                value = _alias_value(name, raw, fields[target], where, warn)
                if value is not None:
                    aliased[target] = value
            elif name == "extra_config":
                _read_extra_config(raw, where, warn)
            elif not _as_kvconnect(name, raw):
                _warn_unknown(key, name, source, warn)
        return dataclasses.replace(base or cls(), **{**aliased, **updates})

    @classmethod
    def from_vllm_extra_config(cls, values: Mapping[str, Any], *, base: Optional["Config"] = None,
                               quiet: bool = False) -> "Config":
        """vLLM's ``kv_connector_extra_config`` read as LMCache's vLLM connector reads it
        (LMCache 0.5.6, lmcache/integration/vllm/vllm_v1_adapter.py), over ``base``:

        - ``lmcache.<key>``: LMCache's configuration key ``<key>`` (``lmcache.max_local_cpu_size``),
          read as that key is read anywhere, over the file and the environment. A key LMCache's
          configuration does not have is warned about (LMCache warns and ignores it). The same
          setting given twice (``chunk_size`` and ``lmcache.chunk_size``) with two values is refused.
        - ``discard_partial_chunks``: true stores no partial last chunk, whatever ``save_unfull_chunk``
          says (LMCache: ``discard_partial_chunks or not save_unfull_chunk``); false changes nothing.
        - ``skip_last_n_tokens``: kvconnect's setting of the same name and meaning.
        - LMCache's other vLLM keys (``lmcache.mp.*``, ``lmcache.max_tokens_per_load``, ...): warned
          about with what kvconnect does instead, unless set to what kvconnect does.
        - any other key: as ``from_dict`` reads it (kvconnect's settings, LMCache's names).
        """
        warn = _quiet if quiet else warn_once
        source = "kv_connector_extra_config"
        plain: dict[str, Any] = {}
        given: dict[str, tuple[str, Any]] = {}  # setting name -> (the key that gave it, value)
        discard = False  # skip_last_n_tokens, LMCache's other VLLM_READ key, is kvconnect's setting of that name
        for given_key, raw in values.items():
            key = given_key
            if key == "discard_partial_chunks":
                discard = raw is not None and _to_bool(raw, f"{key} ({source})")
                continue
            if key not in lmcache_names.VLLM_READ and lmcache_names.vllm_extra_config(key) is not None:
                if not _as_kvconnect(key, raw):
                    warn(f"vllm:{key}", "kvconnect: %s=%r (%s) is an LMCache vLLM setting kvconnect does not use: %s",
                         key, raw, source, lmcache_names.vllm_extra_config(key))
                continue
            elif key.startswith(lmcache_names.VLLM_CONFIG_PREFIX):
                name = key[len(lmcache_names.VLLM_CONFIG_PREFIX):]
                if lmcache_names.instead(name) is not None:  # LMCache's meaning, even where kvconnect has the name
                    if not _as_kvconnect(name, raw):
                        warn(f"name:{name}", "kvconnect: %s (%s) is an LMCache setting kvconnect does not use: %s",
                             key, source, lmcache_names.instead(name))
                    continue
                if not (name in lmcache_names.SAME or name in lmcache_names.ALIASES or name == "extra_config"):
                    warn(f"vllm:{key}", "kvconnect: ignoring %r (%s): LMCache's configuration has no key %r, so "
                         "LMCache ignores it too", key, source, name)
                    continue
                key = name
            setting = _name_of(key, {f.name: f for f in dataclasses.fields(cls)})
            if setting in given and given[setting][1] != raw:
                first, value = given[setting]
                raise ConfigError(f"{source}: {first}={value!r} and {given_key}={raw!r} both set {setting!r}: keep one")
            given[setting] = (given_key, raw)
            plain[key] = raw
        config = cls.from_dict(plain, source=source, base=base, quiet=quiet)
        return dataclasses.replace(config, save_unfull_chunk=False) if discard else config

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, *, quiet: bool = False) -> "Config":
        """Defaults, then the YAML file of ``LMCACHE_CONFIG_FILE``, then ``LMCACHE_*`` /
        ``KVCONNECT_*`` variables (and Mooncake's ``MOONCAKE_CONFIG_PATH``). ``quiet``: as in
        ``from_dict``."""
        env = os.environ if environ is None else environ
        config = cls()
        path = env.get("LMCACHE_CONFIG_FILE")
        if path:
            config = cls.from_dict(_read_yaml(path), source=path, base=config, quiet=quiet)
        overrides = {
            var: value for var, value in env.items()
            if var.startswith(("LMCACHE_", "KVCONNECT_")) and var not in lmcache_names.NOT_SETTINGS
        }
        if env.get("MOONCAKE_CONFIG_PATH"):  # Mooncake's own variable, read as its integrations read it
            overrides["mooncake_config_path"] = env["MOONCAKE_CONFIG_PATH"]
        if not overrides:
            return config
        return cls.from_dict(overrides, source="environment", base=config, environment=True, quiet=quiet)


warn_once = OnceWarnings(logger.warning).warn  # (topic, message, *args): each topic once per process


def _quiet(topic: str, message: str, *args: Any) -> None:
    """``warn_once``'s shape, saying nothing (``quiet=True``)."""


def _canonical(raw: Any) -> Any:
    """A value as ``AS_KVCONNECT`` holds it: booleans and numbers as such, words in lower case."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    try:
        return float(text)
    except ValueError:
        return text


def _as_kvconnect(name: str, raw: Any) -> bool:
    """LMCache's ``name`` set to ``raw`` does what kvconnect does anyway (or sets nothing): no warning."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return True
    return _canonical(raw) in lmcache_names.AS_KVCONNECT.get(name, ())


def _warn_unknown(key: str, name: str, source: str, warn_once: Callable[..., None]) -> None:
    text = lmcache_names.instead_of_variable(key) if source == "environment" else lmcache_names.instead(name)
    if text is not None:
        warn_once(f"name:{key}", "kvconnect: %s (%s) is an LMCache setting kvconnect does not use: %s", key, source, text)
        return
    known = [f.name for f in dataclasses.fields(Config)] + list(lmcache_names.ALIASES) + ["extra_config"]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    warn_once(f"name:{key}", "kvconnect: ignoring %r (%s): neither a kvconnect setting nor an LMCache (%s) one%s",
              key, source, lmcache_names.LMCACHE_RELEASES_TEXT, hint)


def _name_of(key: str, fields: Mapping[str, Any]) -> str:
    """``key`` without its ``LMCACHE_`` / ``KVCONNECT_`` prefix, unless the name itself starts with
    ``lmcache_`` (LMCache's YAML ``lmcache_instance_id``, ``lmcache_worker_ports``, ...)."""
    lower = key.lower()
    stripped = lower.removeprefix("lmcache_").removeprefix("kvconnect_")
    known = (lambda n: n in fields or n in lmcache_names.ALIASES or n == "extra_config"
             or lmcache_names.instead(n) is not None)
    return lower if not known(stripped) and known(lower) else stripped


def _lmcache_meaning(key: str, name: str) -> bool:
    """True for an ``LMCACHE_`` name LMCache gives another meaning than kvconnect's setting of the
    same name (``LMCACHE_SERVER_URL``: LMCache's own server, not kvconnect's node server)."""
    return key.lower().startswith("lmcache_") and name not in lmcache_names.SAME and lmcache_names.instead(name) is not None


def _unquote(text: str) -> str:
    """LMCache's ``_parse_quoted_string``: a value in matching quotes loses them (escapes read)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            value = ast.literal_eval(text)  # a string literal only; never evaluates code
        except (ValueError, SyntaxError):
            return text[1:-1]
        return value if isinstance(value, str) else text[1:-1]
    return text


def _one_disk_path(value: str) -> Optional[str]:
    """LMCache's ``local_disk``: one path or comma-separated paths, each optionally ``file://``.
    kvconnect's disk tier has one directory: several are refused, not silently merged."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    paths = [p[len("file://"):] if p.startswith("file://") else p for p in parts]
    if len(paths) > 1:
        raise ConfigError(
            f"local_disk (LMCACHE_LOCAL_DISK) names {len(paths)} directories {paths}: kvconnect's disk tier uses one "
            "directory (LMCache spreads chunks over several); give one directory, e.g. a volume striped over the disks"
        )
    return paths[0] if paths else None


def _alias_value(name: str, raw: Any, target: dataclasses.Field, where: str, warn_once: Callable[..., None]) -> Any:
    """The kvconnect value an LMCache alias means, or None (warned) where it has none."""
    if name == "min_retrieve_tokens":
        tokens = _parse(target.name, raw, target, where)
        if tokens < 0:
            raise ConfigError(f"{where}: must be >= 0, got {tokens}")
        return tokens or 1  # LMCache's 0 is "no minimum": every hit loads
    if name == "lookup_timeout_ms":
        ms = _parse(target.name, raw, target, where)
        if ms <= 0:
            raise ConfigError(f"{where}: must be > 0 ms, got {raw!r}")
        return ms / 1000.0
    if name == "cache_policy":
        policy = str(raw).strip().lower()
        if policy in EVICTION_POLICIES:
            return policy
        warn_once(f"alias:{where}", "kvconnect: %s=%r has no kvconnect policy (kvconnect has %s); the CPU pool uses "
                  "KVCONNECT_EVICTION (default s3fifo)", where, raw, ", ".join(EVICTION_POLICIES))
        return None
    raise AssertionError(name)  # every ALIASES entry is converted above


def _read_extra_config(raw: Any, where: str, warn_once: Callable[..., None]) -> None:
    """LMCache's ``extra_config`` (a mapping, or JSON in ``LMCACHE_EXTRA_CONFIG``): each key is
    read and its kvconnect meaning logged once; a malformed value is refused."""
    if raw is None or raw == "":
        return
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not a JSON object: {exc}") from exc
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a mapping of keys (a JSON object), got {type(raw).__name__}")
    for key, value in raw.items():
        if _as_kvconnect(key, value):
            continue
        text = lmcache_names.extra_config(key)
        warn_once(f"extra:{key}", "kvconnect: extra_config %s=%r (%s): %s", key, value, where, text)


def _read_yaml(path: str) -> Mapping[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"LMCACHE_CONFIG_FILE={path!r} cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"LMCACHE_CONFIG_FILE={path!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"LMCACHE_CONFIG_FILE={path!r} must hold a mapping of keys, got {type(data).__name__}")
    return data


def _to_bool(raw: Any, where: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{where}: not a boolean: {raw!r}; write true or false (or 1 or 0): LMCache reads any other "
                      "word, 'yes' and 'on' included, as false, so kvconnect refuses it rather than guess")


def _parse(name: str, raw: Any, field: dataclasses.Field, where: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if raw is None:
        if "Optional" in kind:
            return None
        raise ConfigError(f"{where}: a value is required")
    try:
        if kind == "bool":
            return _to_bool(raw, where)
        if kind == "int":
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(f"not an integer: {raw!r}")
            return int(str(raw).strip()) if not isinstance(raw, (int, float)) else int(raw)
        if kind == "float":
            return float(raw)
        text = str(raw).strip()
        return (text or None) if "Optional" in kind else text
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


ENGINE_OPENMP_BINDING_VARS = ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND")


def engine_openmp_binding() -> Mapping[str, str]:
    """The OpenMP thread binding the serving engine's launcher set for this process (vLLM CPU
    derives it from ``VLLM_CPU_OMP_THREADS_BIND``, which names every rank's cores of one serve,
    ``|``-separated, and is passed here too). Not kvconnect's configuration: a fact about the
    engine that ``kvconnect.transfer.placement`` places copy threads around."""
    return {name: os.environ[name] for name in ENGINE_OPENMP_BINDING_VARS if name in os.environ}
