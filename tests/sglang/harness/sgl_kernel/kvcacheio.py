"""TEST HARNESS stand-in for sgl_kernel.kvcacheio: the three host<->device copies HiCache's
``io_backend="direct"`` uses, as plain torch index copies (CPU "device" and host pools)."""

import torch


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Per buffer i: dst_layers[i][dst_indices] = src_layers[i][src_indices] (token rows)."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """Host page_first_direct [pages, layers, page, ...] -> device layer buffers, one layer."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    pages, offs = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices] = src[pages, layer_id, offs].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Device layer buffers (K layers then V layers) -> host page_first_direct buffers."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    pages, offs = dst_indices // page_size, dst_indices % page_size
    num_layers = len(src_ptrs) // len(dst_ptrs)
    for d, dst in enumerate(dst_ptrs):
        for layer in range(num_layers):
            dst[pages, layer, offs] = src_ptrs[d * num_layers + layer][src_indices].to(dst.device)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _raise(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.kvcacheio.{name} is not available in the kvconnect test harness")

    return _raise
