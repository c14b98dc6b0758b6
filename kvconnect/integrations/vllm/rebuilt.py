"""vLLM's engine-rebuilt groups: cache groups of which kvconnect stores no byte, because vLLM
rebuilds them itself after any prefix hit, its own or a connector's.

vLLM's contract (0.32 and 0.33): ``KVCacheConfig.prefix_cacheable_group_ids`` are the groups a
hash-addressed store holds; ``KVConnectorBase_V1.get_loaded_kv_cache_group_ids`` (default: those
groups, which kvconnect keeps) tells the scheduler which groups a load restored; for the others it
claims a fresh ring block or replays the bounded window. kvconnect adopts it: these groups are
part of the layout's identity (``layout.spec.RebuiltGroup``: class and shape in the fingerprint),
carry no bytes, and a hit is offered only where vLLM can rebuild every one of them
(``KVLayout.resume_every``; the restore gate enforces it, and the scheduler asks for hits that
leave the last prompt token to compute, so vLLM never trims a hit below it).

| vLLM spec | models (registering code) | what vLLM does after a hit at H | hits kvconnect offers |
|---|---|---|---|
| ``CircularBufferSpec`` | DeepSeek V4.1's ratio-2 compressor state (``deepseek_v41/compressor.py``: capacity max(8, 2^k) >= drafts + 2), Qwen4-exp's QSA raw-key ring (capacity = ratio x ceil((ratio + drafts) / ratio)), GLM-5-Next's kpool tail (kpool x 2^k), Step5's CSA tail ring (0.33; declares the main block size, a multiple of its 8-row region); DeepSeek V4's C128 state if vLLM PR 58074 lands (``engine_tables.DSV4_C128_STATE``) | ``CircularBufferManager`` claims one fresh block per request (never from a cache, never zeroed); the model reads ring rows only of the open (not yet compressed) group | H a multiple of the ring's ``block_size``: each registering model sizes it as whole groups, so the open group is empty at H and every ring row read afterwards is written after H |
| ``SlidingWindowMLASpec`` with ``bounded_replay`` | DeepSeek V4.1's SWA | trims an external hit to a multiple of the scheduler block size, then recomputes [H - W, H) (``Scheduler._mark_prefix_replay``), writing only the window group | H a multiple of the scheduler block size (the lcm of every group's block size, DCP-scaled as vLLM's ``resolve_kv_cache_block_sizes``), so vLLM trims nothing |

Exactness under bounded replay: the replay makes a kvconnect hit at H compute exactly what vLLM's
own prefix-cache hit at H computes (same restored groups, same replayed window); vLLM does not
promise that this equals a cold run bit for bit (docs/vllm.md, "Engine-rebuilt groups").
"""

from __future__ import annotations

import math
from typing import Any, Optional

from kvconnect.errors import UnsupportedLayoutError
from kvconnect.layout.spec import RebuiltGroup

from . import engine_tables, recurrent
from .engine_tables import EngineRelease

RING_SPECS = frozenset({"CircularBufferSpec"})
"""Per-request rings of the open compression group (vLLM's ``CircularBufferManager``)."""


def is_rebuilt(spec: Any) -> bool:
    """Whether vLLM rebuilds a layer's cache after a hit (kvconnect stores none of it)."""
    return type(spec).__name__ in RING_SPECS or bool(getattr(spec, "bounded_replay", False))


def _group_specs(group_spec: Any) -> list:
    if type(group_spec).__name__ == "UniformTypeKVCacheSpecs":
        return list(group_spec.kv_cache_specs.values())
    return [group_spec]


def scheduler_block_tokens(kv_cache_config: Any, dcp_size: int = 1) -> int:
    """vLLM's scheduler block size: the lcm of every group's block size (attention groups
    scaled by DCP, as ``resolve_dcp_kv_block_size``); one group: its block size x DCP."""
    sizes = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        sharded = getattr(spec, "dcp_sharded", True) and not recurrent.is_state_spec(spec)
        sizes.append(int(spec.block_size) * (dcp_size if sharded else 1))
    return math.lcm(*sizes) if sizes else 1


def _describe(spec: Any) -> str:
    name = type(spec).__name__
    dtype = str(getattr(spec, "dtype", None)).replace("torch.", "")
    shape = (f"{name}(block {spec.block_size}, heads {getattr(spec, 'num_kv_heads', None)}, "
             f"head {getattr(spec, 'head_size', None)}, {dtype}")
    if getattr(spec, "bounded_replay", False):
        shape += f", window {spec.sliding_window}, bounded replay, {getattr(spec, 'cache_dtype_str', None)}"
    return shape + ")"


def _resume_every(spec: Any, scheduler_block: int, release: EngineRelease) -> int:
    if type(spec).__name__ in RING_SPECS:
        # each registering model sizes its ring as whole groups: its period divides block_size;
        # a ring the release's tables know (DeepSeek V4's C128 state) adds that rule's period
        return math.lcm(int(spec.block_size), release.ring_every(spec) or 1)
    return scheduler_block  # bounded replay: vLLM trims an external hit to this


def rebuilt_groups(kv_cache_config: Any, release: EngineRelease = engine_tables.VLLM,
                   dcp_size: int = 1) -> tuple[RebuiltGroup, ...]:
    """The engine-rebuilt groups of a vLLM cache config, in group order (see the module table).

    Every group is looked at, transferable or not: a ring vLLM rebuilds restricts where a hit may
    land whether or not a connector moves its blocks. A group mixing rebuilt and stored layers is
    refused (no vLLM model registers one)."""
    scheduler_block = scheduler_block_tokens(kv_cache_config, dcp_size)
    out = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        layer_specs = _group_specs(group.kv_cache_spec)
        rebuilt = [is_rebuilt(s) for s in layer_specs]
        if not any(rebuilt):
            continue
        if not all(rebuilt):
            raise UnsupportedLayoutError(
                f"vLLM group {index} mixes engine-rebuilt and stored layers "
                f"({sorted({type(s).__name__ for s in layer_specs})}); kvconnect stays off for this model")
        kinds = sorted({_describe(s) for s in layer_specs})
        every = math.lcm(*(_resume_every(s, scheduler_block, release) for s in layer_specs))
        out.append(RebuiltGroup(what=f"{'; '.join(kinds)} x {len(group.layer_names)} layers", resume_every=every))
    return tuple(out)


def rebuilt_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """vLLM group ids of the engine-rebuilt groups (none stored, none loaded)."""
    if kv_cache_config is None:
        return ()
    return tuple(i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                 if any(is_rebuilt(s) for s in _group_specs(g.kv_cache_spec)))


def resume_every_of(kv_cache_config: Optional[Any], release: EngineRelease = engine_tables.VLLM,
                    dcp_size: int = 1) -> int:
    """Tokens a hit must be a multiple of for this cache config (1: no rebuilt group)."""
    if kv_cache_config is None:
        return 1
    return math.lcm(1, *(r.resume_every for r in rebuilt_groups(kv_cache_config, release, dcp_size)))
