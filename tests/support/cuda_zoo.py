"""A CUDA model zoo (caches as views into flat uint8 backings) and byte-exact checks against the torch oracle.

Shared by test_cuda_transfer.py and test_cuda_staged.py; every GPU helper skips cleanly (``gpu``,
``built``) on a machine without a CUDA device or without the built extension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from support import zoo
from kvconnect import GroupSpec, KVLayout
from kvconnect.transfer import dispatch
from kvconnect.chunks.keys import Chunk
from kvconnect.restore.plan import BlockTables, max_chunk_payload_bytes, plan_store, store_segments
from kvconnect.layout.spec import ChunkKey
from kvconnect.transfer.tables import SegmentBuilder, TransferTables
from kvconnect.transfer import cuda as cuda_path

try:
    from kvconnect import _cuda_kernels
except ImportError:
    _cuda_kernels = None

HAS_GPU = torch.cuda.is_available() and _cuda_kernels is not None and _cuda_kernels.device_count() > 0
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built kvconnect._cuda_kernels")
built = pytest.mark.skipif(_cuda_kernels is None, reason="kvconnect._cuda_kernels is not built (no nvcc)")
CHUNK = 256
DEVICE = "cuda"  # the zoo's device (a CPU dry run of these helpers sets "cpu")

# ---------------------------------------------------------------------------------------
# the zoo (CUDA tensors as views into flat uint8 backings)


@dataclass
class Case:
    name: str
    kv: dict
    groups: list
    layer_groups: Optional[dict]
    backings: list

    def layout(self) -> KVLayout:
        return KVLayout.from_tensors(self.kv, groups=self.groups, layer_groups=self.layer_groups, model_name=self.name)

    def randomize(self, gen: torch.Generator) -> None:
        for b in self.backings:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))

    def snapshot(self) -> list:
        return [b.clone() for b in self.backings]

    def restore(self, snap: list) -> None:
        for b, s in zip(self.backings, snap):
            b.copy_(s)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _view(backing: torch.Tensor, dtype, shape, stride_bytes, offset_bytes=0) -> torch.Tensor:
    elem = torch.empty(0, dtype=dtype).element_size()
    typed = backing.view(dtype)
    return torch.as_strided(typed, shape, tuple(s // elem for s in stride_bytes), offset_bytes // elem)


def llama_flash(layers=3, nb=70, bs=16, heads=8, dim=128) -> Case:
    kv, backings = {}, []
    for i in range(layers):
        b = torch.empty(2 * nb * bs * heads * dim * 2, dtype=torch.uint8, device=DEVICE)
        kv[f"layers.{i}"] = b.view(torch.bfloat16).view(2, nb, bs, heads, dim)
        backings.append(b)
    return Case("llama-flash", kv, [GroupSpec(block_size=bs)], None, backings)


def mla(layers=3, nb=18, bs=64, width=576) -> Case:
    kv, backings = {}, []
    for i in range(layers):
        b = torch.empty(nb * bs * width * 2, dtype=torch.uint8, device=DEVICE)
        kv[f"layers.{i}"] = b.view(torch.bfloat16).view(nb, bs, width)
        backings.append(b)
    return Case("mla", kv, [GroupSpec(block_size=bs)], None, backings)


def dsv32(layers=2, nb=18, bs=64) -> Case:
    kv, backings, lg = {}, [], {}
    for i in range(layers):
        m = torch.empty(nb * bs * 576 * 2, dtype=torch.uint8, device=DEVICE)
        x = torch.empty(nb * bs * 132, dtype=torch.uint8, device=DEVICE)
        kv[f"layers.{i}"] = (m.view(torch.bfloat16).view(nb, bs, 576), x.view(nb, bs, 132))
        lg[f"layers.{i}"] = (0, 0)
        backings += [m, x]
    return Case("dsv32", kv, [GroupSpec(block_size=bs)], lg, backings)


def narrow_rows(nb=70, bs=16) -> Case:
    """1-byte and 3-byte rows: the kernel's narrowest units and odd alignments."""
    one = torch.empty(nb * bs, dtype=torch.uint8, device=DEVICE)
    three = torch.empty(nb * bs * 3, dtype=torch.uint8, device=DEVICE)
    kv = {"one": one.view(nb, bs, 1), "three": three.view(nb, bs, 3)}
    return Case("narrow", kv, [GroupSpec(block_size=bs)], None, [one, three])


# DeepSeek-V4-Flash caches (real row bytes and page alignment): name -> (spec, row bytes, dtype, align)
DSV4 = zoo.DSV4_GROUPS
DSV4_LAYERS = [["swa"], ["swa", "c4", "c4_indexer", "c4_state", "c4_indexer_state"], ["swa", "c128", "c128_state"],
               ["swa", "c4", "c4_indexer", "c4_state", "c4_indexer_state"], ["swa", "c128", "c128_state"]]


def dsv4(packed: bool, max_tokens: int = 1024) -> Case:
    """Seven caches over five layers, padded pages; packed: each group's layers of one block
    share one per-block allocation and every layer is an as_strided view into it."""
    names = list(DSV4)
    kv, lg, backings = {}, {}, []
    nb = {n: max_tokens // DSV4[n][0].block_size + 2 for n in names}
    page = {n: _align(DSV4[n][0].rows_per_block * DSV4[n][1], DSV4[n][3]) for n in names}
    members = {n: [i for i, caches in enumerate(DSV4_LAYERS) if n in caches] for n in names}
    packed_backing, offset = {}, {}
    if packed:
        for n in names:
            per_block = sum(page[n] for _ in members[n])
            packed_backing[n] = torch.empty(nb[n] * per_block, dtype=torch.uint8, device=DEVICE)
            backings.append(packed_backing[n])
            offset.update({(n, layer): k * page[n] for k, layer in enumerate(members[n])})
    for layer, caches in enumerate(DSV4_LAYERS):
        for n in caches:
            spec, row_bytes, dtype, _ = DSV4[n]
            shape_bytes = (nb[n], spec.rows_per_block, row_bytes)
            elem = torch.empty(0, dtype=dtype).element_size()
            shape = (shape_bytes[0], shape_bytes[1], row_bytes // elem)
            if packed:
                block_stride = page[n] * len(members[n])
                view = _view(packed_backing[n], dtype, shape, (block_stride, row_bytes, elem), offset[(n, layer)])
            else:
                b = torch.empty(nb[n] * page[n], dtype=torch.uint8, device=DEVICE)
                backings.append(b)
                view = _view(b, dtype, shape, (page[n], row_bytes, elem))
            kv[f"layers.{layer}.{n}"] = view
            lg[f"layers.{layer}.{n}"] = names.index(n)
    return Case("dsv4-packed" if packed else "dsv4", kv, [DSV4[n][0] for n in names], lg, backings)


ZOO = {
    "llama_flash": llama_flash,
    "mla": mla,
    "dsv32": dsv32,
    "narrow": narrow_rows,
    "dsv4": lambda: dsv4(False),
    "dsv4_packed": lambda: dsv4(True),
}


@pytest.fixture
def gen(request) -> torch.Generator:
    import zlib

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


# ---------------------------------------------------------------------------------------
# tables


def random_block_tables(layout: KVLayout, num_tokens: int, gen: torch.Generator, absent_chunk: Optional[int] = None) -> list:
    """Random distinct block ids per group; ``absent_chunk``: the last block of that chunk is -1."""
    tables = []
    for g, group in enumerate(layout.groups):
        n = -(-num_tokens // group.block_size)
        ids = torch.randperm(layout.group_num_blocks(g), generator=gen)[:n]
        if absent_chunk is not None:
            ids[-(-(absent_chunk + 1) * CHUNK // group.block_size) - 1] = -1
        tables.append(ids.tolist())
    return tables


def planned_tables(layout: KVLayout, num_tokens: int, gen: torch.Generator, *, absent_chunk: Optional[int] = None,
                   pad_bytes: int = 0) -> tuple[TransferTables, int]:
    """Store tables of every full chunk (one per chunk slot of max payload + pad_bytes)."""
    chunks = [Chunk(i, i * CHUNK, (i + 1) * CHUNK, ChunkKey(bytes(16))) for i in range(num_tokens // CHUNK)]
    block_ids = random_block_tables(layout, num_tokens, gen, absent_chunk)
    plans = plan_store(layout, chunks, BlockTables.of(layout, block_ids))
    if absent_chunk is not None:
        assert plans[absent_chunk].group_mask != (1 << layout.num_groups) - 1  # some group is skipped there
    slot_bytes = max_chunk_payload_bytes(layout, CHUNK) + pad_bytes
    tables = store_segments(layout, plans, [i * slot_bytes for i in range(len(plans))]).build()
    assert len(tables.segments)
    return tables, slot_bytes * len(plans)


def random_tables(layout: KVLayout, gen: torch.Generator) -> tuple[TransferTables, int]:
    """Distinct random rows of every plane (sorted runs and scattered), at odd buffer offsets."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    builder, offset = SegmentBuilder(), 0
    for i, p in enumerate(layout.planes):
        n = int(rng.integers(1, max(2, p.num_slots // 2)))
        slots = rng.choice(p.num_slots, size=n, replace=False)
        if rng.random() < 0.5:
            slots.sort()  # adjacent rows: exercises merged runs
        for part in np.array_split(slots, int(rng.integers(1, 3))):
            if not len(part):
                continue
            offset += int(rng.integers(0, 16))
            so = builder.add_slots(part.astype(np.int64))
            builder.add_segments(np.array([i]), np.array([len(part)]), np.array([so]), np.array([offset]))
            offset += len(part) * p.row_bytes
    return builder.build(), offset + 7


def pinned(nbytes: int, gen: torch.Generator) -> torch.Tensor:
    b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    b.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return b


def outside_targets(case: Case, layout: KVLayout, tables: TransferTables, snapshot: list) -> list:
    """Copies of a snapshot of ``case`` with every targeted row zeroed (the rest must stay untouched)."""
    copies = [b.clone() for b in snapshot]
    by_ptr = {b.untyped_storage().data_ptr(): c for b, c in zip(case.backings, copies)}
    for plane, n, so, _ in tables.segments.tolist():
        p, t = layout.planes[plane], layout.tensors[plane]
        copy = by_ptr[t.untyped_storage().data_ptr()]
        base = t.storage_offset() * t.element_size()
        for slot in tables.slots[so : so + n].tolist():
            b, r = divmod(slot, p.rows_per_block)
            start = base + b * p.block_stride_bytes + r * p.row_stride_bytes
            copy[start : start + p.row_bytes] = 0
    return copies


def check_gather(layout: KVLayout, tables: TransferTables, nbytes: int, gen, *, offset: int = 0, tuning=None, stream=None):
    base = pinned(nbytes + offset, gen)
    ref = base.clone()
    buf = base[offset:]
    if stream is None and tuning is None:
        dispatch.gather(layout, tables, buf)
    else:
        cuda_path.run("gather", layout, tables, buf, stream, tuning=tuning)
    dispatch.gather(layout, tables, ref[offset:], backend="torch")
    assert torch.equal(base, ref), f"{int((base != ref).sum())} bytes differ from the torch oracle"


def check_scatter(case: Case, layout: KVLayout, tables: TransferTables, nbytes: int, gen, *, offset: int = 0,
                  tuning=None, stream=None):
    buf = pinned(nbytes + offset, gen)[offset:]
    before = case.snapshot()
    if stream is None and tuning is None:
        dispatch.scatter(layout, tables, buf)
    else:
        cuda_path.run("scatter", layout, tables, buf, stream, tuning=tuning)
    torch.cuda.synchronize()
    got = case.snapshot()
    case.restore(before)
    dispatch.scatter(layout, tables, buf, backend="torch")
    want = case.snapshot()
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"backing {i}: {int((g != w).sum())} bytes differ from the torch oracle"
    for g, b in zip(outside_targets(case, layout, tables, got), outside_targets(case, layout, tables, before)):
        assert torch.equal(g, b), "bytes outside the targeted rows changed"
    assert any(not torch.equal(g, b) for g, b in zip(got, before)), "nothing was written"


# ---------------------------------------------------------------------------------------
# everywhere the extension is built (no GPU needed)
