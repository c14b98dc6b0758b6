"""kvconnect quickstart: a DeepSeek-V4-shaped paged KV cache on CPU, end to end.

A simulated engine prefills prompts that share prefixes, chunk by chunk as chunked prefill
does, and saves each chunk in the step that computes it (windowed groups free the blocks
that left their window, as a hybrid allocator does). Then the whole paged memory is wiped
and new requests with fresh block tables ask kvconnect what they can restore, load it,
and every byte a group needs to resume is checked against what the model wrote.

Run: python examples/quickstart.py [--layers 11] [--chunk-size 256]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import blake3
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dsv4_cache  # noqa: E402

from kvconnect import Config, KVCacheEngine, KVLayout  # noqa: E402
from kvconnect.layout.rows import intersect  # noqa: E402
from kvconnect.transfer.torch_impl import byte_views  # noqa: E402


class SimulatedEngine:
    """Owns the paged memory and block allocation; 'computes' rows deterministically."""

    def __init__(self, layout: KVLayout, engine: KVCacheEngine) -> None:
        self.layout, self.kv = layout, engine
        self.views = byte_views(layout)
        self.free = [list(range(layout.group_num_blocks(g))) for g in range(layout.num_groups)]
        for free in self.free:
            random.shuffle(free)

    def row_bytes_of(self, chunk_key: bytes, plane: int, rows: tuple[int, int]) -> torch.Tensor:
        """What the 'model' writes for rows of a plane in a chunk: a function of the prefix."""
        seed = int.from_bytes(blake3.blake3(chunk_key + plane.to_bytes(4, "little")).digest(8), "little")
        gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
        n_all = rows[1] - rows[0]
        return torch.randint(0, 256, (n_all, self.layout.planes[plane].row_bytes), dtype=torch.uint8, generator=gen)

    def _slots(self, g: int, table: list[int], rows: tuple[int, int]):
        rpb = self.layout.geometries[g].rows_per_block
        r = torch.arange(*rows)
        return torch.tensor(table)[r // rpb], r % rpb

    def allocate(self, table: list[int], g: int, num_tokens: int) -> None:
        block_size = self.layout.groups[g].block_size
        while len(table) * block_size < num_tokens:
            table.append(self.free[g].pop())

    def release_outside_window(self, table: list[int], g: int, boundary: int) -> None:
        window = self.layout.geometries[g].window_tokens
        block_size = self.layout.groups[g].block_size
        if window is None:
            return
        for i, block in enumerate(table):
            if block >= 0 and (i + 1) * block_size <= boundary - window:
                self.free[g].append(block)
                table[i] = -1

    def prefill_and_store(self, tokens: np.ndarray) -> tuple[list[list[int]], int]:
        """Chunked prefill; each step writes its rows and stores its chunk (mask = earlier steps)."""
        tables: list[list[int]] = [[] for _ in range(self.layout.num_groups)]
        chunks = self.kv.chunks(tokens, include_partial=False)
        stored = 0
        self.store_s = getattr(self, "store_s", 0.0)
        for chunk in chunks:
            for g in range(self.layout.num_groups):
                self.allocate(tables[g], g, chunk.end)
            for p, plane in enumerate(self.layout.planes):
                geo = self.layout.geometries[plane.group_index]
                rows = geo.chunk_rows(chunk.start, chunk.end)
                blocks, offs = self._slots(plane.group_index, tables[plane.group_index], rows)
                self.views[p][blocks, offs] = self.row_bytes_of(chunk.key, p, rows)
            mask = torch.zeros(chunk.end, dtype=torch.bool)
            mask[chunk.start :] = True
            t0 = time.perf_counter()
            stored += self.kv.store(tokens[: chunk.end], tables, mask=mask)
            self.store_s += time.perf_counter() - t0
            for g in range(self.layout.num_groups):
                self.release_outside_window(tables[g], g, chunk.end)
        return tables, stored

    def new_request_tables(self, hit_tokens: int) -> list[list[int]]:
        """Blocks for a request resuming at ``hit_tokens``: windowed groups only inside the window."""
        tables = []
        for g in range(self.layout.num_groups):
            table: list[int] = []
            self.allocate(table, g, hit_tokens)
            self.release_outside_window(table, g, hit_tokens)
            tables.append(table)
        return tables

    def check_restored(self, tokens: np.ndarray, tables, boundary: int) -> int:
        """Compare every row each group needs at ``boundary``; returns bytes checked."""
        checked = 0
        for chunk in self.kv.chunks(tokens, include_partial=False):
            if chunk.end > boundary:
                break
            for p, plane in enumerate(self.layout.planes):
                geo = self.layout.geometries[plane.group_index]
                rows = geo.chunk_rows(chunk.start, chunk.end)
                need = intersect(geo.needed_rows(boundary), rows)
                if need[1] <= need[0]:
                    continue
                expected = self.row_bytes_of(chunk.key, p, rows)[need[0] - rows[0] : need[1] - rows[0]]
                blocks, offs = self._slots(plane.group_index, tables[plane.group_index], need)
                if not torch.equal(self.views[p][blocks, offs], expected):
                    raise SystemExit(f"MISMATCH: plane {plane.name} rows {need} at boundary {boundary}")
                checked += expected.numel()
        return checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=11, help="DeepSeek-V4-Flash has 43 (+1 MTP)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)

    prefix_len, suffix_len = 3 * args.chunk_size, args.chunk_size
    kv_caches, groups, layer_groups = dsv4_cache.build(args.layers, max_tokens=12 * (prefix_len + suffix_len))
    layout = KVLayout.from_tensors(kv_caches, groups=groups, layer_groups=layer_groups, model_name="dsv4-flash-mini",
                                   row_regions=dsv4_cache.row_regions(args.layers))
    engine = KVCacheEngine(layout, Config(chunk_size=args.chunk_size, max_local_cpu_size=0.125))
    engine.pool.buffer.zero_()  # fault the pool's pages in now, not inside the first timed store
    sim = SimulatedEngine(layout, engine)

    print(f"kvconnect quickstart: DeepSeek-V4-Flash-shaped cache, {args.layers} layers, {len(layout.planes)} planes, "
          f"chunk {args.chunk_size} tokens, transfer backend '{engine.backend or 'auto'}'\n")
    print(f"{'group':<18}{'kind':<10}{'block':>6}{'cr':>5}{'window':>8}{'planes':>8}{'rows/chunk':>12}{'bytes/chunk':>13}")
    probe = engine.chunks(np.arange(args.chunk_size), include_partial=False)[0]
    for g, (name, geo) in enumerate(zip(dsv4_cache.group_names(args.layers), layout.geometries)):
        members = layout.planes_of_group(g)
        rows = geo.stored_rows(probe.start, probe.end)
        num_rows = rows[1] - rows[0]
        bytes_per_chunk = sum(num_rows * layout.planes[i].row_bytes for i in members)
        window = geo.window_tokens or "-"
        print(f"{name:<18}{layout.groups[g].kind.value:<10}{layout.groups[g].block_size:>6}{layout.groups[g].compress_ratio:>5}"
              f"{window!s:>8}{len(members):>8}{num_rows:>12}{bytes_per_chunk:>13,}")
    whole = sum((geo.stored_rows(probe.start, probe.end)[1] - geo.stored_rows(probe.start, probe.end)[0])
                * sum(layout.planes[i].row_bytes for i in layout.planes_of_group(g)) for g, geo in enumerate(layout.geometries))
    print(f"{'one chunk (the rows above)':<67}{whole:>13,} bytes")
    print(f"{'largest object stored (a restore-point part: one CPU pool slot)':<67}{engine.max_chunk_bytes:>13,} bytes\n")

    vocab = 32000
    system = rng.integers(0, vocab, prefix_len)
    prompts = [np.concatenate([system, rng.integers(0, vocab, suffix_len)]) for _ in range(3)]
    prompts.append(np.concatenate([system[: 2 * args.chunk_size], rng.integers(0, vocab, 2 * args.chunk_size)]))

    stored_tokens = sum(sim.prefill_and_store(p)[1] for p in prompts)
    store_s = sim.store_s
    for t in layout.tensors:  # the engine's paged memory is wiped: only kvconnect holds the KV now
        t.zero_()

    queries = prompts + [
        np.concatenate([system, rng.integers(0, vocab, 2 * suffix_len)]),  # shares the system prompt only
        np.concatenate([system[:args.chunk_size + 7], rng.integers(0, vocab, prefix_len)]),  # shares 1 chunk + 7 tokens
        rng.integers(0, vocab, prefix_len),  # unrelated
    ]
    print(f"{'request':<9}{'tokens':>8}{'hit':>7}{'loaded':>8}{'bytes checked':>15}")
    load_s, loaded_bytes, total_hit = 0.0, 0, 0
    for i, q in enumerate(queries):
        hit = engine.lookup(q)
        tables = sim.new_request_tables(hit)
        before = engine.stats.retrieved_bytes
        t0 = time.perf_counter()
        loaded = engine.retrieve(q, tables)
        load_s += time.perf_counter() - t0
        loaded_bytes += engine.stats.retrieved_bytes - before
        checked = sim.check_restored(q, tables, loaded)
        total_hit += loaded
        print(f"{i:<9}{len(q):>8}{hit:>7}{loaded:>8}{checked:>15,}")

    s = engine.stats
    print(f"\nstored {s.stored_chunks} chunks ({s.stored_bytes / 1e6:.1f} MB, {stored_tokens} tokens) "
          f"at {s.stored_bytes / store_s / 1e9:.2f} GB/s (key chain + plan + gather); "
          f"{s.skipped_chunks} chunks were already stored")
    print(f"loaded {s.retrieved_chunks} chunks ({loaded_bytes / 1e6:.1f} MB, {total_hit} tokens) at "
          f"{loaded_bytes / max(load_s, 1e-9) / 1e9:.2f} GB/s (lookup + gate + scatter)")
    print("every restored byte matched what the model wrote: OK")


if __name__ == "__main__":
    main()
