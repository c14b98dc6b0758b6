"""Restores verified in production (issue 39 item 4; kvconnect/restore/verify.py), in the core.

A real ``KVCacheEngine`` over the zoo's layouts (tests/support/zoo.py: engine-native tensors,
DeepSeek V4's seven caches with split rows included, whose real forward does not run on this
machine's CPU): a prompt is stored, a lookup with ``verify=True`` is sampled (rate 1.0) and
returns 0, a second store of the same blocks compares the freshly gathered rows with the
stored objects. The faults are made by the test in the stored bytes (the pool's slots) or in
the engine's blocks before the second store, never by a product code path:

- clean: every object passes bit-exactly (``exact``), nothing retired, hits served after;
- two planes swapped, a row shifted by one block, a state snapshot taken at another
  position: a ``mismatch`` naming the plane and rows, the fingerprint retired (lookups,
  retrieves and stores are 0 from then on);
- a float plane recomputed within rounding: ``within_tolerance``; far from it: ``mismatch``;
- a stored object gone before the check: ``unverifiable``, never a mismatch.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.zoo import build, random_tables, random_tokens, small_config, window_keep

from kvconnect import KVCacheEngine
from kvconnect.config import Config, DEFAULT_VERIFY_FIRST
from kvconnect.errors import ConfigError
from kvconnect.metrics.figures import engine_figures
from kvconnect.restore.parts import window_key
from kvconnect.restore.verify import TOLERANCES, compare

CASES = ["llama-flash", "vllm-cpu", "dsv3-mla", "dsv4-flash", "dsv4-flash-packed", "gemma3-swa", "state-hybrid"]


def _setup(name: str, *, rate: float = 1.0, tokens: int | None = None, seed: int = 0):
    case = build(name).randomize(seed)
    chunk = 256 if name.startswith("dsv4") else 64
    n = tokens or (2 * chunk + 5)
    rng = np.random.default_rng(seed)
    keep = None
    if name.startswith("dsv4"):  # too few blocks for dense windowed tables: the windows' blocks only
        keep = window_keep(case, [(s, min(s + chunk, n)) for s in range(0, n // chunk * chunk, chunk)])
    tables = random_tables(case, n, rng, keep=keep)
    engine = KVCacheEngine(case.layout(), small_config(chunk, verify_rate=rate, verify_first=0))
    tok = random_tokens(rng, n)
    assert engine.store(tok, tables) > 0
    return case, engine, tok, tables, chunk


def _objects(engine, tok):
    """(key, pool entry) of every stored object of ``tok`` (prefix parts and window pieces)."""
    out = []
    for c in engine.chunks(tok, include_partial=False):
        keys = [c.key] + ([window_key(c.key, p) for p in range(len(engine.parts.pieces))] if engine.parts.split else [])
        for key, entry in zip(keys, engine.pool.acquire(keys, touch=False)):
            if entry is not None:
                out.append((c, key, entry))
                engine.pool.release([entry])
    return out


def _verify(engine, tok, tables) -> int:
    hit = engine.restore.lookup(engine.chunks(tok, include_partial=True))
    assert hit > 0
    assert engine.lookup(tok, verify=True) == 0  # sampled: served as a miss
    engine.store(tok, tables)  # the engine computed the prefix: its store compares
    return hit


def _checks(engine) -> dict:
    return engine.verifier.snapshot()[0]


@pytest.mark.parametrize("name", CASES)
def test_clean_recompute_passes_bit_exactly(name):
    case, engine, tok, tables, _ = _setup(name)
    try:
        _verify(engine, tok, tables)
        checks = _checks(engine)
        assert checks and all(result == "exact" for _, result in checks)
        assert not engine.verifier.retired and engine.verifier.take_mismatches() == []
        engine.verifier.rate = 0.0
        assert engine.lookup(tok, verify=True) > 0  # nothing retired: hits are served again
        f = engine_figures(engine)
        assert f.get("kvconnect_verify_requests_total") == 1 and f.get("kvconnect_verify_retired") == 0
        assert sum(f.get("kvconnect_verify_checks_total", kind, "exact") for kind, _ in checks) == sum(checks.values())
    finally:
        engine.close()


def _swap_planes(engine, entry) -> bool:
    """Swap the rows of the first two planes of one row width an object holds (K and V of a
    layer; DeepSeek V4's C4 and C128 records), over the rows both hold."""
    rows = entry.header.plane_rows
    rb = [p.row_bytes for p in engine.layout.planes]
    offs = np.cumsum([0] + [n * b for (_, n), b in zip(rows, rb)])
    held = [i for i, (_, n) in enumerate(rows) if n]
    for i in held:
        for j in held:
            if j > i and rb[i] == rb[j]:
                size = min(rows[i][1], rows[j][1]) * rb[i]
                view = engine.pool.slot_view(entry.slot)
                a = view[offs[i]: offs[i] + size].clone()
                view[offs[i]: offs[i] + size] = view[offs[j]: offs[j] + size]
                view[offs[j]: offs[j] + size] = a
                return True
    return False


@pytest.mark.parametrize("name", CASES)
def test_two_planes_swapped_is_a_mismatch_and_retires_the_layout(name):
    case, engine, tok, tables, _ = _setup(name)
    try:
        c = next((c for c, _, entry in _objects(engine, tok) if _swap_planes(engine, entry)), None)
        assert c is not None, "every layout here has an object with two planes of one size"
        _verify(engine, tok, tables)
        assert any(result == "mismatch" for _, result in _checks(engine))
        assert engine.verifier.retired
        (mismatch,) = engine.verifier.take_mismatches()
        assert mismatch.chunk.index == c.index and mismatch.diffs
        text = mismatch.describe(engine.layout)
        assert f"chunk {c.index}" in text and "rows" in text and "plane" in text
        # retired: no hit, no load, no store for this layout from now on
        assert engine.lookup(tok) == 0
        assert engine.retrieve(tok, tables) == 0
        stored = engine.stats.stored_chunks
        other = random_tokens(np.random.default_rng(9), len(tok))
        engine.store(other, tables)
        assert engine.stats.stored_chunks == stored
        assert engine_figures(engine).get("kvconnect_verify_retired") == 1
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["llama-flash", "vllm-cpu", "dsv3-mla", "dsv4-flash", "gemma3-swa"])
def test_a_row_shifted_by_one_block_is_a_mismatch(name):
    """The stored rows of the first chunk come from the blocks one later in the table (what a
    block-table offset bug would store): the fresh rows of the right blocks differ."""
    case, engine, tok, tables, chunk = _setup(name)
    try:
        shifted = [list(t[1:]) + [t[0]] for t in tables]
        wrong = KVCacheEngine(case.layout(), small_config(chunk))
        try:  # the same layout's rows gathered from the shifted blocks, under the same keys
            wrong.store(tok, shifted)
            for c, key, entry in _objects(engine, tok):
                (bad,) = wrong.pool.acquire([key], touch=False)
                if bad is not None and bad.header.payload_bytes == entry.header.payload_bytes:
                    engine.pool.slot_view(entry.slot)[: entry.header.payload_bytes] = \
                        wrong.pool.slot_view(bad.slot)[: bad.header.payload_bytes]
                wrong.pool.release([bad])
        finally:
            wrong.close()
        _verify(engine, tok, tables)
        assert engine.verifier.retired
        assert any(result == "mismatch" for _, result in _checks(engine))
    finally:
        engine.close()


def test_a_state_snapshot_from_the_wrong_position_is_a_mismatch():
    """state-hybrid: the window part at a restore point holds the recurrent state of another
    position (the snapshot of the chunk before), as an off-by-one in the offered block would."""
    case, engine, tok, tables, chunk = _setup("state-hybrid", tokens=3 * 64)
    try:
        chunks = engine.chunks(tok, include_partial=False)
        pieces = range(len(engine.parts.pieces))
        last = [e for e in engine.pool.acquire([window_key(chunks[-1].key, p) for p in pieces], touch=False)]
        before = [e for e in engine.pool.acquire([window_key(chunks[-2].key, p) for p in pieces], touch=False)]
        swapped = 0
        for a, b in zip(last, before):
            if a is not None and b is not None and a.header.payload_bytes == b.header.payload_bytes:
                engine.pool.slot_view(a.slot)[: a.header.payload_bytes] = engine.pool.slot_view(b.slot)[: b.header.payload_bytes]
                swapped += 1
        engine.pool.release(last + before)
        assert swapped
        _verify(engine, tok, tables)
        assert ("state", "mismatch") in _checks(engine)
        mismatches = engine.verifier.take_mismatches()
        assert mismatches and all(m.group_kinds == ("state",) for m in mismatches)
    finally:
        engine.close()


def test_a_stored_object_gone_before_the_check_is_unverifiable_not_a_mismatch():
    case, engine, tok, tables, _ = _setup("llama-flash")
    try:
        assert engine.lookup(tok, verify=True) == 0
        for c in engine.chunks(tok, include_partial=False):
            engine.storage.drop(c.key)
        engine.store(tok, tables)
        checks = _checks(engine)
        assert checks and all(result == "unverifiable" for _, result in checks)
        assert not engine.verifier.retired
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_float_rows_within_rounding_pass_and_beyond_fail(dtype):
    """Per-dtype tolerance, relative to the row's largest magnitude (TOLERANCES). ``compare``
    reads only the planes' dtype, row bytes, name and group: one plane of 64 values here."""
    torch_dtype = getattr(torch, dtype)
    size = torch.empty(0, dtype=torch_dtype).element_size()
    layout = SimpleNamespace(planes=[SimpleNamespace(dtype=dtype, row_bytes=64 * size, layer_name="l0", group_index=0)])
    rows = [(3, 2)]
    base = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(torch_dtype)
    stored = base.view(torch.uint8).numpy().reshape(-1).copy()
    scale = float(base.abs().max())
    close = base.double().clone()
    close[0, 0] += TOLERANCES[dtype] * scale * 0.5
    close = close.to(torch_dtype)
    far = base.double().clone()
    far[1, 7] += TOLERANCES[dtype] * scale * 8
    far = far.to(torch_dtype)
    assert not torch.equal(close, base)
    ok = compare(layout, rows, close.view(torch.uint8).numpy().reshape(-1), rows, stored)
    bad = compare(layout, rows, far.view(torch.uint8).numpy().reshape(-1), rows, stored)
    assert compare(layout, rows, stored.copy(), rows, stored).outcomes == {0: "exact"}
    assert ok.outcomes == {0: "within_tolerance"}
    assert bad.outcomes == {0: "mismatch"}
    (diff,) = bad.diffs
    assert (diff.first_row, diff.last_row, diff.rows_differing, diff.rows_compared) == (4, 4, 1, 2)
    assert math.isfinite(diff.max_abs_diff)


def test_byte_planes_are_compared_bit_exactly():
    """uint8 planes (DeepSeek V4's split sub-planes, fp8 caches): one flipped bit is a mismatch."""
    case = build("dsv4-flash")
    layout = case.layout()
    i = next(k for k, p in enumerate(layout.planes) if p.dtype == "uint8")
    rows = [(0, 0)] * len(layout.planes)
    rows[i] = (0, 1)
    stored = np.zeros(layout.planes[i].row_bytes, np.uint8)
    fresh = stored.copy()
    fresh[5] ^= 1
    assert compare(layout, rows, fresh, rows, stored).outcomes == {layout.planes[i].group_index: "mismatch"}


def test_first_checks_after_start_are_all_verified_then_the_rate_samples():
    case, engine, tok, tables, _ = _setup("llama-flash", rate=0.0)
    engine.close()
    engine = KVCacheEngine(case.layout(), small_config(64, verify_rate=0.0, verify_first=3))
    try:
        engine.store(tok, tables)
        assert engine.verifier.enabled
        for passed in (2, 4):  # every hit verified until 3 checks (stored objects, 2 per prompt here) passed
            assert engine.lookup(tok, verify=True) == 0
            engine.store(tok, tables)
            assert engine.verifier.passed == passed
        assert engine.lookup(tok, verify=True) > 0  # then rate 0: served
        assert engine.lookup(tok) > 0
    finally:
        engine.close()


def test_rate_zero_and_no_first_checks_is_off():
    case, engine, tok, tables, _ = _setup("llama-flash", rate=0.0)
    try:
        assert not engine.verifier.enabled and engine.restore.writer.check is None
        assert engine.lookup(tok, verify=True) > 0
    finally:
        engine.close()


def test_verify_settings_are_read_and_checked():
    assert Config().verify_rate == 0 and Config().verify_first_checks == 0
    assert Config(verify_rate=0.01).verify_first_checks == DEFAULT_VERIFY_FIRST
    assert Config(verify_rate=0.01, verify_first=0).verify_first_checks == 0
    env = Config.from_env({"KVCONNECT_VERIFY_RATE": "0.25", "KVCONNECT_VERIFY_FIRST": "3"})
    assert (env.verify_rate, env.verify_first_checks) == (0.25, 3)
    assert Config.from_dict({"verify_rate": 1}).verify_rate == 1.0
    for bad in ({"KVCONNECT_VERIFY_RATE": "1.5"}, {"KVCONNECT_VERIFY_RATE": "-0.1"}, {"KVCONNECT_VERIFY_RATE": "nan"},
                {"KVCONNECT_VERIFY_RATE": "often"}, {"KVCONNECT_VERIFY_FIRST": "-2"}, {"KVCONNECT_VERIFY_FIRST": "1.5"}):
        with pytest.raises(ConfigError, match="(?i)verify"):
            Config.from_env(bad)


def test_checks_gathered_in_several_scratch_batches_find_the_one_bad_object(monkeypatch):
    """Fresh rows are gathered in batches that fit a reused scratch buffer (verify.SCRATCH_BYTES):
    with a batch of one object, the swapped object is still the one mismatch, the others pass."""
    from kvconnect.restore import verify

    monkeypatch.setattr(verify, "SCRATCH_BYTES", 1)
    case, engine, tok, tables, _ = _setup("llama-flash", tokens=4 * 64)
    try:
        objects = _objects(engine, tok)
        assert _swap_planes(engine, objects[2][2])
        _verify(engine, tok, tables)
        assert _checks(engine) == {("full", "exact"): 3, ("full", "mismatch"): 1}
        (mismatch,) = engine.verifier.take_mismatches()
        assert mismatch.chunk.index == objects[2][0].index
    finally:
        engine.close()


def test_a_pd_probe_over_the_lookup_channel_is_never_sampled(tmp_path):
    """The vLLM lookup channel marks a P/D wait's probe (``count=False``): the worker serves its
    hit as it is (a sampled probe would read as "not landed yet" and hold the request until its
    timeout); the request's own lookup is sampled. The handler forwards ``verify`` as the vLLM
    worker does (KVConnectWorker.lookup)."""
    from kvconnect.integrations.vllm.lookup_channel import LookupClient, LookupServer

    case, engine, tok, tables, _ = _setup("llama-flash")

    class Handler:
        def lookup(self, tokens, namespace=b"", generation=None, media=(), verify=True):
            return engine.lookup(tokens, namespace=namespace, generation=generation, media=media, verify=verify)

        def stats(self):
            return {}

        def clear(self, generation=None, retire=None):
            pass

        def retired(self, generation):
            return False

    address = f"ipc://{tmp_path}/kvc"
    server = LookupServer(address, Handler())
    client = LookupClient([address], timeout_s=30.0)
    try:
        hit = engine.restore.lookup(engine.chunks(tok, include_partial=True))
        assert client.lookup(tok, count=False) == hit > 0
        assert engine.verifier.snapshot()[1] == 0
        assert client.lookup(tok) == 0  # the request's lookup: sampled at rate 1.0
        assert engine.verifier.snapshot()[1] == 1
    finally:
        client.close()
        server.close()
        engine.close()
