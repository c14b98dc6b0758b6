"""Restore points (kvconnect/restore/parts.py): window rows stored only where a request can resume.

Every hit must land on a restore point made by a store (the end of the stored tokens, a
branch point, the first chunk end past each multiple of the interval), restore exactly the
reference bytes, and never be offered when a part is missing; window pieces are objects of
their own in the pool and the disk tier, with their own checks.
"""

from __future__ import annotations

import numpy as np
import pytest

from support import zoo
from kvconnect import Config, KVCacheEngine
from kvconnect.chunks.keys import Chunk
from kvconnect.errors import ConfigError, LayoutError
from kvconnect.restore.parts import PartLayout, window_key
from kvconnect.restore.points import restore_points

# (zoo case, chunk tokens, interval tokens, prompt tokens): window shorter and longer than a
# chunk, compressor states, recurrent state on page edges, a DCP shard
CASES = [
    ("gemma3-swa", 32, 128, 400),  # window 80 over 32-token chunks
    ("gemma3-swa-w24", 32, 128, 400),  # window 24 within a chunk
    ("dsv4-flash", 256, 512, 1400),
    ("state-hybrid", 64, 256, 600),
    ("mla-swa-dcp", 64, 256, 560),
]


def _case(name: str, **kw):
    return zoo.gemma_swa(window=24, **kw) if name == "gemma3-swa-w24" else zoo.build(name, **kw)


def _engine(case, chunk, interval, **kw):
    return KVCacheEngine(case.layout(), zoo.small_config(chunk, restore_interval_tokens=interval, **kw))


def _points(n: int, chunk: int, interval: int) -> list[int]:
    """Reference restore points of one store of ``n`` tokens (full chunks) into an empty cache."""
    ends = [e for e in range(chunk, n + 1, chunk)]
    pts = {ends[-1]}
    for e in ends:
        if interval == 0 or e // interval > (e - chunk) // interval:
            pts.add(e)
    return sorted(pts)


def _check_restore(case, engine, tokens, src_tables, boundary, rng):
    dst = case.clone(fill=0)
    dst_engine = _engine(dst, engine.config.chunk_size, engine.config.restore_interval_tokens)
    zoo.transplant(engine, dst_engine, tokens)
    dst_tables = zoo.random_tables(case, len(tokens), rng, keep=zoo.restore_keep(case, max(boundary, 1)))
    expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, boundary)
    assert dst_engine.lookup(tokens) == boundary
    assert dst_engine.retrieve(tokens, dst_tables) == boundary
    assert dst.first_difference(expected) is None
    assert dst_engine.pool.stats().extra["pinned"] == 0


@pytest.mark.parametrize("name,chunk,interval,n", CASES)
def test_hits_land_on_restore_points_byte_exact(name, chunk, interval, n, rng):
    """Prefixes at, between and beyond restore points hit the largest restore point at or below
    them, and restore exactly the reference rows."""
    case = _case(name, max_tokens=n + chunk)
    tokens = zoo.random_tokens(rng, n + chunk)
    stored = n // chunk * chunk
    bounds = zoo.chunk_bounds_ref(n + chunk, chunk, False)
    src_tables = zoo.random_tables(case, n + chunk, rng, keep=zoo.window_keep(case, bounds))
    engine = _engine(case, chunk, interval)
    assert engine.parts.split
    assert engine.store(tokens[:n], src_tables) == stored
    points = _points(n, chunk, interval)
    assert len(points) >= 2 and points[-1] == stored
    # windows longer than a chunk overlap: window rows stored for two neighbouring restore points
    # may also cover the chunk ends between them, which are then restorable too
    exact = all(g.window_tokens is None or g.window_tokens <= chunk for g in case.layout().groups)
    for length in sorted({points[0], points[0] + chunk // 2, points[0] + chunk, stored - 1, stored, n, n + chunk}):
        want = max([p for p in points if p <= length], default=0)
        hit = engine.lookup(tokens[:length])
        assert hit == want if exact else (want <= hit <= length and hit % chunk == 0), (length, hit, want)
        if hit:
            _check_restore(case, engine, tokens[:length], src_tables, hit, rng)
    assert engine.stats.window_parts_stored == len(points)


def test_interval_zero_is_every_chunk_end(rng):
    case = zoo.gemma_swa(max_tokens=320)
    tokens = zoo.random_tokens(rng, 320)
    tables = zoo.random_tables(case, 320, rng)
    engine = _engine(case, 32, 0)
    assert not engine.parts.split  # interval 0: whole chunks, as before restore points
    engine.store(tokens, tables)
    for length in range(32, 321, 32):
        assert engine.lookup(tokens[:length]) == length
    assert engine.stats.stored_chunks == 10 and engine.stats.window_pieces_stored == 0
    _check_restore(case, engine, tokens[:300], tables, 288, rng)


def test_branching_conversation_hits_the_branch_point(rng):
    """A stored prompt that leaves an already stored prefix makes a restore point where it leaves
    it: a third branch of the same prefix resumes there, between interval points."""
    chunk, interval = 32, 256
    case = zoo.gemma_swa(window=24, max_tokens=400)
    shared = zoo.random_tokens(rng, 96)  # 3 chunks, not on the interval
    a = np.concatenate([shared, zoo.random_tokens(rng, 128)])
    b = np.concatenate([shared, zoo.random_tokens(rng, 128)])
    c = np.concatenate([shared, zoo.random_tokens(rng, 100)])
    tables = zoo.random_tables(case, 400, rng)  # one block per position: equal prefix, equal bytes
    engine = _engine(case, chunk, interval)
    engine.store(a, tables)
    assert engine.lookup(c) == 0  # a's only restore point is its end (224)
    engine.store(b, tables)  # leaves the stored prefix at 96
    assert engine.lookup(c) == 96
    assert engine.lookup(a) == 224 and engine.lookup(b) == 224
    _check_restore(case, engine, c, tables, 96, rng)
    # the next turn of a: a + more hits a's end
    a2 = np.concatenate([a, zoo.random_tokens(rng, 70)])
    assert engine.lookup(a2) == 224
    _check_restore(case, engine, a2, tables, 224, rng)


def test_masked_store_continues_a_prompt(rng):
    """A store whose mask covers what an earlier store saved (chunked prefill): the earlier
    end stays a restore point and the new end is one."""
    chunk = 32
    case = zoo.gemma_swa(max_tokens=320)
    tokens = zoo.random_tokens(rng, 320)
    tables = zoo.random_tables(case, 320, rng)
    engine = _engine(case, chunk, 1024)
    engine.store(tokens[:128], tables)
    mask = np.ones(256, np.bool_)
    mask[:128] = False
    assert engine.store(tokens[:256], tables, mask) == 128
    assert engine.lookup(tokens[:200]) == 128
    assert engine.lookup(tokens[:300]) == 256
    _check_restore(case, engine, tokens[:300], tables, 256, rng)


def test_bytes_per_token_shrink_with_the_interval(rng):
    """DeepSeek V4 byte proportions: the window rows dominate a chunk; stored only at restore
    points, a long prompt costs a fraction of the bytes of interval 0 (every chunk end)."""
    chunk, n = 256, 4096
    case = zoo.dsv4(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, zoo.chunk_bounds_ref(n, chunk, False)))
    every = _engine(case, chunk, 0, max_local_cpu_size=0.25)
    sparse = _engine(case, chunk, 2048, max_local_cpu_size=0.25)
    assert every.store(tokens, tables) == n and sparse.store(tokens, tables) == n
    assert not every.parts.split and sparse.stats.window_parts_stored == 2  # interval 0: whole chunks
    assert sparse.stats.stored_bytes * 3 < every.stats.stored_bytes
    parts = sparse.parts
    assert parts.prefix_bytes < parts.window_bytes  # this layout's window rows are most of a chunk
    assert sparse.stats.stored_bytes == (n // chunk) * parts.prefix_bytes + 2 * parts.window_bytes
    assert every.stats.stored_bytes == (n // chunk) * (parts.prefix_bytes + parts.window_bytes)
    from kvconnect import sizing  # what ``kvconnect inspect`` reports for this layout and interval

    rp = sizing.restore_point_sizing(case.layout(), chunk, 2048)
    assert rp.bytes_per_token * n == sparse.stats.stored_bytes
    assert sizing.restore_point_sizing(case.layout(), chunk, 0).bytes_per_token * n == every.stats.stored_bytes


@pytest.mark.parametrize("drop", ["window", "prefix"])
def test_a_missing_part_is_never_promised(drop, rng):
    """Evicting a window piece of the last restore point (or a prefix part after the previous
    one) makes the hit fall back to the previous restore point; lookup == retrieve and the
    bytes are exact. What no restore point reaches any more is evicted first."""
    chunk, interval, n = 32, 128, 320
    case = zoo.gemma_swa(window=24, max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    engine = _engine(case, chunk, interval)
    engine.store(tokens, tables)
    chunks = engine.chunks(tokens, include_partial=False)
    assert engine.lookup(tokens) == 320
    if drop == "window":
        assert engine.pool.remove(window_key(chunks[-1].key, 1))
    else:
        assert engine.pool.remove(chunks[8].key)  # tokens [256, 288)
    assert engine.lookup(tokens) == 256
    if drop == "prefix":
        _check_restore(case, engine, tokens, tables, 256, rng)
        return
    # chunks 8 and 9 are reached by no restore point now, nor are the other pieces of 320's part
    unreachable = [chunks[8].key, chunks[9].key] + [window_key(chunks[9].key, p) for p in range(len(engine.parts.pieces)) if p != 1]
    assert engine.stats.prefix_chunks_demoted == 2
    before = len(engine.pool)
    free = engine.pool.num_slots - engine.pool.stats().used_slots
    slots = engine.pool.reserve(free + len(unreachable))
    assert len(slots) == free + len(unreachable)
    assert all(m is None for m in engine.pool.masks(unreachable))
    assert len(engine.pool) == before - len(unreachable)
    engine.pool.abort(slots)
    assert engine.lookup(tokens) == 256  # the reachable restore point survived
    _check_restore(case, engine, tokens, tables, 256, rng)


def test_a_store_reinstates_what_it_makes_reachable(rng):
    """Prefix parts demoted by a lookup become reachable again when a later store makes a
    restore point after them: they go back under the eviction policy."""
    chunk, n = 32, 320
    case = zoo.gemma_swa(window=24, max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    engine = _engine(case, chunk, 128)
    engine.store(tokens, tables)
    chunks = engine.chunks(tokens, include_partial=False)
    engine.pool.remove(window_key(chunks[-1].key, 0))
    assert engine.lookup(tokens) == 256
    assert engine.pool._demoted  # noqa: SLF001 - the pool's demoted set is what this test is about
    engine.store(tokens, tables)  # the request computed again and stores: the end is a restore point again
    assert engine.lookup(tokens) == 320
    assert not any(c.key in engine.pool._demoted for c in chunks)  # noqa: SLF001


def test_random_evictions_never_promise_what_retrieve_cannot_deliver(rng):
    """Random subsets of objects removed from the pool: lookup equals retrieve, lands on a
    restore point, and the restored bytes are exact."""
    chunk, interval, n = 32, 96, 384
    case = zoo.gemma_swa(window=24, max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    points = set(_points(n, chunk, interval))
    for trial in range(12):
        engine = _engine(case, chunk, interval)
        engine.store(tokens, tables)
        chunks = engine.chunks(tokens, include_partial=False)
        keys = [c.key for c in chunks] + [window_key(c.key, p) for c in chunks for p in range(len(engine.parts.pieces))]
        for i in rng.choice(len(keys), size=int(rng.integers(1, 4)), replace=False):
            engine.pool.remove(keys[i])
        hit = engine.lookup(tokens)
        assert hit == 0 or hit in points
        dst = case.clone(fill=0)
        dst_tables = zoo.random_tables(case, n, rng, keep=zoo.restore_keep(case, max(hit, 1)))
        expected = zoo.expected_restore(case, dst.clone(), tables, dst_tables, hit)
        dst_engine = _engine(dst, chunk, interval)
        zoo.transplant(engine, dst_engine, tokens)
        assert dst_engine.lookup(tokens) == hit
        assert dst_engine.retrieve(tokens, dst_tables) == hit
        assert dst.first_difference(expected) is None


def test_window_pieces_round_trip_through_the_disk_tier(tmp_path, rng):
    """Window pieces are files of their own in the disk tier; an engine with an empty pool
    finds the restore point there, promotes the prefix parts plus one window part, and a
    corrupt piece is a miss of that restore point, never wrong bytes."""
    chunk, interval, n = 32, 128, 320
    case = zoo.gemma_swa(window=24, max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    disk = dict(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    engine = _engine(case, chunk, interval, **disk)
    engine.store(tokens, tables)
    assert engine.storage.flush(30)
    written = engine.storage.tier_stats()["tiers"][0]["writer"]["written"]
    assert written == n // chunk + engine.stats.window_pieces_stored
    engine.close()

    dst = case.clone(fill=0)
    reader = KVCacheEngine(dst.layout(), zoo.small_config(chunk, restore_interval_tokens=interval, **disk))
    try:
        assert len(reader.pool) == 0
        assert reader.lookup(tokens) == 320
        dst_tables = zoo.random_tables(case, n, rng, keep=zoo.restore_keep(case, 320))
        expected = zoo.expected_restore(case, dst.clone(), tables, dst_tables, 320)
        assert reader.retrieve(tokens, dst_tables) == 320
        assert dst.first_difference(expected) is None
        # exactly the prefix parts and the window part at 320 were promoted
        assert len(reader.pool) == n // chunk + reader.stats.window_pieces_retrieved
    finally:
        reader.close()

    # corrupt one piece of the window part at 320 on disk: the hit falls back to 256
    chunks = engine.chunks(tokens, include_partial=False)
    bad = window_key(chunks[-1].key, 0)
    files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and bytes(bad).hex() in p.name]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    dst = case.clone(fill=0)
    reader = KVCacheEngine(dst.layout(), zoo.small_config(chunk, restore_interval_tokens=interval, **disk))
    try:
        dst_tables = zoo.random_tables(case, n, rng)
        expected = zoo.expected_restore(case, dst.clone(), tables, dst_tables, 256)
        assert reader.retrieve(tokens, dst_tables) == 256
        assert dst.first_difference(expected) is None
        assert reader.lookup(tokens) == 256  # the corrupt piece was dropped
    finally:
        reader.close()


def test_sizing_counts_the_engines_own_restore_points(rng):
    """An interval that is not a chunk multiple (320 at chunk 256): the engine makes a restore
    point at 4 of every 5 chunk ends, and ``kvconnect inspect`` (sizing) reports the bytes of
    exactly those window parts, not one per ceil(320 / 256) chunks."""
    from kvconnect import sizing

    chunk, interval, n = 256, 320, 1280  # one period: lcm(320, 256) tokens, ending on a restore point
    case = zoo.dsv4(max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng, keep=zoo.window_keep(case, zoo.chunk_bounds_ref(n, chunk, False)))
    engine = _engine(case, chunk, interval, max_local_cpu_size=0.25)
    try:
        assert engine.store(tokens, tables) == n
        assert engine.stats.window_parts_stored == 4
        rp = sizing.restore_point_sizing(case.layout(), chunk, interval)
        assert rp.bytes_per_token * n == engine.stats.stored_bytes
    finally:
        engine.close()


def test_restore_points_rule():
    chunks = [Chunk(i, i * 64, (i + 1) * 64, None) for i in range(10)]
    # a store of everything into an empty cache, interval 256: the end and every 4th chunk end
    assert restore_points(chunks, 0, [False] * 10, 256) == ([3, 7, 9], [])
    # interval 0: every chunk end
    assert restore_points(chunks, 0, [False] * 10, 0) == (list(range(10)), [])
    # chunks 0-4 already stored: the branch point at 320 (index 4), and the end
    assert restore_points(chunks, 0, [True] * 5 + [False] * 5, 10**9) == ([4, 9], [])
    # a masked store from chunk 6: its start is a restore point (where it leaves what is stored)
    assert restore_points(chunks, 6, [False] * 10, 10**9) == ([5, 9], [])
    # an interval that is not a chunk multiple: the first chunk end at or past each multiple
    assert restore_points(chunks, 0, [False] * 10, 200) == ([3, 6, 9], [])
    assert restore_points(chunks, 10, [False] * 10, 0) == ([], [])


def test_restore_points_at_prefill_step_ends():
    chunks = [Chunk(i, i * 64, (i + 1) * 64, None) for i in range(10)]
    # a store ending at a prefill step end: no point at its end (the engine computes on)
    assert restore_points(chunks[:6], 0, [False] * 6, 256, step_end=True) == ([3], [])
    # the next step's store continues it: its start is no branch point, its end (the prompt's) is one
    assert restore_points(chunks, 6, [False] * 10, 10**9, continues=True) == ([9], [])
    # a store from a hit (not a continuation) still makes its start a point
    assert restore_points(chunks, 6, [False] * 10, 10**9, step_end=True) == ([5], [])
    # a step end inside an already stored prefix: the request may leave it right there, a kept point
    assert restore_points(chunks[:6], 0, [True] * 6, 10**9, step_end=True) == ([5], [])
    assert restore_points(chunks[:6], 0, [True] * 6, 10**9, step_end=True, next_present=False) == ([5], [])
    # ... unless the prompt's next chunk is stored too: the request walks on along the prefix
    assert restore_points(chunks[:6], 0, [True] * 6, 10**9, step_end=True, next_present=True) == ([], [])
    assert restore_points(chunks[:8], 6, [True] * 8, 256, step_end=True, next_present=True) == ([7], [])  # an interval point stays
    # step-end parts kept: the step end becomes a short-lived point
    assert restore_points(chunks[:6], 0, [False] * 6, 256, step_end=True, step_end_parts=True) == ([3, 5], [5])
    # a step end that is also an interval point stays a kept point
    assert restore_points(chunks[:8], 0, [False] * 8, 256, step_end=True, step_end_parts=True) == ([3, 7], [])
    # chunks 0-4 already stored: the branch point (index 4) is kept, the step end past it short-lived
    assert restore_points(chunks[:6], 0, [True] * 5 + [False], 10**9, step_end=True, step_end_parts=True) == ([4, 5], [5])


def test_part_layout_sizes_slots_to_the_prefix_part():
    case = zoo.gemma_swa(max_tokens=600)
    layout = case.layout()
    parts = PartLayout.of(layout, 256)
    assert parts.split and parts.prefix_mask == 0b01 and parts.window_mask == 0b10
    assert sorted(i for piece in parts.pieces for i in piece) == [i for i, p in enumerate(layout.planes) if p.group_index == 1]
    assert parts.slot_bytes < parts.prefix_bytes + parts.window_bytes
    whole = PartLayout.of(layout, 256, split=False)
    assert not whole.split and whole.slot_bytes == parts.prefix_bytes + parts.window_bytes
    # a layout without window groups is unchanged
    plain = PartLayout.of(zoo.llama("flash").layout(), 256)
    assert not plain.split and plain.pieces == ()


def test_caller_keyed_chunks_need_whole_chunks(rng):
    case = zoo.gemma_swa(max_tokens=128)
    engine = _engine(case, 32, 32)
    chunks = engine.chunks(zoo.random_tokens(rng, 64), include_partial=False)
    with pytest.raises(LayoutError, match="window_parts=False"):
        engine.store_chunks(chunks, zoo.random_tables(case, 64, rng))
    whole = KVCacheEngine(case.layout(), zoo.small_config(32), window_parts=False)
    assert not whole.parts.split
    assert whole.store_chunks(chunks, zoo.random_tables(case, 64, rng)) == 64
    assert whole.lookup_chunks(chunks) == 64


def test_interval_setting():
    assert Config.from_env({"KVCONNECT_RESTORE_INTERVAL_TOKENS": "0"}).restore_interval_tokens == 0
    assert Config.from_env({}).restore_interval_tokens == Config().restore_interval_tokens > 0
    with pytest.raises(ConfigError, match="KVCONNECT_RESTORE_INTERVAL_TOKENS"):
        Config(restore_interval_tokens=-1)


def test_inspect_sizes_restore_points_per_preset():
    """``kvconnect inspect``'s restore-point figures come from the real preset layouts: DeepSeek-V4-Flash
    caches a prefix token at <= 1/4 of whole chunks' bytes at the default interval."""
    from kvconnect import sizing
    from kvconnect.integrations import presets

    layout = presets.preset("deepseek-v4-flash").layout(0)
    rp = sizing.restore_point_sizing(layout, 256, Config().restore_interval_tokens)
    assert rp.split and rp.window_part_chunks == 1 and rp.pieces_per_chunk > 1
    free = rp.window_free_bytes_per_chunk  # vLLM's C128 compressor state: restore window 0 at every multiple of 128
    assert rp.window_free_groups == (6,) and free == 10 << 20 and free > rp.window_bytes_per_chunk
    assert rp.prefix_bytes_per_chunk + rp.window_bytes_per_chunk + free == rp.whole_bytes_per_token * 256
    assert rp.bytes_per_token <= rp.whole_bytes_per_token / 4
    assert rp.slot_bytes == rp.prefix_bytes_per_chunk
    whole = sizing.restore_point_sizing(layout, 256, 0)
    assert not whole.split and whole.bytes_per_token == whole.whole_bytes_per_token
    gemma = sizing.restore_point_sizing(presets.preset("gemma-3-27b").layout(0), 256, 4096)
    assert gemma.window_part_chunks == 4  # 1024-token windows over 256-token chunks
    plain = sizing.restore_point_sizing(presets.preset("llama-3.1-8b").layout(0), 256, 4096)
    assert not plain.split


def test_window_pieces_round_trip_through_redis(tmp_path, rng):
    """Window pieces are values of their own in Redis: a second engine with an empty pool
    restores at the restore point from Redis, byte-exact, loading one window part."""
    from support.redis_server import RedisNode, redis_available

    if redis_available() is not None:
        pytest.skip(redis_available())
    chunk, interval, n = 32, 128, 320
    case = zoo.gemma_swa(window=24, max_tokens=n)
    tokens = zoo.random_tokens(rng, n)
    tables = zoo.random_tables(case, n, rng)
    with RedisNode(tmp_path / "redis") as node:
        remote = dict(remote_url=node.url, remote_timeout_s=5.0)
        engine = _engine(case, chunk, interval, **remote)
        engine.store(tokens, tables)
        assert engine.storage.flush(30)
        assert engine.storage.tier_stats()["tiers"][0]["writer"]["written"] == n // chunk + engine.stats.window_pieces_stored
        engine.close()
        dst = case.clone(fill=0)
        reader = KVCacheEngine(dst.layout(), zoo.small_config(chunk, restore_interval_tokens=interval, **remote))
        try:
            assert reader.lookup(tokens[:300]) == 256
            dst_tables = zoo.random_tables(case, n, rng)
            expected = zoo.expected_restore(case, dst.clone(), tables, dst_tables, 256)
            assert reader.retrieve(tokens[:300], dst_tables) == 256
            assert dst.first_difference(expected) is None
            assert reader.stats.window_pieces_retrieved == len(reader.parts.pieces)  # one window part
            # the prompt's prefix parts (acquired before the gate, as whole chunks always were) + one window part
            assert len(reader.pool) == 300 // chunk + len(reader.parts.pieces)
        finally:
            reader.close()


def _store_in_steps(engine, tokens, tables, step: int, lookahead: bool = True) -> None:
    """Store ``tokens`` as vLLM's connector does under chunked prefill: the full chunks computed
    by every step end, a step end short of the prompt's last full chunk (``step_end``), with
    the prompt's next chunk of tokens (``then``; none with ``lookahead`` False)."""
    chunk = engine.config.chunk_size
    last, stored = len(tokens) // chunk * chunk, 0
    for computed in range(step, len(tokens) + step, step):
        end = min(computed, len(tokens)) // chunk * chunk
        if end <= stored:
            continue
        mask = np.ones(end, np.bool_)
        mask[:stored] = False
        then = tokens[end : end + chunk] if lookahead and end < last else None
        engine.store(tokens[:end], tables, mask, step_end=end < last, continues=stored > 0, then=then)
        stored = end


def test_prefill_step_ends_keep_no_window_part_by_default(rng):
    case, chunk = zoo.build("gemma3-swa", max_tokens=400), 32
    tokens = zoo.random_tokens(rng, 300)
    tables = zoo.random_tables(case, 300, rng, keep=zoo.window_keep(case, zoo.chunk_bounds_ref(300, chunk, False)))
    engine = _engine(case, chunk, 10**6)
    _store_in_steps(engine, tokens, tables, 96)
    assert engine.stats.stored_chunks == 9 and engine.stats.window_parts_stored == 1  # the prompt's end only
    assert engine.lookup(tokens[:150]) == 0  # the step ends 96 and 192 are no restore points
    _check_restore(case, engine, tokens, tables, 288, rng)


def test_a_prefix_walked_again_in_steps_keeps_only_its_branch_point(rng):
    """A request that recomputes a stored prefix (its window rows were never kept where it
    diverges) in one-chunk steps: each step end lies inside the stored prefix. With the prompt's
    next chunk known, only the step end where it leaves the prefix (192) gets a window part, as
    the engine API's single store makes; without it, every step end in the prefix does."""
    case, chunk = _case("gemma3-swa-w24", max_tokens=700), 32
    tokens = zoo.random_tokens(rng, 300)
    branch = np.concatenate([tokens[:192], zoo.random_tokens(rng, 108)])
    tables = zoo.random_tables(case, 700, rng, keep=zoo.window_keep(case, zoo.chunk_bounds_ref(700, chunk, False)))
    parts = {}
    for lookahead in (True, False):
        engine = _engine(case, chunk, 10**6)
        engine.store(tokens, tables)
        assert engine.lookup(branch) == 0  # no window rows at 192: the branch recomputes from 0
        before = engine.stats.window_parts_stored
        _store_in_steps(engine, branch, tables, chunk, lookahead)
        parts[lookahead] = engine.stats.window_parts_stored - before
        assert engine.lookup(branch[:250]) == 192
        _check_restore(case, engine, branch[:250], tables, 192, rng)
        engine.close()
    api = _engine(case, chunk, 10**6)
    api.store(tokens, tables)
    before = api.stats.window_parts_stored
    api.store(branch, tables)
    assert parts[True] == api.stats.window_parts_stored - before == 2  # the branch point and the end
    assert parts[False] == 7  # 32, 64, ..., 192 and the end
    api.close()


def test_step_end_window_parts_are_first_evicted(rng):
    """With ``step_end_window_parts`` a step end is a restore point while its window part lives; the
    pool evicts those parts before any other object (kept restore points' parts, prefix parts)."""
    case, chunk = _case("gemma3-swa-w24", max_tokens=700), 32  # a window within a chunk: points exact
    tokens = zoo.random_tokens(rng, 300)
    other = zoo.random_tokens(rng, 300)
    tables = zoo.random_tables(case, 700, rng, keep=zoo.window_keep(case, zoo.chunk_bounds_ref(700, chunk, False)))
    probe = _engine(case, chunk, 10**6, step_end_window_parts=True)
    _store_in_steps(probe, tokens, tables, 96)
    used, short_lived = probe.pool.stats().used_slots, probe.pool.stats().demotions
    assert probe.stats.window_parts_stored == 3 and short_lived > 0
    assert probe.lookup(tokens[:150]) == 96 and probe.lookup(tokens[:250]) == 192  # the step ends serve while they live
    _check_restore(case, probe, tokens[:200], tables, 192, rng)
    slot_gb = probe.pool.stats().slot_bytes / (1 << 30)
    probe.close()

    # a pool with room for this prompt and nothing else: the next store must evict
    engine = _engine(case, chunk, 10**6, step_end_window_parts=True, max_local_cpu_size=used * slot_gb + 1e-12)
    assert engine.pool.num_slots == used
    _store_in_steps(engine, tokens, tables, 96)
    evicted = []
    engine.pool.on_evict.append(lambda entry: evicted.append(bytes(entry.key)))
    engine.store(other[:2 * chunk], tables)  # two prefix parts and one window part's pieces (its end)
    assert 0 < len(evicted) <= short_lived
    short_keys = {bytes(window_key(c.key, p)) for c in engine._chunks(tokens, False, None, None)
                  for p in range(len(engine.parts.pieces))}
    assert set(evicted) <= short_keys  # only window pieces went, and only those of step ends
    assert engine.lookup(tokens[:300]) == 288  # the prompt's end, a kept restore point, is whole
    _check_restore(case, engine, tokens, tables, 288, rng)
    engine.close()
