"""BENCHMARK HARNESS: vLLM's OffloadingConnector on a CPU-only vLLM, for side-by-side figures.

vLLM's ``CPUOffloadingSpec`` refuses a device that is not CUDA-alike or XPU: its worker copies
blocks with CUDA streams, events and a CUDA swap kernel. Everything else of the peer runs as
vLLM ships it: the ``OffloadingConnector`` scheduler and worker halves, the
``CPUOffloadingManager`` (which chunks are offloaded, lookups, LRU eviction, the hybrid-group
rules of which blocks are stored and which are offered as hits), the canonical KV views
(``register_kv_caches``) and the chunk sizing from ``cpu_bytes_to_use``. Only the copy stands
in: this spec is loaded through vLLM's own out-of-tree hook
(``kv_connector_extra_config = {"spec_name": "CPUCopyOffloadingSpec", "spec_module_path":
"offloading_cpu_shim", ...}``) and its worker does, synchronously with torch indexing, the
copies vLLM's ``SingleDirectionOffloadingHandler`` describes in its direct (worker-private)
layout: one whole page per (block, layer reference), the first offloaded chunk of each group
entered ``block_indices[g] % blocks_per_chunk`` sub-blocks in. Its transfer sizes are the
bytes that handler reports. This is not part of kvconnect.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class CPUCopyWorker(OffloadingWorker):
    """Device blocks <-> host chunks by torch indexing; every job is done when submitted."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        self.device_pages: list[torch.Tensor] = []  # (num_blocks, page bytes) per canonical tensor
        self.host_pages: list[torch.Tensor] = []  # (num_cpu_chunks * blocks_per_chunk, page bytes): chunk c, sub-block j at row c * bpc + j
        for t in kv_caches.tensors:
            self.device_pages.append(t.tensor.view(torch.int8).view(-1, t.page_size_bytes))
            self.host_pages.append(torch.zeros(num_cpu_chunks * blocks_per_chunk, t.page_size_bytes, dtype=torch.int8))
        self._finished: list[TransferResult] = []
        self.bytes_stored = [0] * len(self.refs)  # per KV cache group
        self.blocks_stored = [0] * len(self.refs)
        self.bytes_loaded = 0

    def _host_rows(self, chunk_ids: np.ndarray, skip: int, count: int) -> torch.Tensor:
        rows = chunk_ids.astype(np.int64)[:, None] * self.blocks_per_chunk + np.arange(self.blocks_per_chunk)
        return torch.from_numpy(rows.ravel()[skip : skip + count])

    def _copy(self, job_id: int, device: GPULoadStoreSpec, host: LoadStoreSpec, to_host: bool) -> bool:
        assert isinstance(host, BlockIDsLoadStoreSpec)
        bpc = self.blocks_per_chunk
        done = device_at = host_at = 0
        by_group = [0] * len(self.refs)
        for g, (count, first_index) in enumerate(zip(device.group_sizes, device.block_indices)):
            if count == 0:
                continue
            skip = first_index % bpc
            n_host = -(-(count + skip) // bpc)
            device_rows = torch.from_numpy(device.block_ids[device_at : device_at + count].astype(np.int64))
            host_rows = self._host_rows(host.block_ids[host_at : host_at + n_host], skip, count)
            for ref in self.refs[g]:
                page = ref.page_size_bytes
                src, dst = self.device_pages[ref.tensor_idx], self.host_pages[ref.tensor_idx]
                if to_host:
                    dst[host_rows, :page] = src[device_rows, :page]
                else:
                    src[device_rows, :page] = dst[host_rows, :page]
                by_group[g] += count * page
            done += by_group[g]
            if to_host:
                self.blocks_stored[g] += count
            device_at += count
            host_at += n_host
        assert device_at == len(device.block_ids) and host_at == len(host.block_ids)
        if to_host:
            self.bytes_stored = [a + b for a, b in zip(self.bytes_stored, by_group)]
        else:
            self.bytes_loaded += done
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=done, transfer_time=0.0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return None  # every job completed when it was submitted


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (manager, sizing, metrics) with the CPU copy worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
