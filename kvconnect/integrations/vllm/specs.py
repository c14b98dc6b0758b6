"""What one vLLM (or vLLM-Ascend) cache spec becomes in kvconnect: its ``GroupSpec``.

Reads specs by class name and attribute, never importing vLLM. ``translate`` applies this to
every layer of every transferable vLLM group.

| vLLM spec (class name)                                  | kvconnect GroupSpec |
|---------------------------------------------------------|---------------------|
| FullAttentionSpec, MLAAttentionSpec, AscendMLAAttentionSpec, AscendSFAIndexerCacheSpec | full; compress ratio from ``compress_ratio`` (Ascend) or an integer ``tokens_per_state`` |
| SlidingWindowSpec, SlidingWindowMLASpec, AscendSlidingWindowMLASpec | window W, restore window = the tokens vLLM retains below a resume point (``retained_tokens``: W - 1, plus ``extra_retained_tokens`` under multi-module MTP; vLLM 0.33 names the sum ``num_retained_tokens``); ``window_free_every`` N where the release's table has a proven rule for the spec on the tensors' device (``engine_tables.WindowFree``: DeepSeek V4's C128 compressor state, N = 128, CPU and CUDA) |
| Compress4AttentionSpec, Compress128AttentionSpec (vLLM-Ascend 0.13 only: ``EngineRelease.compressed_full_specs``) | full, compress ratio 4 / 128; tensors of ``num_blocks // ratio`` blocks (the release's per-group pools) |
| UniformTypeKVCacheSpecs                                 | per layer, by the rules above |
| RSWASpec (R-SWA: Unlimited-OCR)                         | full, with ``PROMPT_ONLY``: only chunks wholly inside the storing request's prompt are stored (``prompt_only_reason``) |
| MambaSpec (Gated DeltaNet, Mamba), ``mamba_cache_mode`` "align" | STATE group of the spec's block size: one state page per block, its snapshot at a restore point P is row P / B - 1 (``recurrent``); other modes refused |
| CircularBufferSpec (per-request rings), SlidingWindowMLASpec with ``bounded_replay`` (DeepSeek V4.1) | no GroupSpec: engine-rebuilt groups (``rebuilt``), in the layout's identity with no bytes; ``translate`` never asks this module for them |
| a spec in ``REFUSED_SPECS`` (SinkFullAttentionSpec, ...) | ``UnsupportedLayoutError`` naming the spec and the reason: the connector stays off |
| anything else (a spec class this module has never seen)  | ``UnsupportedLayoutError``: the connector stays off |

Every spec class of the installed vLLM / vLLM-Ascend must be in ``KNOWN_SPECS`` (served, refused
with a reason, or an abstract base): tests/integration/test_vllm_spec_classes.py and
tests/ascend/test_spec_classes.py enumerate the engine's classes, so a new one fails CI.

Fields that change which rows a hit needs, or whether one is possible, are rules too
(``SPEC_FIELDS``; tests/test_vllm_spec_field_rules.py checks each rule, and
tests/integration/test_vllm_spec_fields.py which installed release carries which field).

What a spec's ``block_size`` counts depends on the engine release (``engine_tables``):
vLLM-Ascend 0.23 counts compressed blocks in rows, vLLM in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

from kvconnect.errors import UnsupportedLayoutError
from kvconnect.layout.spec import GroupSpec

from . import engine_tables, rebuilt, recurrent
from .engine_tables import EngineRelease

_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec", "AscendMLAAttentionSpec", "AscendSFAIndexerCacheSpec"})
_WINDOW_SPECS = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec", "AscendSlidingWindowMLASpec"})
_CONTAINER_SPECS = frozenset({"UniformTypeKVCacheSpecs"})
_ABSTRACT_SPECS = frozenset({"KVCacheSpec", "AttentionSpec"})  # bases: never a layer's spec

PROMPT_ONLY = ("a generated token's KV is computed with a restricted window (it attends the prompt and the last "
               "rswa_window tokens; vLLM's RSWAManager frees the blocks between them), while the same token in a "
               "later prompt attends every token before it: only chunks wholly inside the storing request's "
               "prompt are stored (save_decode_cache is off), so every hit is prompt-computed KV")
PROMPT_ONLY_SPECS = frozenset({"RSWASpec"})
"""Specs served as full groups under ``PROMPT_ONLY`` (``prompt_only_reason``): Reference Sliding
Window Attention (Unlimited-OCR). vLLM never frees a prompt block of theirs (``RSWAManager``:
gap blocks start at ceil(prompt / B)), so a prompt chunk's rows are there until the request ends."""

_NOT_A_PREFIX = ("vLLM never serves it from its prefix cache either (prefix_cacheable False): its blocks are "
                 "per request, not per token position")
REFUSED_SPECS = {
    "ChunkedLocalAttentionSpec": "chunked local attention (Llama 4): vLLM frees blocks of past chunks, so a stored "
                                 "chunk would mix a restore point's rows with rows the layer no longer attends; "
                                 "no restore rule was proven",
    "CrossAttentionSpec": "cross attention (Whisper, encoder-decoder models): its rows are the encoder's output, not the "
                          "prompt's tokens, so no token-keyed chunk describes them",
    "EncoderOnlyAttentionSpec": "encoder-only attention allocates no KV cache",
    "SinkFullAttentionSpec": "static sink attention (openPangu): vLLM 0.32's and 0.33's own Scheduler cannot build "
                             "its SinkFullAttentionManager (TypeError: unexpected keyword argument "
                             "needs_kv_cache_zeroing, which the KV-cache coordinator gives every manager), so no "
                             "model with this spec runs on these releases; and nothing in them reserves the blocks "
                             "1 .. sink_len / B the layer writes its sink rows into (slots B .. B + sink_len - 1): "
                             "the manager itself maps a request's block b to tokens b x B .. (b + 1) x B - 1 and "
                             "gives the first request exactly those blocks, so no restore rule can be shown until "
                             "a release runs it",
    "HiddenStateCacheSpec": "hidden states for extract_hidden_states (speculative decoding), read by vLLM's own "
                            "hidden-states connector: not a KV cache",
    "HiSparseHotSpec": "HiSparse's per-request hot cache (sparse MLA with host-backed KV): " + _NOT_A_PREFIX,
    "HiSparseResidentSpec": "HiSparse's reclaimable resident pages, filled from host memory by HiSparse's own "
                            "connector: " + _NOT_A_PREFIX,
    "TQFullAttentionSpec": "TurboQuant packed slots (vLLM 0.23, tq_slot_size bytes a token): the in-block layout "
                           "was not checked against its writer",
}
"""Spec classes refused by name, with why (docs/vllm.md "Cache specs")."""


TP_REPLICATED_SPECS = frozenset({"MLAAttentionSpec", "SlidingWindowMLASpec", "AscendMLAAttentionSpec",
                                 "AscendSlidingWindowMLASpec", "AscendSFAIndexerCacheSpec"})
"""Specs whose cache is the same on every TP rank: MLA latents, DeepSeek V4's compressed and SWA
latents and compressor states, the V3.2 / V4 indexer K (one head from replicated weights)."""


@dataclass(frozen=True)
class SpecField:
    """One field of vLLM's KV-cache description and kvconnect's rule for it (``SPEC_FIELDS``).

    owner: the spec classes that carry it, or ``VllmConfig`` for a config property.
    releases: the vLLM releases that have it (tests/integration/test_vllm_spec_fields.py reads
        the installed vLLM and fails where this says otherwise).
    rule: ``restore_window`` (it sets the tokens a windowed group restores: ``retained_tokens``),
        ``rows_unchanged`` (it changes no stored row and no row a hit needs), or
        ``refused_unless_zero`` (a non-zero value turns the connector off: ``config_refusal``).
    """

    name: str
    owner: frozenset
    releases: frozenset
    rule: str
    why: str

    RULES = ("restore_window", "rows_unchanged", "refused_unless_zero")

    def __post_init__(self) -> None:
        if self.rule not in self.RULES:
            raise ValueError(f"spec field {self.name}: rule {self.rule!r} is not one of {self.RULES}")


_SWA = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec"})
SPEC_FIELDS = (
    SpecField("extra_retained_tokens", _SWA, frozenset({"0.32", "0.33"}), "restore_window",
              "multi-module MTP re-prefills the last num_prefill_lookahead_tokens - 1 tokens, so vLLM keeps that "
              "many tokens' blocks below the window (SlidingWindowManager.get_num_skipped_tokens) and allocates "
              "them for an external hit: kvconnect restores W - 1 + extra_retained_tokens trailing tokens"),
    SpecField("num_retained_tokens", _SWA, frozenset({"0.33"}), "restore_window",
              "vLLM 0.33's name for W - 1 + extra_retained_tokens: the tokens below a request's first scheduled "
              "position attention may still read (its worker nulls block-table entries below them); read where "
              "present, else computed from the fields as 0.32 does"),
    SpecField("topk_buffer_width", frozenset({"MLAAttentionSpec"}), frozenset({"0.33"}), "rows_unchanged",
              "the width of sparse MLA's per-step top-k index buffer (GLM-5-Next: index_topk + kpool - 1, rounded "
              "up to 128; HiSparse sizes its device buffer by it): a read-side buffer, not cache rows; a sparse "
              "layer selects among every row of the prefix, so the group is restored as a full group"),
    SpecField("num_hash_lookahead_tokens", frozenset({"VllmConfig"}), frozenset({"0.33"}), "refused_unless_zero",
              "with EAGLE block drop vLLM 0.33 may extend each block's hash over the next L tokens (the drafter's "
              "row at a block's last position reads that far ahead) and then checkpoints Mamba state L tokens "
              "earlier; kvconnect's chunks are keyed by their own tokens and its restore points assume the legacy "
              "hashes. vLLM itself sets L = 0 whenever a KV connector is configured (VllmConfig."
              "num_hash_lookahead_tokens), so this never fires under vLLM's own config"),
)
"""Fields of vLLM's KV-cache description with a rule here (docs/vllm.md, "Cache specs")."""


def prompt_only_reason(vllm_config: Any, kv_cache_config: Any) -> Optional[str]:
    """Why only chunks wholly inside a request's prompt may be stored for this model (``PROMPT_ONLY``;
    None: no such rule): a layer's spec is in ``PROMPT_ONLY_SPECS``, or the model config sets
    ``rswa_window`` (vLLM's attention backends window every decode token of such a model)."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        for layer_spec in (spec.kv_cache_specs.values() if type(spec).__name__ == "UniformTypeKVCacheSpecs" else (spec,)):
            if type(layer_spec).__name__ in PROMPT_ONLY_SPECS:
                return f"{type(layer_spec).__name__} (rswa_window {getattr(layer_spec, 'rswa_window', None)}): {PROMPT_ONLY}"
    window = getattr(getattr(vllm_config, "model_config", None), "rswa_window", None)
    if window is not None:
        return f"ModelConfig.rswa_window {window}: {PROMPT_ONLY}"
    return None


def retained_tokens(spec: Any) -> int:
    """Tokens a sliding-window group needs (and vLLM keeps) below a resume point: vLLM 0.33's
    ``num_retained_tokens``, or, on releases without it, ``sliding_window - 1 + extra_retained_tokens``."""
    retained = getattr(spec, "num_retained_tokens", None)
    if retained is None:
        retained = int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return int(retained)


def config_refusal(vllm_config: Any) -> Optional[str]:
    """Why a ``refused_unless_zero`` config field turns kvconnect off for this config; None when none does."""
    for field in SPEC_FIELDS:
        if field.rule != "refused_unless_zero" or "VllmConfig" not in field.owner:
            continue
        value = getattr(vllm_config, field.name, 0) or 0
        if value:
            return f"VllmConfig.{field.name} = {value}: {field.why}"
    return None


def _compress_ratio(spec: Any) -> int:
    ratio = getattr(spec, "compress_ratio", None)  # vLLM-Ascend; vLLM 0.23 MLAAttentionSpec
    if ratio is None:
        per_state = getattr(spec, "tokens_per_state", 1)  # vLLM: tokens per stored state
        if isinstance(per_state, Fraction) and per_state.denominator != 1:
            raise UnsupportedLayoutError(f"{type(spec).__name__}: {per_state} tokens per state (several states per token)")
        ratio = int(per_state)
    return max(1, int(ratio))


def _block_tokens(spec: Any, ratio: int, release: EngineRelease) -> int:
    """Tokens one engine block of a spec covers, by what the release's ``block_size`` counts."""
    block_size = int(spec.block_size)
    if ratio == 1:
        return block_size
    if release.compressed_block_unit == "rows":
        return block_size * ratio  # vLLM-Ascend 0.23: block_size rows, each `ratio` tokens
    rows = getattr(spec, "storage_block_size", None)
    if rows is not None and int(rows) * ratio != block_size:
        raise UnsupportedLayoutError(
            f"{type(spec).__name__}: block_size {block_size} tokens with storage_block_size {rows} rows "
            f"at compress ratio {ratio} ({release.name} counts block_size in tokens)")
    return block_size


def group_spec_of(spec: Any, release: EngineRelease = engine_tables.VLLM, kernel_split: int = 1,
                  device_type: Optional[str] = None) -> GroupSpec:
    """The kvconnect GroupSpec of one vLLM per-layer spec (see the table in the module doc).

    kernel_split: the registered tensor holds each vLLM block as this many kernel blocks;
    the GroupSpec then describes one kernel block.
    device_type: the registered tensor's device type; the release's window-free rules
    (``EngineRelease.window_free``) apply only on the device types they were shown on
    (None: no rule).
    """
    name = type(spec).__name__
    if recurrent.is_state_spec(spec):
        if release.recurrent_refusal:
            raise UnsupportedLayoutError(f"{name}: {release.recurrent_refusal}")
        return recurrent.state_group_spec(spec)
    if getattr(spec, "sfa_dcp_replicated_indexer_size", 1) > 1:
        raise UnsupportedLayoutError(
            f"{name}: the indexer cache is replicated over {spec.sfa_dcp_replicated_indexer_size} decode-context "
            f"ranks (num_blocks x {spec.sfa_dcp_replicated_indexer_size} blocks); which rank's tokens a block holds "
            f"is not described by the spec")
    if name in REFUSED_SPECS:
        raise UnsupportedLayoutError(f"vLLM cache spec {name} is not supported: {REFUSED_SPECS[name]}; "
                                     f"kvconnect stays off for this model")
    if rebuilt.is_rebuilt(spec):
        raise UnsupportedLayoutError(f"{name}: an engine-rebuilt group (vLLM rebuilds it after a hit) has no stored "
                                     f"rows; its layout is kvconnect.integrations.vllm.rebuilt's, not a GroupSpec")
    ratio = _compress_ratio(spec)
    tokens = _block_tokens(spec, ratio, release) // max(1, kernel_split)
    if name in _WINDOW_SPECS:
        window = int(spec.sliding_window)
        # vLLM frees blocks whose tokens are all before P - retained (get_num_skipped_tokens), so
        # the retained tokens (W - 1, plus MTP's extra ones: SPEC_FIELDS) are what it keeps and reads.
        return GroupSpec(block_size=tokens, compress_ratio=ratio,
                         sliding_window=window, restore_window=max(1, retained_tokens(spec)),
                         window_free_every=release.window_free_every(spec, device_type))
    if name in _FULL_SPECS or name in PROMPT_ONLY_SPECS or name in release.compressed_full_specs:
        # PROMPT_ONLY_SPECS: a full group whose stored chunks are all prompt-computed (prompt_only_reason).
        # A sliding or chunked-local layer under a FullAttentionSpec (hybrid allocator off)
        # keeps blocks for every token, so it is restored as a full group.
        return GroupSpec(block_size=tokens, compress_ratio=ratio)
    raise UnsupportedLayoutError(
        f"vLLM cache spec {name} is not supported (a spec kvconnect has no restore rule for cannot be "
        f"restored exactly); kvconnect stays off for this model"
    )


def known_specs(release: EngineRelease = engine_tables.VLLM) -> frozenset:
    """Every spec class name this module has a rule for on ``release`` (served, refused by name,
    or an abstract base): an engine spec class outside it is one nobody has looked at."""
    return (_FULL_SPECS | _WINDOW_SPECS | _CONTAINER_SPECS | recurrent.STATE_SPECS | _ABSTRACT_SPECS
            | PROMPT_ONLY_SPECS | rebuilt.RING_SPECS | frozenset(REFUSED_SPECS) | release.compressed_full_specs)



def layer_spec_of(group_spec: Any, layer_name: str) -> Any:
    """The spec of one layer of a group (a UniformTypeKVCacheSpecs holds one per layer)."""
    if type(group_spec).__name__ == "UniformTypeKVCacheSpecs":
        return group_spec.kv_cache_specs[layer_name]
    return group_spec


def num_heads_of(spec: Any) -> int:
    """A layer's KV heads as its spec counts them: ``num_head_slots`` where the spec has it, else ``num_kv_heads``."""
    slots = getattr(spec, "num_head_slots", None)
    return int(slots if slots is not None else getattr(spec, "num_kv_heads", 1))
