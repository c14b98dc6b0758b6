"""LMCache's and LMCache-Ascend's configuration names, and what kvconnect does with each.

Data only: ``kvconnect.config`` (the one module that reads the environment) consults it to
read a name, map it, or warn once that kvconnect ignores it and what it does instead.
``docs/migrating.md`` is the same table for people; ``tests/test_lmcache_names.py`` checks
that every name of each LMCache release in ``LMCACHE_RELEASES`` (its config module, read as
data) is here and in that document, so a new LMCache key is a failing test rather than a
silent gap.

Kinds of names:
- ``SAME``: the kvconnect setting of the same name, same meaning and unit.
- ``ALIASES``: an LMCache name read into a kvconnect setting of another name (the value is
  converted where units differ; ``kvconnect.config`` does the conversion).
- ``INSTEAD``: names kvconnect ignores, each with what kvconnect does instead (warned once).
- ``EXTRA_CONFIG``: keys of LMCache's ``extra_config`` mapping (``LMCACHE_EXTRA_CONFIG``);
  ``EXTRA_CONFIG_PREFIXES``: families of them read by prefix.
- ``ENV_PREFIXES``: families of variables read by prefix.
- ``AS_KVCONNECT``: values of ignored names under which LMCache does what kvconnect does: a
  name set to one of them (or left empty) is read without a warning.
- ``VLLM_*``: keys LMCache's vLLM connectors read from vLLM's ``kv_connector_extra_config``
  (``lmcache.<key>``: LMCache's configuration key ``<key>``; ``discard_partial_chunks`` and
  ``skip_last_n_tokens``, read with their meaning by ``Config.from_vllm_extra_config``).
"""

from __future__ import annotations

from typing import Optional

# 0.4.5: the release LMCache-Ascend's DeepSeek V4 connector (seed 003) runs on; 0.5.6: the newest on
# PyPI (2026-11), the one users bring configs from. Each has its list in tests/data/.
LMCACHE_RELEASES = ("0.4.5", "0.5.6")
LMCACHE_RELEASES_TEXT = " / ".join(LMCACHE_RELEASES)

SAME = (
    "chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
    "remote_url", "save_unfull_chunk", "save_decode_cache",
)

ALIASES = {
    "min_retrieve_tokens": "min_load_tokens",  # 0 (LMCache: off) reads as 1 (every hit)
    "cache_policy": "eviction",  # LRU -> lru; LMCache's FIFO/LFU/MRU have no kvconnect policy
    "lookup_timeout_ms": "remote_timeout_s",  # milliseconds -> seconds
}

# what the common cases say; each INSTEAD entry is one of these or its own sentence
_BLEND = "CacheBlend (reuse of non-prefix text) is not implemented: kvconnect reuses exact token prefixes only"
_SHARE = ("kvconnect has no controller, P2P or lookup server: instances share a cache through a shared tier "
          "(KVCONNECT_SERVER_URL on one node, LMCACHE_REMOTE_URL redis:// or mooncakestore:// across nodes; docs/storage.md)")
_PD = ("LMCache's PD backend is not used: kvconnect does prefill/decode disaggregation through vLLM's kv_role "
       "kv_producer / kv_consumer over a shared tier (docs/vllm.md, Prefill/decode disaggregation)")
_GDS = "no GPU Direct Storage: the disk tier (LMCACHE_LOCAL_DISK) is read and written through the CPU pool"
_POOL = ("the CPU pool is allocated whole at start and pre-faulted in the background (KVCONNECT_POOL_PREFAULT); "
         "size it with LMCACHE_MAX_LOCAL_CPU_SIZE (docs/operations.md, Sizing)")
_PLUGINS = ("no storage plugins: the tiers are the CPU pool, the disk, Redis/Valkey, Mooncake Store and the node "
            "server (docs/storage.md)")
_STATS = "no chunk statistics: kvconnect's figures are Prometheus metrics (docs/operations.md)"
_API = ("no internal API server: figures are on vLLM's /metrics or KVCONNECT_METRICS_PORT, the node server "
        "answers `kvconnect info`")
_USAGE = "kvconnect sends no usage data anywhere"
_LOOKUP = "the engine adapter looks chunks up itself in the scheduler (docs/vllm.md); nothing to configure"
_REMOTE_CFG = "no remote configuration service: configuration is the environment, LMCACHE_CONFIG_FILE and the engine's extra config"
_MP = ("no LMCache multiprocess server: the engine adapter runs in the engine's own processes; one node's engines "
       "share a pool through kvconnect's node server (KVCONNECT_SERVER_URL, docs/server.md)")
_HIDDEN = "no hidden-state cache (LMCache 0.5's vLLM-Omni pipelines): kvconnect caches the KV cache only"
_AEROSPIKE = "no Aerospike backend: " + _PLUGINS
_MUSA = "no Moore Threads (MUSA) route: kvconnect moves bytes on CPU, CUDA (and ROCm through torch), Triton and Ascend (docs/gpu.md)"

INSTEAD: dict[str, str] = {
    # -- lmcache/v1/config.py: _CONFIG_DEFINITIONS
    "reserve_local_cpu_size": _POOL,
    "local_disk_path_sharding": "the disk tier keeps each layout (model, TP rank, format) in its own fingerprint directory under LMCACHE_LOCAL_DISK",
    "remote_serde": "chunks are stored in kvconnect's own format (header, checksum, raw planes): there is no serializer to choose",
    "use_layerwise": "no layer-by-layer pipelining: a hit is loaded before the forward that uses it, each chunk is saved in the step that computes it",
    "pre_caching_hash_algorithm": "chunks are keyed by kvconnect's chained prefix hash of token ids (kvconnect/chunks/keys.py)",
    "enable_blending": _BLEND, "blend_recompute_ratios": _BLEND, "blend_thresholds": _BLEND,
    "blend_check_layers": _BLEND, "blend_min_tokens": _BLEND, "blend_special_str": _BLEND,
    "retrieve_locations": "every chunk is stored in every configured tier and read from the fastest tier that holds it",
    "store_location": "every chunk is stored in every configured tier and read from the fastest tier that holds it",
    "enable_p2p": _SHARE, "p2p_host": _SHARE, "p2p_init_ports": _SHARE, "p2p_lookup_ports": _SHARE,
    "enable_controller": _SHARE, "lmcache_instance_id": _SHARE, "controller_pull_url": _SHARE,
    "controller_reply_url": _SHARE, "lmcache_worker_ports": _SHARE, "lmcache_worker_ids": _SHARE,
    "lmcache_worker_heartbeat_delay_time": _SHARE, "lmcache_worker_heartbeat_time": _SHARE,
    "enable_pd": _PD, "pd_role": _PD, "pd_buffer_size": _PD, "pd_buffer_device": _PD, "pd_peer_host": _PD,
    "pd_peer_init_port": _PD, "pd_peer_alloc_port": _PD, "pd_peer_query_port": _PD, "pd_proxy_host": _PD,
    "pd_proxy_port": _PD, "pd_allocation_timeout_sec": _PD, "pd_shutdown_timeout_sec": _PD,
    "pd_condition_poll_interval_sec": "the decode side polls the shared tier every KVCONNECT_PD_POLL_INTERVAL_S",
    "pd_max_prefill_len": _PD, "pd_backend_mode": _PD, "pd_skip_proxy_notification": _PD, "pd_bidirectional": _PD,
    "transfer_channel": _PD,
    "nixl_backends": _PD, "nixl_buffer_size": _PD, "nixl_buffer_device": _PD,
    "gds_path": _GDS, "gds_path_sharding": _GDS, "gds_buffer_size": _GDS, "use_gds": _GDS, "gds_backend": _GDS,
    "maru_path": "no CXL shared-memory backend: one node's engines share the node server's pool (KVCONNECT_SERVER_URL)",
    "maru_pool_size": "no CXL shared-memory backend: one node's engines share the node server's pool (KVCONNECT_SERVER_URL)",
    "audit_actual_remote_url": "no audit backend: every chunk carries a checksum that is verified on every read",
    "internal_api_server_host": _API, "internal_api_server_enabled": _API, "internal_api_server_port_start": _API,
    "internal_api_server_include_index_list": _API, "internal_api_server_socket_path_prefix": _API,
    "blocking_timeout_secs": "every remote-tier call is bounded by KVCONNECT_REMOTE_TIMEOUT_S (default 1 s); a slow tier is a miss",
    "external_lookup_client": _LOOKUP, "lookup_server_worker_ids": _LOOKUP, "enable_scheduler_bypass_lookup": _LOOKUP,
    "hit_miss_ratio": "no artificial hit/miss ratio: lookups report what the tiers hold",
    "py_enable_gc": "kvconnect never changes Python's garbage collector",
    "numa_mode": "copy threads are placed by kvconnect around the engine's OpenMP binding (kvconnect/transfer/placement.py); KVCONNECT_NUM_THREADS sets their number",
    "enable_async_loading": "stores are asynchronous (write-behind to lower tiers); loads finish before the forward that reads them",
    "priority_limit": "no priority limit: every request's prefix is cached",
    "runtime_plugin_locations": _PLUGINS, "storage_plugins": _PLUGINS, "remote_storage_plugins": _PLUGINS,
    "script_allowed_imports": _PLUGINS,
    "enable_lazy_memory_allocator": _POOL, "lazy_memory_initial_ratio": _POOL, "lazy_memory_expand_trigger_ratio": _POOL,
    "lazy_memory_step_ratio": _POOL, "lazy_memory_safe_size": _POOL,
    "enable_chunk_statistics": _STATS, "chunk_statistics_auto_start_statistics": _STATS,
    "chunk_statistics_auto_exit_timeout_hours": _STATS, "chunk_statistics_auto_exit_target_unique_chunks": _STATS,
    "chunk_statistics_strategy": _STATS,
    "enable_kv_events": "the vLLM adapter publishes stored/removed chunks through vLLM's own KV events (docs/vllm.md)",
    "use_gpu_connector_v3": "the transfer route is KVCONNECT_TRANSFER_ROUTE (docs/gpu.md)",
    "pin_timeout_sec": "pins are released by the call that takes them; the node server ends a dead client's pins by lease",
    "pin_check_interval_sec": "pins are released by the call that takes them; the node server ends a dead client's pins by lease",
    "remote_config_url": _REMOTE_CFG, "app_id": _REMOTE_CFG,
    # -- lmcache/v1/config.py: _CONFIG_ALIASES and _DEPRECATED_CONFIGS (old names)
    "enable_xpyd": _PD, "nixl_peer_host": _PD, "nixl_peer_init_port": _PD, "nixl_peer_alloc_port": _PD,
    "nixl_proxy_host": _PD, "nixl_proxy_port": _PD, "nixl_role": _PD, "nixl_peer_port": _PD,
    "controller_url": _SHARE, "lmcache_worker_port": _SHARE,
    "plugin_locations": _PLUGINS, "external_backends": _PLUGINS,
    # -- variables LMCache reads outside its config module (the os.environ reads of its wheel)
    "track_usage": _USAGE, "usage_track_url": _USAGE, "usage_track_interval": _USAGE,
    "log_level": "kvconnect logs through the Python logger 'kvconnect' (under vLLM it follows vLLM's logging configuration)",
    "resp_host": "no resp:// backend: use LMCACHE_REMOTE_URL redis://HOST:PORT (RESP is Redis's protocol)",
    "resp_port": "no resp:// backend: use LMCACHE_REMOTE_URL redis://HOST:PORT (RESP is Redis's protocol)",
    "resp_username": "no resp:// backend: credentials go in the URL, redis://USER:PASSWORD@HOST:PORT",
    "resp_password": "no resp:// backend: credentials go in the URL, redis://USER:PASSWORD@HOST:PORT",
    "mq_timeout": "no LMCache multiprocess server: remote calls are bounded by KVCONNECT_REMOTE_TIMEOUT_S",
    "controller_config_file": _SHARE,
    "server_url": ("LMCache's server (lm://, or the ipc:// / tcp:// socket of its multiprocess server) is not "
                   "kvconnect's: kvconnect's node server is KVCONNECT_SERVER_URL (a different protocol; docs/server.md)"),
    "runtime_plugin_role": _PLUGINS, "runtime_plugin_config": _PLUGINS, "runtime_plugin_worker_id": _PLUGINS,
    "runtime_plugin_worker_count": _PLUGINS, "plugin_role": _PLUGINS, "plugin_config": _PLUGINS,
    "plugin_worker_id": _PLUGINS, "plugin_worker_count": _PLUGINS,
    "request_telemetry_type": _STATS, "request_telemetry_endpoint": _STATS,
    "offload_rpc_port": "no offload RPC server: the engine adapter moves the bytes in-process",
    "gpu_staging_buffer_bytes": "the CUDA staged route sizes its own device ring (KVCONNECT_CUDA_TRANSFER=staged; docs/gpu.md)",
    "force_skip_save": "no switch to skip saves: under kv_role kv_consumer (vLLM) prompts are not saved",
    # -- LMCache 0.5.6: new keys of lmcache/v1/config.py
    "local_cpu_use_hugepages": ("the CPU pool uses ordinary pages, pre-faulted in the background (KVCONNECT_POOL_PREFAULT): "
                                "transparent huge pages made stores slower (kvconnect/storage/host_memory.py)"),
    "mp_host": _MP, "mp_port": _MP,
    "enable_hidden_state_cache": _HIDDEN, "max_hidden_state_cpu_size": _HIDDEN, "hidden_state_layers": _HIDDEN,
    "hidden_states_retrieve_mode": _HIDDEN,
    "run_script_api_enabled": _API,
    # -- LMCache 0.5.6: variables its code reads outside the config module
    "aerospike_hosts": _AEROSPIKE, "aerospike_namespace": _AEROSPIKE, "aerospike_password": _AEROSPIKE,
    "aerospike_set": _AEROSPIKE, "aerospike_username": _AEROSPIKE,
    "coordinator_url": _SHARE, "coordinator_advertise_ip": _SHARE, "coordinator_event_flush_interval": _SHARE,
    "coordinator_event_reporting": _SHARE, "coordinator_heartbeat_interval": _SHARE,
    "device_backend": "the device is the engine's: kvconnect reads it from the KV cache tensors the engine registers",
    "disable_banner": "kvconnect prints no banner (its start is one INFO line)",
    "mp_transfer_mode": _MP,
    "musa_handle_transfer": _MUSA, "musa_native_kv_transfer": _MUSA,
    # -- keys LMCache-Ascend adds to LMCache's (lmcache_ascend/__init__.py; its example configs use them)
    "p2p_use_npu": _SHARE, "p2p_npu_buffer_size": _SHARE, "p2p_pull_mode": _SHARE, "p2p_delay_pull": _SHARE,
    "p2p_pull_pending_ttl": _SHARE, "p2p_sync_lookup_cache_ttl": _SHARE, "p2p_sync_lookup_cache_max_entries": _SHARE,
    "pd_pull_mode": _PD, "pd_delay_pull": _PD, "pd_pull_done_port": _PD, "pd_use_cpu_offload": _PD,
    "pd_cpu_buffer_size": _PD, "pd_pull_pending_ttl": _PD, "pd_alloc_fail_backoff_ttl": _PD,
    "pd_pull_backpressure_reserve_pct": _PD,
    "enable_chunk_hashes_return": "lookups return token counts; chunk keys are internal (kvconnect/chunks/keys.py)",
    "lookup_hashes_cache_size": "lookups return token counts; chunk keys are internal (kvconnect/chunks/keys.py)",
    "store_async": "stores to the disk and remote tiers are always asynchronous (write-behind, bounded; docs/storage.md)",
    "store_async_max_queue_size": "the write-behind queue is bounded by bytes and items per tier (kvconnect/storage/writer.py)",
    # -- LMCache-Ascend's DeepSeek V4 connector (seed 003)
    "ascend_bundle_multi_spec": "kvconnect moves every plane of every layer in one launch per batch; nothing to choose",
    "ascend_flatten_multi_spec": "multi-group layouts are kvconnect's native model; nothing to flatten",
    "ascend_skip_state_groups": ("kvconnect stores every group the model reads, state groups included (the model reads "
                                 "them at compress boundaries: a restore without them changes the output)"),
    "ascend_skip_state_spec_allowlist": ("kvconnect stores every group the model reads, state groups included (the model "
                                         "reads them at compress boundaries: a restore without them changes the output)"),
}

# keys of LMCache's extra_config mapping (LMCACHE_EXTRA_CONFIG, a JSON object)
_FIRST_RANK = ("read, not needed: KV replicated over tensor-parallel ranks (MLA) is always keyed without the rank, "
               "written once by the first rank and read by all (vLLM, vLLM-Ascend and SGLang)")
_BACKEND = "an option of an LMCache backend kvconnect does not have"
_AUDIT = "no audit backend: every chunk carries a checksum that is verified on every read"
_MOONCAKE_FILE = ("a Mooncake client setting: kvconnect reads the same key (local_hostname, metadata_server, "
                  "global_segment_size, local_buffer_size, protocol, device_name) from the JSON file at "
                  "MOONCAKE_CONFIG_PATH, not from extra_config (docs/storage.md)")
_FS = "kvconnect's disk tier (LMCACHE_LOCAL_DISK) writes whole files and renames them into place (docs/storage.md)"
EXTRA_CONFIG: dict[str, str] = {
    "save_only_first_rank": _FIRST_RANK, "remote_enable_mla_worker_id_as0": _FIRST_RANK,
    "first_rank_max_local_cpu_size": "every rank's pool is LMCACHE_MAX_LOCAL_CPU_SIZE",
    "audit_actual_remote_url": _AUDIT, "audit_backend_enabled": _AUDIT, "audit_calc_checksum": _AUDIT,
    "audit_exclude_cmds": _AUDIT, "audit_verify_checksum": _AUDIT,
    "chunk_statistics_async_preprocess_chunks": _STATS, "chunk_statistics_async_queue_capacity": _STATS,
    "chunk_statistics_file_max_count": _STATS, "chunk_statistics_file_output_dir": _STATS,
    "chunk_statistics_file_rotation_size": _STATS, "chunk_statistics_mem_bf_expected_chunks": _STATS,
    "chunk_statistics_mem_bf_false_positive_rate": _STATS, "enable_cache_usage_details_in_response": _STATS,
    "enable_nixl_storage": _BACKEND, "nixl_backend": _BACKEND, "nixl_pool_size": _BACKEND,
    "enable_sparse": "no sparse KV: a hit restores every token of the prefix",
    "force_store_wait": "stores never block the engine: a full write-behind queue drops and counts (docs/storage.md)",
    "fs_connector_read_ahead_size": _FS, "fs_connector_relative_tmp_dir": _FS, "fs_connector_use_odirect": _FS,
    "use_odirect": _FS, "gds_io_threads": _GDS,
    "full_sync_batch_interval_ms": _SHARE, "full_sync_batch_size": _SHARE, "full_sync_max_poll_attempts": _SHARE,
    "full_sync_max_retry_count": _SHARE, "full_sync_retry_delay_s": _SHARE, "full_sync_startup_delay_s": _SHARE,
    "full_sync_status_poll_interval_s": _SHARE, "heartbeat_url": _SHARE, "kv_msg_batch_size": _SHARE,
    "kv_msg_batch_timeout": _SHARE, "lookup_backoff_time": _SHARE, "p2p_max_retry_count": _SHARE,
    "p2p_socket_recv_timeout_ms": _SHARE, "p2p_socket_send_timeout_ms": _SHARE,
    "worker_socket_recv_timeout_ms": _SHARE, "worker_socket_send_timeout_ms": _SHARE,
    "gpu_to_numa_mapping": INSTEAD["numa_mode"],
    "hf3fs_base_path": _BACKEND, "hf3fs_mount_point": _BACKEND, "infinistore_link_type": _BACKEND,
    "rust_raw_block.io_engine": _BACKEND, "rust_raw_block.use_iouring": _BACKEND, "rust_raw_block.use_uring": _BACKEND,
    "internal_api_server_access_log": _API, "internal_api_server_log_level": _API,
    "save_chunk_meta": "every chunk carries its own header (layout fingerprint, groups, checksum; kvconnect/chunks/chunk_format.py)",
    "shm_name": "the node server's shared memory is named by kvconnect server --url (docs/server.md)",
    "use_exists_sync": "lookups in every tier are batched and bounded by KVCONNECT_REMOTE_TIMEOUT_S",
    # -- LMCache 0.5.6
    "disk_io_threads": _GDS, "nixl_presence_cache": _BACKEND, "nixl_presence_cache_only": _BACKEND,
    "nixl_use_hugepages": _BACKEND,
    "lmcache.mp.heartbeat_interval": _MP, "lmcache.mp.mp_transfer_mode": _MP, "lmcache.mp.mq_timeout": _MP,
    # -- LMCache's Mooncake connector (mooncakestore_connector.py) hands these to Mooncake's setup
    "master_server_address": ("the Mooncake master is LMCACHE_REMOTE_URL=mooncakestore://HOST:PORT; kvconnect reads "
                              "Mooncake's client settings from the JSON file at MOONCAKE_CONFIG_PATH (docs/storage.md)"),
    "local_hostname": _MOONCAKE_FILE, "metadata_server": _MOONCAKE_FILE, "global_segment_size": _MOONCAKE_FILE,
    "local_buffer_size": _MOONCAKE_FILE, "protocol": _MOONCAKE_FILE, "device_name": _MOONCAKE_FILE,
    "transfer_timeout": "every Mooncake call is bounded by KVCONNECT_REMOTE_TIMEOUT_S (seconds)",
    "storage_root_dir": "no Mooncake storage root: kvconnect's disk tier is LMCACHE_LOCAL_DISK",
    "prefer_local_alloc": "Mooncake places objects by its master's policy; the segment holder is set in MOONCAKE_CONFIG_PATH",
}
EXTRA_CONFIG_PREFIXES: dict[str, str] = {
    # LMCache's Mooncake connector strips the prefix and hands the rest to Mooncake's setup
    "mooncake_": _MOONCAKE_FILE,
}
EXTRA_CONFIG_OTHER = ("not an extra_config key of LMCache " + LMCACHE_RELEASES_TEXT
                      + " (their code reads no such key) nor a kvconnect setting: kvconnect ignores it")

ENV_PREFIXES: dict[str, str] = {
    "LMCACHE_EC_": "no encoder cache: kvconnect caches the KV of token prefixes only",
    "LMCACHE_CONTROLLER_": _SHARE,
    "LMCACHE_ASCEND_": "an LMCache-Ascend switch kvconnect has no use for: the layout of every group is read from the engine",
}

# LMCache values with which LMCache behaves as kvconnect does: set to one of them (or empty), an ignored
# name is read silently. An ordinary LMCache file lists its switches off (enable_p2p: false, ...): a
# warning there would say nothing (issue 41). Booleans, numbers and lower-case words, compared as
# kvconnect.config reads the value (``1``/``true`` is True).
AS_KVCONNECT: dict[str, tuple] = {
    **dict.fromkeys(("enable_p2p", "enable_blending", "use_layerwise", "enable_controller", "enable_pd",
                     "local_cpu_use_hugepages", "enable_lazy_memory_allocator", "enable_chunk_statistics",
                     "internal_api_server_enabled", "run_script_api_enabled", "enable_hidden_state_cache",
                     "enable_scheduler_bypass_lookup", "chunk_statistics_auto_start_statistics", "track_usage",
                     "enable_xpyd"), (False,)),
    "py_enable_gc": (True,),  # LMCache's default: the collector stays on, as kvconnect leaves it
    "disable_banner": (True,),  # kvconnect prints no banner
    "remote_serde": ("naive",),  # raw bytes, as kvconnect stores them ("cachegen" compresses: warned)
    "reserve_local_cpu_size": (0,),
    "blend_recompute_ratios": (), "blend_thresholds": (),  # None only (no CacheBlend either way)
    # extra_config: the first rank writes replicated (MLA) KV once, as kvconnect always does
    "save_only_first_rank": (True,), "remote_enable_mla_worker_id_as0": (True,),
    # vLLM: 0 is LMCache's "no cap", kvconnect's only behaviour
    "lmcache.max_tokens_per_load": (0,),
}

# -- LMCache's vLLM connectors (lmcache/integration/vllm): keys of vLLM's kv_connector_extra_config.
# ``lmcache.<key>`` sets LMCache's configuration key <key> over the file and the environment
# (vllm_v1_adapter._apply_extra_config); kvconnect reads <key> as it reads that key anywhere.
VLLM_CONFIG_PREFIX = "lmcache."
VLLM_READ = {
    "discard_partial_chunks": ("true: a prompt's partial last chunk is never stored, whatever save_unfull_chunk "
                               "says (LMCache: discard = discard_partial_chunks or not save_unfull_chunk)"),
    "skip_last_n_tokens": ("the lookup leaves a request's last N prompt tokens out: a hit never covers them "
                           "(kvconnect setting skip_last_n_tokens, KVCONNECT_SKIP_LAST_N_TOKENS)"),
}
VLLM_EXTRA_CONFIG: dict[str, str] = {
    "lmcache.max_tokens_per_load": ("no per-step load cap: kvconnect reports a request's whole hit at once and "
                                    "loads it before the request's first forward (0, LMCache's default, is the same)"),
    "lmcache_rpc_port": _LOOKUP,
}
VLLM_EXTRA_CONFIG_PREFIXES: dict[str, str] = {
    "lmcache.mp.": _MP,  # LMCacheMPConnector's keys (server address, autostart, prefetch, ...)
}

# variables read by kvconnect or by the build and test harness, never warned about
NOT_SETTINGS = ("LMCACHE_CONFIG_FILE", "KVCONNECT_BUILD_CUDA", "KVCONNECT_SGLANG_CPU_HARNESS", "KVCONNECT_RESULT",
                "KVCONNECT_WHEEL_ADAPTERS", "KVCONNECT_HIVMC_KEEP",
                # test harnesses of vLLM's real DeepSeek V4 forward (tests/integration/dsv4_harness)
                "KVCONNECT_VLLM_DSV4_HARNESS", "KVCONNECT_DSV4_HARNESS_STEP_TOKENS")


def instead(name: str) -> Optional[str]:
    """What kvconnect does instead of LMCache's ``name`` (YAML spelling), or None if unknown."""
    return INSTEAD.get(name)


def extra_config(key: str) -> str:
    """What kvconnect does with LMCache's ``extra_config`` key ``key``."""
    text = EXTRA_CONFIG.get(key)
    if text is None:
        text = next((t for prefix, t in EXTRA_CONFIG_PREFIXES.items() if key.startswith(prefix)), EXTRA_CONFIG_OTHER)
    return text


def vllm_extra_config(key: str) -> Optional[str]:
    """What kvconnect does instead of LMCache's vLLM ``kv_connector_extra_config`` key ``key``, or
    None where it is not one of those (``VLLM_READ`` keys and ``lmcache.<key>`` are read)."""
    text = VLLM_EXTRA_CONFIG.get(key)
    if text is None:
        text = next((t for prefix, t in VLLM_EXTRA_CONFIG_PREFIXES.items() if key.startswith(prefix)), None)
    return text


def instead_of_variable(var: str) -> Optional[str]:
    """The same for an environment variable (``LMCACHE_TRACK_USAGE``), prefixes included."""
    text = INSTEAD.get(var.lower().removeprefix("lmcache_")) if var.startswith("LMCACHE_") else None
    if text is None:
        text = next((t for prefix, t in ENV_PREFIXES.items() if var.startswith(prefix)), None)
    return text
