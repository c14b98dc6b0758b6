"""SGLang 0.5.23's real host pool classes over CPU "device" buffers, and a KVConnectStorage on them.

Shared by the host-pool suites (test_host_pools, test_mamba_pool, test_v2_pools,
test_sglang_bounded_calls); import it after ``pytest.importorskip("sglang.srt")``.
"""

from __future__ import annotations

import hashlib

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvconnect.integrations.sglang import KVConnectStorage

L, H, D, PS, N = 2, 2, 8, 4, 64
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def keys(n, salt="k"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def _ptrs(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def mha_pool(layout, dtype=torch.float32):
    k = [torch.zeros(N, H, D, dtype=dtype) for _ in range(L)]
    v = [torch.zeros(N, H, D, dtype=dtype) for _ in range(L)]
    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PS, head_num=H, head_dim=D, v_head_dim=D, dtype=dtype, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu", device_capacity_tokens=N,
                                start_layer=0, end_layer=L)
    pool._keep = (k, v)
    return pool


def mla_pool(layout):
    bufs = [torch.zeros(N, 1, 48) for _ in range(L)]
    info = MLABufferInfo(buffers=tuple(bufs), data_ptrs=_ptrs(bufs), layer_indices=tuple(range(L)), device_layer_num=L,
                         page_size=PS, kv_lora_rank=32, qk_rope_head_dim=16, kv_cache_dim=48, dtype=torch.float32,
                         device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu", device_capacity_tokens=N,
                                start_layer=0, end_layer=L, target_layer_num=L)
    pool._keep = bufs
    return pool


def storage_config(tmp_path, *, mla=False, tp_rank=0, tp_size=1, model="tiny", **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=True, is_page_first_layout=False, model_name=model,
        extra_config={"backend_name": "kvconnect", "module_path": "kvconnect.integrations.sglang",
                      "class_name": "KVConnectStorage", "interface_v1": 1, "max_local_cpu_size": 0.01,
                      "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05, **extra},
    )


def backend(pool, config):
    b = KVConnectStorage(config, {})
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(pool, "kv")
    b.on_host_pools_registered()
    return b


def fill(pool):
    if getattr(pool, "kv_buffer", None) is not None:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))


def idx(pages):
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def page(pool, p):
    return pool.get_data_page(p * PS, flat=True).clone()
