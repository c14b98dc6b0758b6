"""TEST HARNESS: kvconnect's connector driven by vLLM's own Scheduler and model-runner mixin.

Built the way vLLM's connector unit tests build theirs (tests/v1/kv_connector/unit/utils.py):
vLLM's ``VllmConfig`` / ``Scheduler`` / ``KVConnectorFactory``, a ``KVCacheConfig`` from
vLLM's ``get_kv_cache_configs`` and KV tensors from vLLM's own ``allocate_kv_cache`` (the CPU
backend's LBHNC layout), and every worker-side connector call made by vLLM's
``KVConnectorModelRunnerMixin`` plus ``handle_preemptions`` where vLLM's GPU runner calls
it. Only the forward is faked: it writes, for every token it computes, a value that is a
pure function of the token prefix and the layer (``expected_row``) into the request's block
rows, and before every forward checks the rows of every token vLLM counts as computed
(``check_rows``), so any wrong byte a load or a prefix hit brings back fails the test. It
samples token 7.

The worker connector is built directly (no torch.distributed group in one process) and
installed as vLLM's global KV-transfer agent, which is what ``ensure_kv_transfer_initialized``
does after its TP broadcast of the engine id.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

try:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    def _kv_cache_configs(config, specs, memory):
        return get_kv_cache_configs(config, specs, memory)
except ImportError:  # vLLM 0.33: moved, and the engine core computes the global groups first

    def _kv_cache_configs(config, specs, memory):
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        return get_kv_cache_configs(config, specs, memory, get_global_kv_cache_groups(config, specs))
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

NUM_LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 32
SAMPLED = 7
_MOD = 1 << 20  # row values stay exact in float32
request_ids = itertools.count()
init_none_hash(sha256)


def expected_rows(tokens: np.ndarray, layer: int) -> np.ndarray:
    """The value the fake forward writes for each position of ``tokens`` in ``layer``."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = 17
    for p, t in enumerate(tokens.tolist()):
        h = (h * 1_000_003 + int(t) + 1) % _MOD
        out[p] = h
    return out + layer * (2 * _MOD)


@dataclass
class Rig:
    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: Any  # the worker-role KVConnectConnector
    kv_caches: dict[str, torch.Tensor]
    block_size: int
    kv_cache_config: Any
    computed_log: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # req -> (start, n) per forward

    def start_scheduler(self) -> None:
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=self.block_size)

    @property
    def connector(self):
        return self.scheduler.connector

    @property
    def engine(self):
        return self.worker._worker.engine

    # -- requests ------------------------------------------------------------------
    def add(self, tokens, max_tokens: int = 2, req_id: Optional[str] = None) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=req_id or f"r{next(request_ids)}", prompt_token_ids=[int(t) for t in tokens],
                      sampling_params=params, pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(self.request_hash_block_size, sha256))
        self.scheduler.add_request(req)
        return req

    @property
    def request_hash_block_size(self) -> int:
        """The block size a request's block hashes are made at (vLLM's hash block size)."""
        return self.block_size

    # -- one engine step -----------------------------------------------------------
    def step(self, before_worker: Optional[Callable[[Any], None]] = None):
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # several rigs (DP ranks) take turns
        out = self.scheduler.schedule()
        if before_worker is not None:
            before_worker(out)
        self.worker.handle_preemptions(out.kv_connector_metadata)  # as vLLM's GPU runner does first
        with set_forward_context(None, self.vllm_config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output:
            sampled = self._forward(out)
        req_ids = list(sampled)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=[], kv_connector_output=kv_output)
        self.scheduler.update_from_output(out, runner_output)
        return out, kv_output

    def run(self, max_steps: int = 200, before_worker=None) -> int:
        steps = 0
        while self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests():
            self.step(before_worker)
            steps += 1
            assert steps < max_steps, "the engine did not drain"
        # the saves are asynchronous: land them so the next request can hit
        self.worker._worker.drain()
        return steps

    def _forward(self, out) -> dict[str, list[int]]:
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start = req.num_computed_tokens - n  # vLLM advances it when it schedules
            self.check_rows(req, start)  # what vLLM treats as computed (its cache or a load) is right
            self.computed_log.setdefault(req_id, []).append((start, n))
            tokens = np.asarray(req.all_token_ids[: start + n], dtype=np.int64)
            blocks, offsets = self._rows(req_id, start, start + n)
            for layer, cache in enumerate(self.kv_caches.values()):
                values = torch.from_numpy(expected_rows(tokens, layer)[start:].astype(np.float32))
                cache[blocks, :, offsets, :] = values[:, None, None].expand(n, cache.shape[1], cache.shape[3])
            sampled[req_id] = [SAMPLED] if start + n >= req.num_tokens else []
        return sampled

    def _rows(self, req_id: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        pos = torch.arange(start, end)
        return torch.tensor(blocks, dtype=torch.long)[pos // self.block_size], pos % self.block_size

    # -- checks --------------------------------------------------------------------
    def check_rows(self, req: Request, upto: int) -> None:
        """Every row of tokens [0, upto) in ``req``'s blocks holds the value of its prefix."""
        if upto == 0:
            return
        tokens = np.asarray(req.all_token_ids[:upto], dtype=np.int64)
        blocks, offsets = self._rows(req.request_id, 0, upto)
        for layer, cache in enumerate(self.kv_caches.values()):
            want = torch.from_numpy(expected_rows(tokens, layer).astype(np.float32))
            got = cache[blocks, :, offsets, :]
            bad = (got != want[:, None, None]).flatten(1).any(1).nonzero().flatten()
            assert not len(bad), f"{req.request_id}: wrong rows at tokens {bad[:8].tolist()} of layer {layer}"

    def assert_no_leak(self) -> None:
        """vLLM's own emptiness check (assert_scheduler_empty in its connector tests)."""
        s = self.scheduler
        assert not s.requests and not s.waiting and not s.running and not s.finished_req_ids
        assert not s.finished_recving_kv_req_ids
        pool = s.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()  # stops vLLM's KV-event publisher
        self.worker.shutdown()
        if self.scheduler is not None:
            self.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None


def make_rig(model_dir: str, *, block_size: int = 16, num_blocks: int = 256, chunk_size: int = 64,
             max_num_batched_tokens: int = 128, extra: Optional[dict] = None, dp_rank: int = 0,
             enable_prefix_caching: bool = True, start_scheduler: bool = True, kv_events_config=None,
             engine_id: Optional[str] = None, layer_specs: Optional[dict] = None, max_model_len: int = 2048,
             transfer: Optional[KVTransferConfig] = None, speculative_config=None) -> Rig:
    """A rig with vLLM's worker side up; its scheduler too unless ``start_scheduler`` is False
    (then ``rig.start_scheduler()``: vLLM's engine core builds its workers, then its scheduler).
    ``layer_specs`` (layer name -> vLLM KVCacheSpec) replaces the default full-attention layers
    (benchmarks/vllm_trace_replay.py: a sliding-window hybrid; the fake forward then writes
    through group 0's block table only, so row checks hold for one-group layouts only).
    ``transfer`` replaces kvconnect's KV-transfer config: another connector (the benchmark's
    peer) in the same rig; ``engine`` and ``run`` are then kvconnect's no more.
    ``speculative_config``: vLLM's ``SpeculativeConfig`` (a drafter's layers then go in ``layer_specs``)."""
    model = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    cache.kv_cache_layout = "LBHNC"  # what vLLM resolves for its CPU attention backend
    transfer = transfer or KVTransferConfig(kv_connector="KVConnectConnector", kv_connector_module_path="kvconnect.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"chunk_size": chunk_size, **(extra or {})},
                                **({"engine_id": engine_id} if engine_id else {}))
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache, kv_transfer_config=transfer,
                        device_config=DeviceConfig("cpu"), kv_events_config=kv_events_config,
                        speculative_config=speculative_config)
    if dp_rank:  # what vLLM's engine core does for a dense model's DP rank (EngineCoreProc.run_engine_core)
        par = config.parallel_config
        if hasattr(par, "reconfigure_for_independent_dp_rank"):  # vLLM 0.32, 0.33: the rank is data_parallel_index only
            par.data_parallel_index = dp_rank
            par.reconfigure_for_independent_dp_rank()
        else:
            par.data_parallel_rank = dp_rank
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    specs = layer_specs or {f"model.layers.{i}.self_attn.attn": spec for i in range(NUM_LAYERS)}
    (kv_cache_config,) = _kv_cache_configs(config, [specs], [num_blocks * sum(s.page_size_bytes for s in specs.values())])
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), cache.get_resolved_kv_cache_layout())
    worker = KVConnectorFactory.create_connector(config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = worker
    worker.register_kv_caches(caches)
    rig = Rig(config, None, worker, caches, block_size, kv_cache_config)
    if start_scheduler:
        rig.start_scheduler()
    return rig
