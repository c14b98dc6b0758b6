"""KVConnectConnector: kvconnect behind vLLM's public KV-connector interface (V1, with HMA).

Enable with::

    --kv-transfer-config '{"kv_connector": "KVConnectConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "kvconnect.integrations.vllm"}'

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker
(role WORKER); this class only routes vLLM's calls to ``scheduler.KVConnectScheduler`` or
``worker.KVConnectWorker`` and converts vLLM objects through ``translate``. Configuration:
``LMCACHE_*`` / ``KVCONNECT_*`` variables, overridden by the same keys (YAML spelling) in
``kv_connector_extra_config``, plus two adapter keys: ``lookup_url`` (ipc:// or loopback
tcp:// prefix of the lookup channel; default derived from the engine id; data-parallel rank
r > 0 uses ``<url>-dp<r>`` / the port block after lower ranks' workers; a tcp:// one needs
``lookup_token``, see lookup_channel) and ``lookup_timeout_s`` (default 1.0).

Nothing is patched in vLLM. Calls from vLLM never raise for cache trouble: a failed
lookup is a miss, a failed load is reported so vLLM recomputes, a failed save is counted.

``kv_role`` is followed (roles.py: a producer only stores, a consumer only loads) and vLLM's
prefill/decode protocol is spoken through ``kv_transfer_params`` (pd.py, transfer_params.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvconnect.config import Config
from kvconnect.errors import LayoutError, UnsupportedLayoutError

from kvconnect.metrics.vllm import ReportGate

from . import (chunk_size, drafts, kv_events, logs, pd, rebuilt, recurrent, request_reads, roles, specs, stats, tensors,
               translate)
from .ranks import data_parallel_rank, default_channel_address, parallel_ranks
from .lookup_channel import LookupClient, dp_rank_base, rank_address
from .metadata import StepPlan
from .scheduler import KVConnectScheduler
from .worker import KVConnectWorker

try:  # newer vLLM: failed async loads are reported next to the finished ones
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None
try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST_SOURCE = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    _HOST_SOURCE = None

logger = logging.getLogger(__name__)

_ADAPTER_KEYS = ("lookup_url", "lookup_timeout_s")


@dataclass
class KVConnectMetadata(KVConnectorMetadata):
    plan: StepPlan


class KVConnectConnector(KVConnectorBase_V1, SupportsHMA):
    if _HOST_SOURCE is not None:
        _cache_hit_source = _HOST_SOURCE

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        logs.route_to_vllm()  # kvconnect's log records follow vLLM's logging configuration
        extra = translate.extra_config(vllm_config)
        adapter = {key: extra.pop(key) for key in _ADAPTER_KEYS if key in extra}
        # LMCache's vLLM keys too (lmcache.<key>, discard_partial_chunks, skip_last_n_tokens); the scheduler's
        # process warns about settings kvconnect does not use, each worker reads the same ones quietly
        quiet = role != KVConnectorRole.SCHEDULER
        config = Config.from_vllm_extra_config(extra, base=Config.from_env(quiet=quiet), quiet=quiet)
        if not config.model_name:
            config = dataclasses.replace(config, model_name=translate.model_identity(vllm_config))
        # R-SWA (specs.PROMPT_ONLY): a generated token's KV is not what a prompt computes: prompt chunks only
        prompt_only = specs.prompt_only_reason(vllm_config, kv_cache_config)
        if prompt_only and config.save_decode_cache:
            if not quiet:
                logger.warning("kvconnect: save_decode_cache is off for this model: %s", prompt_only)
            config = dataclasses.replace(config, save_decode_cache=False)
        # --- P/D roles (roles.py): a bad role or a role without a shared tier fails here, at start
        self._role = roles.role_policy(getattr(vllm_config.kv_transfer_config, "kv_role", None), config)
        self._pd: Optional[pd.PDScheduler] = None
        # --- end P/D roles
        self._config = config
        channel = adapter.get("lookup_url") or default_channel_address(vllm_config)
        # every data-parallel rank is an engine of its own: its own sockets, given address or not
        channel = dp_rank_base(channel, data_parallel_rank(vllm_config),
                               parallel_ranks(vllm_config, in_worker=False).num_workers)
        self._scheduler: Optional[KVConnectScheduler] = None
        self._worker: Optional[KVConnectWorker] = None
        self._requests: dict[str, Any] = {}
        self._stats_gate = ReportGate(stats.INTERVAL_S)
        self._events_on = kv_events.events_enabled(vllm_config)  # vLLM's --kv-events-config (kv_events.py)
        self._scheduler_events = kv_events.SchedulerEvents()
        # recurrent-state groups (recurrent.py): vLLM group -> block size; their snapshots are
        # saved only where vLLM offers the state (boundary_state_offloads)
        self._state_blocks = recurrent.state_block_sizes(kv_cache_config)
        # no chunk size set: both roles choose it from what both hold (chunk_size.py)
        chunk_choice = None
        if not config.chunk_size:
            chunk_choice = chunk_size.choose_vllm_chunk_size(self._state_blocks,
                                                            parallel_ranks(vllm_config, in_worker=False).dcp)
            config = dataclasses.replace(config, chunk_size=chunk_choice.tokens)
            self._config = config
        if role == KVConnectorRole.SCHEDULER:
            ranks = parallel_ranks(vllm_config, in_worker=False)
            client = LookupClient([rank_address(channel, i) for i in range(ranks.num_workers)],
                                  timeout_s=float(adapter.get("lookup_timeout_s", 1.0)), token=config.lookup_token)
            self._scheduler = KVConnectScheduler(client, chunk_tokens=config.chunk_size,
                                                 save_unfull_chunk=config.save_unfull_chunk,
                                                 save_decode_cache=config.save_decode_cache,
                                                 min_load_tokens=config.effective_min_load_tokens,
                                                 log_interval_s=config.log_interval_s, role=self._role,
                                                 tail_align_tokens=pd.engine_block_tokens(vllm_config, kv_cache_config),
                                                 # recurrent states, and engine-rebuilt groups (rebuilt.py): vLLM
                                                 # resumes exactly at the hit, which the gate put on their period
                                                 exact_resume=bool(self._state_blocks)
                                                 or bool(rebuilt.rebuilt_group_ids(kv_cache_config)),
                                                 skip_last_n_tokens=config.skip_last_n_tokens)
            self._pd = pd.PDScheduler(self._scheduler, self._role, pd.ServerIdentity(
                chunk_tokens=config.chunk_size, tp_size=ranks.tp_size, model=config.model_name,
                engine_id=str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "")),
                wait_timeout_s=config.pd_wait_timeout_s, poll_interval_s=config.pd_poll_interval_s)
        else:
            self._ranks = parallel_ranks(vllm_config, in_worker=True)
            # the scheduler hands the worker a partial last chunk only to store it (P/D prefills)
            # a server that stores no prompt (kv_consumer) cannot verify a restore: no save of its holds the prompt's rows
            worker_config = (dataclasses.replace(config, save_unfull_chunk=True) if self._role.stores_prompt
                             else dataclasses.replace(config, verify_rate=0.0, verify_first=0))
            self._worker = KVConnectWorker(worker_config, rank_address(channel, self._ranks.worker_index),
                                           chunk_words=chunk_size.describe(chunk_choice))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ==================================================================================
    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_states: Optional[dict] = None) -> None:
        """``kv_states``: vLLM-Ascend 0.13 (releases/v0.13.0) passes DeepSeek V4's sliding-window and
        compressor states as a second argument: per-request-slot buffers no block table addresses,
        so no chunk could restore them. The connector stays off there (one WARNING naming the
        release and the reason, ``translate.states_refusal``), never raises."""
        assert self._worker is not None
        # speculative decoding with draft KV layers (drafts.py): off, never stored as target layers;
        # a config field kvconnect has no rule for a non-zero value of (specs.SPEC_FIELDS): off
        refusal = drafts.draft_refusal(self._vllm_config, self._kv_cache_config) or specs.config_refusal(self._vllm_config)
        if refusal:
            logger.warning("kvconnect: off for this model: %s", refusal)
            return
        if kv_states:
            logger.warning("kvconnect: off for this model: %s",
                           translate.states_refusal(self._kv_cache_config, kv_caches, kv_states))
            return
        ranks = self._ranks
        try:
            translation = translate.translate_kv_caches(
                self._kv_cache_config, kv_caches,
                backend_names=tensors.attention_backend_names(self._vllm_config, list(kv_caches)),
                tiled_layers=tensors.tiled_layers(self._vllm_config, list(kv_caches)),
                model_name=self._config.model_name, tp_rank=ranks.tp_rank, tp_size=ranks.tp_size,
                pp_rank=ranks.pp_rank, pp_size=ranks.pp_size, dcp=ranks.dcp,
                conv_state_layout=recurrent.conv_state_layout() if self._state_blocks else None,
                total_kv_heads=ranks.total_kv_heads,
                gdn_dims=recurrent.gdn_dims(self._vllm_config) if self._state_blocks else None,
            )
            recurrent.check_chunk_size(self._config.chunk_size, self._state_blocks)
            # KV replicated over TP (MLA) is written once per copy: the other ranks read it
            # (and GQA heads held by several ranks, KV heads < TP: the first of them writes)
            self._worker.register(translation, shared_writer=ranks.writes_shared(translation.tp_replicated)
                                  and not translation.head_copy)
            if self._events_on and ranks.worker_index == 0 and self._worker.engine is not None:
                self._worker.engine.enable_events()
        except UnsupportedLayoutError as exc:
            logger.warning("kvconnect: off for this model: %s", exc)
        except LayoutError as exc:
            logger.error("kvconnect: off: cannot describe vLLM's KV cache: %s", exc)

    # sleep mode, vLLM >= 0.33 (sleep.py: why True, what the hooks guarantee)
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.resume()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM's first call of a step, before the forward writes blocks freed for this step.
        if self._worker is not None:
            self._worker.begin_step(self._plan(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:  # the same plan as handle_preemptions: begin_step ignores the repeat
            self._worker.begin_step(self._plan(connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous in vLLM's sense: done before the request runs

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved per request after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        saved, loaded, failed = self._worker.transfer_results(finished_req_ids)
        return saved or None, (loaded | failed) or None

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str]):
            saved, loaded, failed = self._worker.transfer_results(finished_req_ids)
            return KVConnectorTransferResults(finished_sending=saved, finished_recving=loaded | failed,
                                              failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_error_blocks() if self._worker is not None else set()

    def get_kv_connector_kv_cache_events(self) -> Any:
        engine = self._worker.engine if self._worker is not None else None
        if engine is None or engine.events is None:
            return None
        events = kv_events.to_vllm(engine.events.drain())
        return kv_events.KVConnectKVEvents(events) if events else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.hits.close()

    def _plan(self, meta: Any = None) -> StepPlan:
        meta = self._get_connector_metadata() if meta is None else meta
        return meta.plan if isinstance(meta, KVConnectMetadata) else StepPlan()

    # ==================================================================================
    # scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        try:  # P/D (pd.py): None while a producer's chunks are not yet in the shared tier
            return self._pd.num_new_matched_tokens(request_reads.request_view(request), num_computed_tokens,
                                                   getattr(request, "kv_transfer_params", None))
        except Exception:
            logger.warning("kvconnect: lookup failed; treating it as a miss", exc_info=True)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        block_ids = request_reads.block_ids_of(blocks) if num_external_tokens > 0 else ()
        self._scheduler.after_alloc(request_reads.request_view(request), block_ids,
                                    request_reads.num_computed_tokens(request), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        manager = getattr(self, "_kv_cache_manager", None)
        offers = recurrent.offered_rows(scheduler_output, self._state_blocks)  # {} without state groups
        plan = self._scheduler.build_plan(
            request_reads.scheduled_tokens(scheduler_output),
            lambda req_id: request_reads.num_computed_tokens(self._requests[req_id]),
            # state rows only where vLLM offers the state this step: a snapshot is stored only where proven
            lambda req_id: recurrent.proven_block_ids(request_reads.current_block_ids(scheduler_output, manager, req_id),
                                                      self._state_blocks, offers.get(req_id, {})),
            lambda req_id: request_reads.all_token_ids(self._requests[req_id]),
            preempted=request_reads.preempted_ids(scheduler_output),
        )
        return KVConnectMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_events.add(connector_output)

    def take_events(self):
        return self._scheduler_events.take()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        self._requests.pop(request.request_id, None)
        params = None
        try:  # P/D: a prefill for a remote decode names what it stored (pd.py)
            params = self._pd.request_finished(request_reads.request_view(request), getattr(request, "kv_transfer_params", None))
        except Exception:
            logger.warning("kvconnect: P/D: cannot name the stored prefill of %s; its decode will recompute",
                           request.request_id, exc_info=True)
        return self._scheduler.request_finished(request.request_id), params

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished(request, [])

    # ==================================================================================
    # stats (vLLM's KV-connector stats interface; see stats.py)

    def get_kv_connector_stats(self) -> Any:
        try:
            if self._worker is not None:
                return stats.worker_stats(self._worker, str(self._ranks.worker_index), self._stats_gate)
            if self._scheduler is None:
                return None
            return stats.scheduler_stats(self._scheduler.hits, self._stats_gate, self._pd.counters)
        except Exception:  # figures must never break a step
            logger.debug("kvconnect: stats failed", exc_info=True)
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Any:
        return stats.build(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list, per_engine_labelvalues: dict) -> Any:
        return stats.build_prom(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> Optional[bool]:
        return self._scheduler.reset_cache() if self._scheduler is not None else None
