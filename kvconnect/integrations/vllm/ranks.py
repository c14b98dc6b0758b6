"""This process's place in vLLM's parallelism: TP / PP / DCP ranks and sizes, the DP rank,
and which rank writes KV that is the same on every TP rank (``ParallelRanks.writes_shared``,
docs/vllm.md "Replicated KV"), and the ipc:// address an engine's scheduler and workers derive
from its engine id and DP rank. Imports vLLM (lazily) only for a worker's own ranks.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import blake3

from kvconnect.layout.spec import DCPSpec


@dataclass(frozen=True)
class ParallelRanks:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dcp: DCPSpec = DCPSpec()
    total_kv_heads: Optional[int] = None  # the model's KV heads over all TP ranks (keys attention by head range)

    @property
    def num_workers(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def worker_index(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    def writes_shared(self, tp_replicated: bool) -> bool:
        """Whether this rank writes the shared places (lower tiers, the node server's pool).

        Every rank does for rank-keyed KV. KV replicated over TP is written by one rank per
        copy: with decode context parallelism each DCP rank's tokens are a copy of their own,
        held by the TP ranks with that DCP rank (vLLM's DCP groups are consecutive TP ranks:
        ``dcp_rank = tp_rank % dcp_size``), so the writers are the ranks whose TP rank equals
        their DCP rank (tp_rank < dcp_size; as SGLang's ``is_storage_writer``).
        """
        return not tp_replicated or self.tp_rank == self.dcp.rank


def parallel_ranks(vllm_config: Any, *, in_worker: bool) -> ParallelRanks:
    """Sizes from the config; this process's ranks too when ``in_worker`` (distributed is up)."""
    par = vllm_config.parallel_config
    tp_size, pp_size = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    dcp_size = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    interleave = int(getattr(par, "cp_kv_cache_interleave_size", 1) or 1)
    if not in_worker:
        return ParallelRanks(tp_size=tp_size, pp_size=pp_size, dcp=DCPSpec(size=dcp_size, interleave_tokens=interleave))
    from vllm.distributed import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank() if tp_size > 1 else 0
    pp_rank = ps.get_pp_group().rank_in_group if pp_size > 1 else 0
    dcp_rank = ps.get_dcp_group().rank_in_group if dcp_size > 1 else 0
    return ParallelRanks(tp_rank, tp_size, pp_rank, pp_size, DCPSpec(rank=dcp_rank, size=dcp_size, interleave_tokens=interleave),
                         total_kv_heads=total_kv_heads(vllm_config))


def total_kv_heads(vllm_config: Any) -> Optional[int]:
    """The model's KV heads over all TP ranks (``ModelConfig.get_total_num_kv_heads``), None where
    the config does not say (attention is then keyed by rank, never by a guessed head range)."""
    try:
        heads = int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return None
    return heads if heads > 0 else None


def data_parallel_rank(vllm_config: Any) -> int:
    """This engine's data-parallel rank (0 without data parallelism).

    vLLM's ``data_parallel_index`` where it has one (0.23, 0.32, 0.33 here): the engine core of
    a dense (non-MoE) model's DP rank r runs as an independent engine and vLLM resets its
    ``data_parallel_rank`` to 0 (0.32, 0.33: ``ParallelConfig.reconfigure_for_independent_dp_rank``
    in ``EngineCoreProc.run_engine_core``), keeping r only in ``data_parallel_index``; reading
    ``data_parallel_rank`` there put every rank of one ``vllm serve`` on rank 0's lookup sockets.
    Older vLLM (0.13) keeps the rank in ``data_parallel_rank`` for every model.
    """
    par = vllm_config.parallel_config
    index = getattr(par, "data_parallel_index", None)
    return int(index if index is not None else (getattr(par, "data_parallel_rank", 0) or 0))


def default_channel_address(vllm_config: Any) -> str:
    """An ipc:// prefix that the scheduler and the workers of one engine derive alike."""
    seed = f"{vllm_config.kv_transfer_config.engine_id}|dp{data_parallel_rank(vllm_config)}"
    return f"ipc://{tempfile.gettempdir()}/kvconnect-{blake3.blake3(seed.encode()).hexdigest(length=8)}"
