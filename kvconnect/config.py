"""Configuration: the one module that reads the environment.

Follows LMCache's names so users can switch without relearning. Precedence, lowest to
highest: defaults, the YAML file named by ``LMCACHE_CONFIG_FILE``, ``LMCACHE_*`` /
``KVCONNECT_*`` environment variables. Adapters may pass the same keys (YAML spelling) as
a mapping, e.g. vLLM's ``kv_connector_extra_config``, through ``Config.from_dict``.

| environment variable           | YAML key             | type  | default | meaning |
|--------------------------------|----------------------|-------|---------|---------|
| LMCACHE_CHUNK_SIZE             | chunk_size           | int   | 256     | tokens per chunk |
| LMCACHE_LOCAL_CPU              | local_cpu            | bool  | true    | keep a CPU pool |
| LMCACHE_MAX_LOCAL_CPU_SIZE     | max_local_cpu_size   | float | 5.0     | CPU pool size, GB |
| LMCACHE_LOCAL_DISK             | local_disk           | str   | none    | disk tier directory (``file://`` optional) |
| LMCACHE_MAX_LOCAL_DISK_SIZE    | max_local_disk_size  | float | 0.0     | disk tier size, GB |
| KVCONNECT_LOCAL_DISK_FSYNC     | local_disk_fsync     | bool  | false   | fsync each disk-tier file before its rename (survives power loss) |
| LMCACHE_REMOTE_URL             | remote_url           | str   | none    | remote tier (``redis://``, ``rediss://``, ``unix://``, ``redis-cluster://``, or ``mooncakestore://HOST:PORT``: a Mooncake master) |
| MOONCAKE_CONFIG_PATH           | mooncake_config_path | str   | none    | Mooncake client settings (JSON, Mooncake's own keys; kvconnect/storage/mooncake_config.py) |
| LMCACHE_SAVE_UNFULL_CHUNK      | save_unfull_chunk    | bool  | false   | also store a prompt's partial last chunk |
| LMCACHE_SAVE_DECODE_CACHE      | save_decode_cache    | bool  | false   | engine adapters also store the chunks generated tokens complete |
| KVCONNECT_NUM_THREADS          | num_threads          | int   | min(8, cpus) | CPU kernel threads |
| KVCONNECT_MODEL_NAME           | model_name           | str   | ""      | folded into the layout fingerprint |
| KVCONNECT_REMOTE_TIMEOUT_S     | remote_timeout_s     | float | 1.0     | bound on every remote-tier call |
| KVCONNECT_SERVER_URL           | server_url           | str   | none    | node-level cache server (``ipc://`` or loopback ``tcp://``) |
| KVCONNECT_SERVER_TOKEN         | server_token         | str   | none    | shared secret for the cache server |
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
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import ConfigError

logger = logging.getLogger(__name__)

GB = 1 << 30
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
CUDA_TRANSFERS = ("kernel", "staged")  # kvconnect.transfer.cuda.route_tuning
TRANSFER_ROUTES = ("auto", "compiled", "triton", "torch")  # kvconnect.transfer.route_backend
EVICTION_POLICIES = ("s3fifo", "arc", "2q", "lru")  # kvconnect.storage.eviction.POLICIES


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True, kw_only=True)
class Config:
    chunk_size: int = 256
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
    restore_interval_tokens: int = 4096  # restore points (kvconnect/parts.py); 0: every chunk end

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size (LMCACHE_CHUNK_SIZE) must be > 0, got {self.chunk_size}")
        if self.max_local_cpu_size < 0:
            raise ConfigError(f"max_local_cpu_size (LMCACHE_MAX_LOCAL_CPU_SIZE) must be >= 0 GB, got {self.max_local_cpu_size}")
        if self.max_local_disk_size < 0:
            raise ConfigError(f"max_local_disk_size (LMCACHE_MAX_LOCAL_DISK_SIZE) must be >= 0 GB, got {self.max_local_disk_size}")
        if self.num_threads <= 0:
            raise ConfigError(f"num_threads (KVCONNECT_NUM_THREADS) must be > 0, got {self.num_threads}")
        if self.remote_timeout_s <= 0:
            raise ConfigError(f"remote_timeout_s (KVCONNECT_REMOTE_TIMEOUT_S) must be > 0, got {self.remote_timeout_s}")
        for name in ("metrics_port", "server_metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} (KVCONNECT_{name.upper()}) must be a port in 0..65535, got {getattr(self, name)}")
        if not self.metrics_host:
            raise ConfigError("metrics_host (KVCONNECT_METRICS_HOST) must not be empty")
        if self.cuda_transfer not in CUDA_TRANSFERS:
            raise ConfigError(f"cuda_transfer (KVCONNECT_CUDA_TRANSFER) must be one of {', '.join(CUDA_TRANSFERS)}, got {self.cuda_transfer!r}")
        if self.transfer_route not in TRANSFER_ROUTES:
            raise ConfigError(f"transfer_route (KVCONNECT_TRANSFER_ROUTE) must be one of {', '.join(TRANSFER_ROUTES)}, got {self.transfer_route!r}")
        if self.min_load_tokens < 0:
            raise ConfigError(f"min_load_tokens (KVCONNECT_MIN_LOAD_TOKENS) must be >= 0, got {self.min_load_tokens}")
        if self.pd_wait_timeout_s < 0:
            raise ConfigError(f"pd_wait_timeout_s (KVCONNECT_PD_WAIT_TIMEOUT_S) must be >= 0, got {self.pd_wait_timeout_s}")
        if self.pd_poll_interval_s < 0:
            raise ConfigError(f"pd_poll_interval_s (KVCONNECT_PD_POLL_INTERVAL_S) must be >= 0, got {self.pd_poll_interval_s}")
        if self.log_interval_s < 0:
            raise ConfigError(f"log_interval_s (KVCONNECT_LOG_INTERVAL_S) must be >= 0, got {self.log_interval_s}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction (KVCONNECT_EVICTION) must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.restore_interval_tokens < 0:
            raise ConfigError(f"restore_interval_tokens (KVCONNECT_RESTORE_INTERVAL_TOKENS) must be >= 0, got {self.restore_interval_tokens}")
        if self.local_disk is not None and self.local_disk.startswith("file://"):
            object.__setattr__(self, "local_disk", self.local_disk[len("file://") :])

    @property
    def effective_min_load_tokens(self) -> int:
        return self.min_load_tokens or self.chunk_size

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GB)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config", base: Optional["Config"] = None) -> "Config":
        """A Config from YAML-spelled keys; unknown keys are logged and ignored (LMCache files carry many)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        updates: dict[str, Any] = {}
        for key, raw in values.items():
            name = key.lower().removeprefix("lmcache_").removeprefix("kvconnect_")
            if name not in fields:
                logger.warning("kvconnect: ignoring unknown config key %r from %s", key, source)
                continue
            updates[name] = _parse(name, raw, fields[name], f"{key} ({source})")
        return dataclasses.replace(base or cls(), **updates)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        env = os.environ if environ is None else environ
        config = cls()
        path = env.get("LMCACHE_CONFIG_FILE")
        if path:
            config = cls.from_dict(_read_yaml(path), source=path, base=config)
        names = {f.name for f in dataclasses.fields(cls)}
        overrides = {
            var: value
            for var, value in env.items()
            if var.startswith(("LMCACHE_", "KVCONNECT_")) and var != "LMCACHE_CONFIG_FILE"
            and var.lower().removeprefix("lmcache_").removeprefix("kvconnect_") in names
        }
        if env.get("MOONCAKE_CONFIG_PATH"):  # Mooncake's own variable, read as its integrations read it
            overrides["mooncake_config_path"] = env["MOONCAKE_CONFIG_PATH"]
        return cls.from_dict(overrides, source="environment", base=config) if overrides else config


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


def _parse(name: str, raw: Any, field: dataclasses.Field, where: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if raw is None:
        if "Optional" in kind:
            return None
        raise ConfigError(f"{where}: a value is required")
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"not a boolean: {raw!r}")
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


ENGINE_OPENMP_BINDING_VARS = ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def engine_openmp_binding() -> Mapping[str, str]:
    """The OpenMP thread binding the serving engine's launcher set for this process (vLLM CPU
    derives it from ``VLLM_CPU_OMP_THREADS_BIND``). Not kvconnect's configuration: a fact about
    the engine that ``kvconnect.transfer.placement`` places copy threads around."""
    return {name: os.environ[name] for name in ENGINE_OPENMP_BINDING_VARS if name in os.environ}
