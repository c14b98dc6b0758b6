"""A small MLA-shaped paged KV cache on CPU with reproducible row contents, for tier tests.

Row bytes are a pure function of (prompt seed, plane, token position), so a second
process can regenerate what the first stored and compare retrieved bytes exactly.

    layout = mla_layout()
    eng = make_engine(layout, tmp_path=..., remote_url=...)
    table = block_table(layout, n, offset=0)
    write_rows(layout, table, seed, n); eng.store(tokens(seed, n), table)
    wipe(layout); table2 = block_table(layout, n, offset=7)
    loaded = eng.retrieve(tokens(seed, n), table2)
    assert_restored(layout, table2, seed, loaded)
"""

from __future__ import annotations

import numpy as np
import torch

from kvconnect import Config, GroupSpec, KVCacheEngine, KVLayout
from kvconnect.transfer.torch_impl import byte_views

CHUNK_TOKENS = 32
BLOCK_TOKENS = 16


def mla_layout(*, num_layers: int = 2, num_blocks: int = 96, width: int = 576, model: str = "tiers-test") -> KVLayout:
    """DeepSeek-V3-like MLA planes ([NB, BS, 576] bf16) at a small scale."""
    kv = {f"layers.{i}": torch.zeros(num_blocks, BLOCK_TOKENS, width, dtype=torch.bfloat16) for i in range(num_layers)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=BLOCK_TOKENS)], model_name=model)


def make_config(**kw) -> Config:
    base = dict(chunk_size=CHUNK_TOKENS, max_local_cpu_size=0.05, num_threads=1, remote_timeout_s=2.0)
    base.update(kw)
    return Config(**base)


def make_engine(layout: KVLayout, **kw) -> KVCacheEngine:
    return KVCacheEngine(layout, make_config(**kw))


def tokens(seed: int, num_tokens: int) -> np.ndarray:
    return np.random.default_rng([seed, 12345]).integers(0, 32000, num_tokens, dtype=np.int64)


def block_table(layout: KVLayout, num_tokens: int, *, offset: int = 0) -> list[list[int]]:
    """Distinct blocks for ``num_tokens``, starting at ``offset`` and going backwards (wrapping)."""
    nb = layout.group_num_blocks(0)
    need = -(-num_tokens // BLOCK_TOKENS)
    assert need <= nb
    return [[(nb - 1 - offset - i) % nb for i in range(need)]]


def expected_rows(layout: KVLayout, seed: int, num_tokens: int) -> list[np.ndarray]:
    return [
        np.random.default_rng([seed, p]).integers(0, 256, (num_tokens, plane.row_bytes), dtype=np.uint8)
        for p, plane in enumerate(layout.planes)
    ]


def _index(table: list[list[int]], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(num_tokens)
    return torch.tensor(table[0], dtype=torch.long)[t // BLOCK_TOKENS], t % BLOCK_TOKENS


def write_rows(layout: KVLayout, table: list[list[int]], seed: int, num_tokens: int) -> None:
    blocks, offs = _index(table, num_tokens)
    for view, rows in zip(byte_views(layout), expected_rows(layout, seed, num_tokens)):
        view[blocks, offs] = torch.from_numpy(rows)


def wipe(layout: KVLayout) -> None:
    for t in layout.tensors:
        t.zero_()


def assert_restored(layout: KVLayout, table: list[list[int]], seed: int, num_loaded: int) -> None:
    """The first ``num_loaded`` tokens' rows equal what was written; every other byte is 0."""
    blocks, offs = _index(table, num_loaded)
    for p, (view, rows) in enumerate(zip(byte_views(layout), expected_rows(layout, seed, num_loaded))):
        got = view[blocks, offs].numpy()
        assert np.array_equal(got, rows), f"plane {p}: restored rows differ"
        rest = view.clone()
        rest[blocks, offs] = 0
        assert not rest.any(), f"plane {p}: bytes outside the restored rows were written"


def store_prompt(engine: KVCacheEngine, seed: int, num_tokens: int, *, offset: int = 0) -> int:
    layout = engine.layout
    table = block_table(layout, num_tokens, offset=offset)
    write_rows(layout, table, seed, num_tokens)
    return engine.store(tokens(seed, num_tokens), table)


def retrieve_prompt(engine: KVCacheEngine, seed: int, num_tokens: int, *, offset: int = 3) -> int:
    """Wipe the paged memory, retrieve into a different block table, check bytes; tokens loaded."""
    layout = engine.layout
    wipe(layout)
    table = block_table(layout, num_tokens, offset=offset)
    loaded = engine.retrieve(tokens(seed, num_tokens), table)
    assert_restored(layout, table, seed, loaded)
    return loaded
