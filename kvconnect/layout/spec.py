"""Value objects that describe a paged KV cache: groups, planes and sharding.

A *group* is a set of layers that share one block table (one list of block ids per
request). A *plane* is one tensor of paged memory: dim 0 indexes engine blocks, dim 1
indexes rows within a block, and the remaining dims form one contiguous row. A layer
has one or more planes (K and V; MLA nope + rope; indexer + scale).

Sub-planes. Some engines do not keep a row's fields together: vLLM's DeepSeek V4
``fp8_ds_mla`` block holds all its rows' 576 data bytes first, then all their 8 scale bytes
(``[rows x 576][rows x 8]``). ``RowRegions`` describes such a block; each region is then a
plane of its own (a *sub-plane*: same blocks and rows, its own in-block offset and row
stride), so a copy of any row range takes each field from where the engine wrote it.

Row arithmetic. A plane stores one row per ``tokens_per_row`` tokens:
- token planes: ``tokens_per_row = compress_ratio`` (1 for plain attention),
- page planes (opaque per-block pages, recurrent state): ``tokens_per_row = block_size``.
A row belongs to its last token; rows for tokens [a, b) are ``[a // tpr, b // tpr)``
(vLLM counts compressed rows with floor).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType, Optional

from ..errors import LayoutError

ChunkKey = NewType("ChunkKey", bytes)
"""16-byte key of one chunk: a prefix hash chain over token ids, namespaced by layout."""

Fingerprint = NewType("Fingerprint", bytes)
"""16-byte digest of everything that decides the bytes of a stored chunk."""


class GroupKind(enum.Enum):
    """What a group needs to resume computing at a prefix boundary P."""

    ATTENTION = "attention"  # full (rows [0, P)) or sliding window (rows [P-W, P))
    STATE = "state"  # a recurrent-state snapshot taken exactly at P (one page per block)


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One KV-cache group as the engine allocates it.

    block_size: tokens per engine block, as engines count them.
    compress_ratio: tokens per stored row (1 = a row per token).
    sliding_window: tokens of history the group reads; None = full attention.
    restore_window: tokens of trailing history that must be present to resume at a
        boundary (default: the sliding window). An adapter may set it smaller when the
        engine's kernel provably needs less (e.g. non-overlapping compressor windows).
    window_free_every: restore window 0 tokens at restore points that are multiples of this
        many (global) tokens; the full restore window at every other point (never assumed).
        An adapter sets it per engine release where a bench on the real forward showed the
        group is never read there (vLLM DeepSeek V4's C128 compressor state: 128). None: no rule.
    kind: ATTENTION, or STATE for recurrent state whose snapshot per block is one page.
    """

    block_size: int
    compress_ratio: int = 1
    sliding_window: Optional[int] = None
    restore_window: Optional[int] = None
    window_free_every: Optional[int] = None
    kind: GroupKind = GroupKind.ATTENTION

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise LayoutError(f"block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.compress_ratio, int) or self.compress_ratio <= 0:
            raise LayoutError(f"compress_ratio must be a positive int, got {self.compress_ratio!r}")
        if self.kind is GroupKind.ATTENTION and self.block_size % self.compress_ratio:
            raise LayoutError(
                f"block_size {self.block_size} is not a multiple of compress_ratio "
                f"{self.compress_ratio}: a block must hold whole compressed rows"
            )
        for name in ("sliding_window", "restore_window", "window_free_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise LayoutError(f"{name} must be a positive int or None, got {value!r}")
        if self.kind is GroupKind.STATE and (self.sliding_window or self.restore_window):
            raise LayoutError("a STATE group has no window: its snapshot is taken per block")
        if self.restore_window is not None and self.sliding_window is None:
            raise LayoutError("restore_window needs a sliding_window (full groups restore everything)")
        if self.window_free_every is not None and self.sliding_window is None:
            raise LayoutError("window_free_every needs a sliding_window (full groups restore everything)")

    @property
    def rows_per_block(self) -> int:
        """Rows of a token plane in one block of this group."""
        if self.kind is GroupKind.STATE:
            return 1
        return self.block_size // self.compress_ratio

    @property
    def window_tokens(self) -> Optional[int]:
        """Trailing tokens needed to resume at a boundary, or None for all of them."""
        if self.kind is GroupKind.STATE:
            return self.block_size
        return self.restore_window if self.restore_window is not None else self.sliding_window

    @property
    def is_windowed(self) -> bool:
        return self.window_tokens is not None


class ShardKind(enum.Enum):
    """How a group's KV is split over tensor-parallel ranks (``TPShard``)."""

    REPLICATED = "replicated"  # every rank holds the same rows: no TP in the identity
    HEADS = "heads"  # the rank holds a range of global heads (channels): the identity carries the range
    RANGES = "ranges"  # each row is fields of global unit ranges (a GDN state page): the identity carries them
    RANK = "rank"  # split in a way kvconnect does not describe: the identity carries rank and size


@dataclass(frozen=True)
class ShardField:
    """One field of a row split over TP ranks by global unit ranges (a ``ShardKind.RANGES`` shard).

    The field's global tensor is ``outer`` x ``sum(blocks)`` units x ``unit_bytes``: ``outer``
    repeats (the dims before the split axis), then the split axis, whose units form consecutive
    *blocks* that tensor parallelism splits evenly (vLLM's ``mamba_v2_sharded_weight_loader``:
    a GDN conv state's q, k and v channels are three blocks; its recurrent state's value heads
    one), then ``unit_bytes`` of the dims after it. A rank holds, per block, its even share;
    its bytes are, for each outer index, its ``ranges`` of units one after the other. Adjacent
    ranges are merged (TP 1 holds ``((0, total),)``), so equal ranges are equal bytes.

    Example (the tiny Qwen3.5's conv state, SD layout (3, 512) bf16, q/k/v = 128/128/256, TP 2 rank 1)::

        ShardField.even(outer=3, unit_bytes=2, blocks=(128, 128, 256), tp_rank=1, tp_size=2).ranges
        # ((64, 128), (192, 256), (384, 512))
    """

    outer: int
    unit_bytes: int
    blocks: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        ints = [self.outer, self.unit_bytes, *self.blocks, *(v for r in self.ranges for v in r)]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise LayoutError(f"ShardField fields must be ints, got {self!r}")
        if self.outer < 1 or self.unit_bytes < 1 or not self.blocks or min(self.blocks) < 1 or not self.ranges:
            raise LayoutError(f"ShardField needs outer, unit bytes, blocks and ranges >= 1, got {self!r}")
        merged: list[list[int]] = []
        for a, b in self.ranges:
            if not 0 <= a < b <= self.total:
                raise LayoutError(f"range [{a}, {b}) is not within the field's {self.total} units")
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        held = sorted(self.ranges)
        if any(b > c for (_, b), (c, _) in zip(held, held[1:])):
            raise LayoutError(f"ranges {self.ranges} overlap: a unit is held once")
        object.__setattr__(self, "ranges", tuple((a, b) for a, b in merged))

    @classmethod
    def even(cls, *, outer: int, unit_bytes: int, blocks: tuple[int, ...], tp_rank: int, tp_size: int) -> "ShardField":
        """Rank ``tp_rank`` of ``tp_size``'s field: ``block / tp_size`` consecutive units of each
        block. A size that does not split every block raises."""
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise LayoutError(f"TP rank {tp_rank} is not in [0, {tp_size})")
        ranges, at = [], 0
        for block in blocks:
            if block % tp_size:
                raise LayoutError(f"a block of {block} units does not split over TP {tp_size}")
            per = block // tp_size
            ranges.append((at + tp_rank * per, at + (tp_rank + 1) * per))
            at += block
        return cls(outer, unit_bytes, tuple(blocks), tuple(ranges))

    @property
    def total(self) -> int:
        return sum(self.blocks)

    @property
    def units(self) -> int:
        return sum(b - a for a, b in self.ranges)

    @property
    def row_bytes(self) -> int:
        """This rank's bytes of the field in one row."""
        return self.outer * self.units * self.unit_bytes

    def at(self, tp_rank: int, tp_size: int) -> "ShardField":
        """The same field as rank ``tp_rank`` of ``tp_size`` holds it."""
        return ShardField.even(outer=self.outer, unit_bytes=self.unit_bytes, blocks=self.blocks,
                               tp_rank=tp_rank, tp_size=tp_size)

    def geometry(self) -> list:
        """The TP-free part (model identity): the global field."""
        return [self.outer, self.unit_bytes, list(self.blocks)]

    def identity(self) -> list:
        return [*self.geometry(), [list(r) for r in self.ranges]]


@dataclass(frozen=True)
class TPShard:
    """What of one group's KV a tensor-parallel rank holds: the part identity its stored
    objects are named by (docs/design.md, "The identity of a chunk").

    - ``replicated()``: every rank holds the same rows (MLA latents, indexer K, DeepSeek V4's
      groups). Nothing of TP enters the identity: any TP size reads what any other wrote.
    - ``heads(first, count, total)``: the rank holds global heads [first, first + count) of
      ``total`` (GQA/MHA K and V, sliding-window layers). Each of its planes' rows is ``count``
      equal head slices in global head order. The identity carries the range, not the rank:
      ranks of any TP size that hold the same heads hold the same bytes.
    - ``ranges(fields)``: each row is ``fields`` (``ShardField``) of global unit ranges, one
      after the other (vLLM's Gated DeltaNet state page: the conv state's q, k and v channel
      slices, then the recurrent state's value heads). The identity carries every field's
      global geometry and ranges: ranks of any TP size holding the same ranges hold the same
      bytes, and a rank of another size finds the ranges it owns in the objects of the ranks
      that hold them.
    - ``rank(rank, size)``: any other split (one a layout does not describe, e.g. Mamba2's
      replicated groups): strict, read only by the same rank of the same TP size.

    Example (vLLM's split of 2 KV heads over TP 4: ranks 0 and 1 both hold head 0)::

        TPShard.of_kv_heads(2, tp_rank=1, tp_size=4)  # TPShard(HEADS, first=0, count=1, total=2)
    """

    kind: ShardKind
    first: int = 0
    count: int = 1
    total: int = 1
    fields: tuple[ShardField, ...] = ()  # RANGES only: the row's fields, in row order

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) for v in (self.first, self.count, self.total)):
            raise LayoutError(f"TPShard fields must be ints, got {self!r}")
        if (self.kind is ShardKind.RANGES) != bool(self.fields):
            raise LayoutError("a RANGES TPShard, and only it, has fields")
        if self.kind is ShardKind.RANGES:
            if any(not isinstance(f, ShardField) for f in self.fields) or (self.first, self.count, self.total) != (0, 1, 1):
                raise LayoutError(f"a RANGES TPShard is its ShardFields only, got {self!r}")
            object.__setattr__(self, "fields", tuple(self.fields))
        if self.kind is ShardKind.REPLICATED and (self.first, self.count, self.total) != (0, 1, 1):
            raise LayoutError("a replicated TPShard has no range")
        if self.kind is ShardKind.HEADS and not (self.count >= 1 and 0 <= self.first and self.first + self.count <= self.total):
            raise LayoutError(f"heads [{self.first}, {self.first + self.count}) are not within the {self.total} global heads")
        if self.kind is ShardKind.RANK and not (self.count == 1 and 0 <= self.first < self.total):
            raise LayoutError(f"TP rank {self.first} is not in [0, {self.total})")

    @classmethod
    def replicated(cls) -> "TPShard":
        return cls(ShardKind.REPLICATED)

    @classmethod
    def heads(cls, first: int, count: int, total: int) -> "TPShard":
        return cls(ShardKind.HEADS, first, count, total)

    @classmethod
    def rank(cls, rank: int, size: int) -> "TPShard":
        return cls(ShardKind.RANK, rank, 1, size)

    @classmethod
    def ranges(cls, fields) -> "TPShard":
        return cls(ShardKind.RANGES, fields=tuple(fields))

    @classmethod
    def of_kv_heads(cls, total_heads: int, *, tp_rank: int, tp_size: int) -> "TPShard":
        """The global KV heads vLLM gives TP rank ``tp_rank`` of ``tp_size`` (``QKVParallelLinear``):
        ``total / size`` consecutive heads each when ``total >= size``; else one head, each head held
        by ``size / total`` consecutive ranks. A split vLLM refuses (neither divides) raises."""
        if total_heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise LayoutError(f"no KV head split for {total_heads} heads at TP rank {tp_rank} of {tp_size}")
        if total_heads >= tp_size:
            if total_heads % tp_size:
                raise LayoutError(f"{total_heads} KV heads do not split over TP {tp_size}")
            per = total_heads // tp_size
            return cls.heads(tp_rank * per, per, total_heads)
        if tp_size % total_heads:
            raise LayoutError(f"TP {tp_size} does not replicate {total_heads} KV heads evenly")
        return cls.heads(tp_rank // (tp_size // total_heads), 1, total_heads)

    @property
    def end(self) -> int:
        return self.first + self.count

    @property
    def row_bytes(self) -> int:
        """Bytes of a RANGES shard's row (its fields')."""
        return sum(f.row_bytes for f in self.fields)

    def at(self, tp_rank: int, tp_size: int) -> "TPShard":
        """This group's part identity at rank ``tp_rank`` of TP size ``tp_size``: replicated stays,
        heads as vLLM splits the global heads, ranges as each field splits; a size that does not
        split them, or a group keyed by rank, raises."""
        if self.kind is ShardKind.REPLICATED:
            return self
        if self.kind is ShardKind.HEADS:
            return TPShard.of_kv_heads(self.total, tp_rank=tp_rank, tp_size=tp_size)
        if self.kind is ShardKind.RANGES:
            return TPShard.ranges(f.at(tp_rank, tp_size) for f in self.fields)
        raise LayoutError("a group keyed by rank has no part at another TP rank or size")

    def row_fields(self, row_bytes: int) -> Optional[tuple[ShardField, ...]]:
        """A plane's row of ``row_bytes`` as fields of global units (None: keyed by rank): one field
        of ``count`` heads for a head-sharded group, one whole unit for a replicated one."""
        if self.kind is ShardKind.RANGES:
            return self.fields if self.row_bytes == row_bytes else None
        if self.kind is ShardKind.HEADS:
            if row_bytes % self.count:
                return None
            return (ShardField(1, row_bytes // self.count, (self.total,), ((self.first, self.end),)),)
        if self.kind is ShardKind.REPLICATED:
            return (ShardField(1, row_bytes, (1,), ((0, 1),)),)
        return None

    def identity(self) -> list:
        """What enters the fingerprint: nothing of TP for a replicated group."""
        if self.kind is ShardKind.REPLICATED:
            return ["replicated"]
        if self.kind is ShardKind.RANGES:
            return [self.kind.value, [f.identity() for f in self.fields]]
        return [self.kind.value, self.first, self.count, self.total]


@dataclass(frozen=True, kw_only=True)
class RebuiltGroup:
    """A cache group the engine rebuilds itself after a hit: part of a layout's identity, no bytes.

    vLLM keeps such groups out of prefix caching (``prefix_cacheable`` False) and rebuilds them
    after any hit: a per-request ring (``CircularBufferSpec``) is claimed fresh and holds only the
    open, not yet compressed token group, empty at a multiple of the group's period; a
    bounded-replay window (DeepSeek V4.1's SWA) is recomputed by the scheduler over the hit's last
    window. kvconnect stores none of their bytes; they enter the fingerprint (a store made under
    another layout is never read) and restrict where a hit may land.

    what: the engine's description of the group (spec class, shape, dtype, layers), fingerprinted.
    resume_every: a restore point must be a multiple of this many (global) tokens (1: anywhere).
    """

    what: str
    resume_every: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.what, str) or not self.what:
            raise LayoutError("a RebuiltGroup needs a description (what)")
        if not isinstance(self.resume_every, int) or self.resume_every <= 0:
            raise LayoutError(f"resume_every must be a positive int, got {self.resume_every!r}")


@dataclass(frozen=True, kw_only=True)
class DCPSpec:
    """Decode context parallel: this process holds rank ``rank`` of ``size`` token shards.

    Tokens are dealt to ranks in runs of ``interleave_tokens``: token t lives on rank
    ``(t // interleave_tokens) % size``. A rank's block tables cover only its own tokens.
    """

    rank: int = 0
    size: int = 1
    interleave_tokens: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise LayoutError(f"DCP rank {self.rank} is not in [0, {self.size})")
        if self.interleave_tokens < 1:
            raise LayoutError(f"DCP interleave_tokens must be >= 1, got {self.interleave_tokens}")

    @property
    def period_tokens(self) -> int:
        return self.size * self.interleave_tokens

    def local_tokens_before(self, t: int) -> int:
        """How many of the global tokens [0, t) live on this rank."""
        if self.size == 1:
            return t
        full, rem = divmod(t, self.period_tokens)
        return full * self.interleave_tokens + min(
            max(rem - self.rank * self.interleave_tokens, 0), self.interleave_tokens
        )


@dataclass(frozen=True, kw_only=True)
class RowRegions:
    """A block whose rows' fields live in separate regions, one after the other.

    region_bytes: bytes per row of each region, in block order. A block of R rows is
        ``[R x region_bytes[0]][R x region_bytes[1]]...``; region k starts at byte
        ``R * sum(region_bytes[:k])`` of the block and its rows are ``region_bytes[k]`` apart.
    what: the engine layout this describes (for messages and the layout table).

    The engine registers such a cache as rows of ``row_bytes`` (e.g. 584 = 576 + 8): the
    registered tensor has the right block size and page but not the right row addresses.

    Example (vLLM DeepSeek V4 ``fp8_ds_mla``)::

        RowRegions(region_bytes=(576, 8), what="fp8_ds_mla").region_offsets_bytes(64)  # (0, 36864)
    """

    region_bytes: tuple[int, ...]
    what: str = ""

    def __post_init__(self) -> None:
        sizes = self.region_bytes
        if not isinstance(sizes, tuple) or len(sizes) < 2:
            raise LayoutError(f"RowRegions needs at least two regions, got {sizes!r}")
        if any(not isinstance(b, int) or b <= 0 for b in sizes):
            raise LayoutError(f"RowRegions: every region needs a positive byte count, got {sizes!r}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one row over all regions (the engine's registered row width)."""
        return sum(self.region_bytes)

    def region_offsets_bytes(self, rows_per_block: int) -> tuple[int, ...]:
        """Byte offset of each region inside a block of ``rows_per_block`` rows."""
        offsets, at = [], 0
        for size in self.region_bytes:
            offsets.append(at)
            at += rows_per_block * size
        return tuple(offsets)


@dataclass(frozen=True, kw_only=True)
class PlaneSpec:
    """One paged tensor as kvconnect addresses it (no tensor reference: a pure value).

    A row's address is ``base + block * block_stride_bytes + row * row_stride_bytes``;
    its ``row_bytes`` bytes are contiguous. A sub-plane (region ``region_index`` of
    ``num_regions``, see ``RowRegions``) has its base at the region's offset in block 0.
    ``row_shape`` keeps the engine's split of a row (8 x 64 and 4 x 128 are both 1 KiB rows
    of different models); empty where the engine gives none. A column slice (``slice_index`` of
    ``num_slices``, ``KVLayout.with_sliced_planes``) holds ``row_bytes`` consecutive bytes of each
    row of a wider plane, its base at their offset: a chunk's rows of one wide plane then travel
    as several objects no larger than the pool's slot.
    """

    layer_name: str
    plane_index: int
    group_index: int
    dtype: str
    num_blocks: int
    rows_per_block: int
    row_bytes: int
    block_stride_bytes: int
    row_stride_bytes: int
    tokens_per_row: int
    is_page: bool = False
    region_index: int = 0
    num_regions: int = 1
    row_shape: tuple[int, ...] = ()  # the row's dims as the engine shapes them (heads x head size)
    slice_index: int = 0
    num_slices: int = 1

    def __post_init__(self) -> None:
        where = f"layer {self.layer_name!r} plane {self.plane_index}"
        if self.num_regions < 1 or not 0 <= self.region_index < self.num_regions:
            raise LayoutError(f"{where}: region {self.region_index} is not in [0, {self.num_regions})")
        if self.num_slices < 1 or not 0 <= self.slice_index < self.num_slices:
            raise LayoutError(f"{where}: slice {self.slice_index} is not in [0, {self.num_slices})")
        if self.num_blocks <= 0 or self.rows_per_block <= 0 or self.row_bytes <= 0:
            raise LayoutError(f"{where}: empty plane (blocks, rows and row bytes must be > 0)")
        if self.rows_per_block > 1 and self.row_stride_bytes < self.row_bytes:
            raise LayoutError(f"{where}: rows overlap (row stride {self.row_stride_bytes} < row bytes {self.row_bytes})")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.rows_per_block

    @property
    def name(self) -> str:
        return f"{self.layer_name}[{self.plane_index}]"
