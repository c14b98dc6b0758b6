"""kvconnect vs SGLang's built-in ``file`` backend as HiCache L3, on the same host pages.

    KVCONNECT_SGLANG_CPU_HARNESS=1 PYTHONPATH=tests/sglang/harness \
        .venv-sglang/bin/python benchmarks/sglang_storage.py [--pages 128] [--layers 32] [--repeat 3]

Builds one real SGLang ``MHATokenToKVPoolHost`` (Llama-3-8B geometry per rank: 8 KV heads x
128, bf16, page 16 tokens by default) in the given layout, fills it, and times, side by side
in one run, what SGLang's cache controller calls for a batch of ``--pages`` pages:

- set: kvconnect ``batch_set_v1`` (into the pool; the disk write is behind) and the same
  followed by ``flush`` (on disk); SGLang file: ``get_data_page`` per page + ``batch_set``
  (the controller's generic path, files written synchronously).
- get: kvconnect ``batch_get_v1`` from its pool and, in a fresh backend, from disk (the OS
  page cache is warm for both backends); file: ``batch_get`` into flat pages +
  ``set_from_flat_data_page`` (the controller's path).
- batch_exists of the batch's keys (all present), and of keys never stored.

Objects per batch: kvconnect and file both store one object (file) per page. Prints a
table; figures go to docs/performance.md. Timings include Python overheads, as SGLang sees.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time

import torch


def pool(layout: str, layers: int, heads: int, head_dim: int, page: int, pages: int):
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    n = page * pages
    k = [torch.zeros(n, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers)]
    v = [torch.zeros(n, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers)]
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    host = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu", device_capacity_tokens=n,
                                start_layer=0, end_layer=layers)
    host.kv_buffer.view(torch.int16).random_()
    return host


def config(root: str, extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                                enable_storage_metrics=False, is_page_first_layout=False, model_name="bench", extra_config=extra)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=128, help="pages per batch (SGLang's storage batch is 128)")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first_direct")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where both backends write (default: a temp dir)")
    args = ap.parse_args()

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from kvconnect.integrations.sglang import KVConnectStorage

    root = args.dir or tempfile.mkdtemp(prefix="sglang_storage_")
    host = pool(args.layout, args.layers, args.heads, args.head_dim, args.page_tokens, 2 * args.pages)
    page_bytes = host.get_size_per_token() * args.page_tokens
    batch_bytes = page_bytes * args.pages
    P = args.page_tokens
    src = torch.arange(0, args.pages * P)
    dst = torch.arange(args.pages * P, 2 * args.pages * P)
    rows = []

    def gbps(seconds):
        return batch_bytes / seconds / 1e9

    def ours(disk):
        extra = {"interface_v1": 1, "local_disk": disk, "max_local_disk_size": 4 * batch_bytes * args.repeat / 2**30 + 1,
                 "max_local_cpu_size": 4 * batch_bytes * args.repeat / 2**30 + 0.5}
        b = KVConnectStorage(config(root, extra), {})
        b.register_mem_pool_host(host)
        b.on_host_pools_registered()
        return b

    kv_dir = os.path.join(root, "kvconnect")
    rep = [0]

    def fresh_keys(tag):
        rep[0] += 1
        return [hashlib.sha256(f"{tag}{rep[0]}:{i}".encode()).hexdigest() for i in range(args.pages)]

    b = ours(kv_dir)
    stored = []

    def kv_set():
        ks = fresh_keys("kv")
        assert all(b.batch_set_v1(ks, src))
        stored.append(ks)

    def kv_set_flush():
        kv_set()
        assert b.flush(60)

    t_set = timed(kv_set, args.repeat)
    t_set_disk = timed(kv_set_flush, args.repeat)
    ks = stored[-1]
    t_get_pool = timed(lambda: b.batch_get_v1(ks, dst), args.repeat)
    t_exists_pool = timed(lambda: b.batch_exists(ks), args.repeat)
    b.close()
    b2 = ours(kv_dir)  # a fresh process' view: the pages are on disk only
    t_exists_disk = timed(lambda: b2.batch_exists(ks), 1)
    t_get_disk = timed(lambda: b2.batch_get_v1(stored[-2], dst), 1)
    missing = fresh_keys("never")
    t_miss = timed(lambda: b2.batch_exists(missing), args.repeat)
    b2.close()

    f_dir = os.path.join(root, "file")
    f = HiCacheFile(config(root, {"file_storage_path": f_dir}), file_path=f_dir)
    f_stored = []

    def file_set():
        ks = fresh_keys("file")
        data = [host.get_data_page(int(src[i * P])) for i in range(args.pages)]
        assert f.batch_set(ks, data)
        f_stored.append(ks)

    def file_get(ks):
        out = f.batch_get(ks, [host.get_dummy_flat_data_page() for _ in ks])
        for i, page in enumerate(out):
            host.set_from_flat_data_page(int(dst[i * P]), page)

    tf_set = timed(file_set, args.repeat)
    tf_get = timed(lambda: file_get(f_stored[-1]), args.repeat)
    tf_exists = timed(lambda: f.batch_exists(f_stored[-1]), args.repeat)
    tf_miss = timed(lambda: f.batch_exists(missing), args.repeat)

    rows += [
        ("set (into pool, disk write behind)", gbps(t_set), None),
        ("set + flush to disk", gbps(t_set_disk), gbps(tf_set)),
        ("get from pool", gbps(t_get_pool), None),
        ("get from disk (fresh backend)", gbps(t_get_disk), gbps(tf_get)),
    ]
    print(f"# {args.pages} pages x {page_bytes / 2**20:.2f} MiB ({args.layout}, {args.layers} layers, {args.heads}x{args.head_dim} bf16, "
          f"page {P} tokens) = {batch_bytes / 2**20:.0f} MiB per batch; median of {args.repeat}")
    print(f"{'operation':40s} {'kvconnect GB/s':>15s} {'file GB/s':>10s} {'ratio':>6s}")
    for name, a, f_ in rows:
        ratio = f"{a / f_:.2f}" if f_ else "-"
        print(f"{name:40s} {a:15.2f} {f_ if f_ is not None else float('nan'):10.2f} {ratio:>6s}")
    print(f"{'batch_exists, all hit (pool / disk)':40s} {t_exists_pool * 1e3:8.2f} / {t_exists_disk * 1e3:.2f} ms {tf_exists * 1e3:6.2f} ms")
    print(f"{'batch_exists, all miss':40s} {t_miss * 1e3:15.2f} ms {tf_miss * 1e3:6.2f} ms")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
