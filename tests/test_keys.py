"""Chunk keys: a pure function of tokens and identity, equal across processes, different
across anything that changes the stored bytes, and independent of the engine's block size."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from support import zoo
from kvconnect import DCPSpec, KVCacheEngine, TokenError
from kvconnect.chunks.keys import KEY_BYTES, ChunkKeyer, tokens_as_int64

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOKENS = (np.arange(1000, dtype=np.int64) * 7919) % 128_000

_KEYS_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from support import zoo
from kvconnect import DCPSpec
from kvconnect.chunks.keys import ChunkKeyer
from kvconnect.layout.rows import chunk_bounds
case = zoo.build({name!r}, max_tokens=300)
fp = case.layout().fingerprint
tokens = (np.arange(1000, dtype=np.int64) * 7919) % 128_000
keys = ChunkKeyer(fp, 256).keys(tokens, chunk_bounds(1000, 256, True))
print(fp.hex(), " ".join(k.hex() for k in keys))
"""


def _keys(layout, chunk=256, tokens=TOKENS, partial=True):
    from kvconnect.layout.rows import chunk_bounds

    return ChunkKeyer(layout.fingerprint, chunk).keys(tokens_as_int64(tokens), chunk_bounds(len(tokens), chunk, partial))


@pytest.mark.parametrize("name", ["dsv4-flash", "dsv3-mla-dcp"])
def test_keys_equal_across_processes(name):
    """A fresh interpreter (another hash seed) computes the same fingerprint and key chain."""
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", _KEYS_SCRIPT.format(tests=TESTS_DIR, name=name)],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    ).stdout.split()
    layout = zoo.build(name, max_tokens=300).layout()
    assert out[0] == layout.fingerprint.hex()
    assert out[1:] == [k.hex() for k in _keys(layout)]
    assert len(out[1:]) == 4


def test_key_chain_is_a_prefix_chain():
    layout = zoo.mla(max_tokens=300).layout()
    keys = _keys(layout, partial=False)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys) and len(set(keys)) == 3
    assert _keys(layout, tokens=TOKENS[:512], partial=False) == keys[:2]
    changed = TOKENS.copy()
    changed[600] += 1  # inside chunk 2
    other = _keys(layout, tokens=changed, partial=False)
    assert other[:2] == keys[:2] and other[2] != keys[2]
    changed[0] += 1  # chunk 0 changes every later key
    assert all(a != b for a, b in zip(_keys(layout, tokens=changed, partial=False), keys))
    # partial tails of different lengths are different chunks
    assert _keys(layout, tokens=TOKENS[:600])[2] != _keys(layout, tokens=TOKENS[:601])[2]


def test_keys_ignore_token_container():
    layout = zoo.mla(max_tokens=300).layout()
    base = _keys(layout)
    for form in (TOKENS.tolist(), TOKENS.astype(np.int32), torch.from_numpy(TOKENS), torch.from_numpy(TOKENS).to(torch.int32)):
        assert _keys(layout, tokens=form) == base


def test_keys_differ_across_identity_but_not_block_size():
    mla = zoo.mla(max_tokens=300)
    base = _keys(mla.layout())
    same = [
        zoo.mla(max_tokens=300, block_size=16).layout(),
        zoo.mla(max_tokens=300, block_size=128).layout(),
    ]
    for layout in same:
        assert _keys(layout) == base
    different = {
        "model": mla.layout(model_name="another-model"),
        "dtype": zoo.mla(max_tokens=300, dtype=torch.float16).layout(),
        "tp rank": mla.layout(tp_rank=1, tp_size=2),
        "tp size": mla.layout(tp_rank=0, tp_size=2),
        "dcp rank": zoo.mla(max_tokens=300, dcp=DCPSpec(rank=1, size=2)).layout(),
        "dcp size": zoo.mla(max_tokens=300, dcp=DCPSpec(rank=0, size=2)).layout(),
        "dcp interleave": zoo.mla(max_tokens=300, dcp=DCPSpec(rank=0, size=2, interleave_tokens=8)).layout(),
        "layers": zoo.mla(max_tokens=300, num_layers=3).layout(),
    }
    seen = {tuple(base)}
    for what, layout in different.items():
        keys = tuple(_keys(layout))
        assert keys not in seen, f"keys do not change with {what}"
        assert not set(keys) & set(base), f"{what}: a key collides with the base identity"
        seen.add(keys)
    assert not set(_keys(mla.layout(), chunk=128)) & set(base), "chunk size must change keys"


def test_engine_keys_match_keyer_and_miss_across_identity(rng):
    """End to end: another TP rank's engine finds nothing that this rank stored."""
    case = zoo.mla(max_tokens=600)
    tokens = zoo.random_tokens(rng, 512)
    tables = zoo.random_tables(case, 512, rng)
    engine = KVCacheEngine(case.layout(), zoo.small_config(256))
    assert engine.store(tokens, tables) == 512
    assert [c.key for c in engine.chunks(tokens, include_partial=False)] == _keys(case.layout(), tokens=tokens, partial=False)
    other = KVCacheEngine(case.layout(tp_rank=1, tp_size=2), zoo.small_config(256))
    assert other.storage.masks([c.key for c in other.chunks(tokens, include_partial=False)]) == [None, None]
    # the other rank may not import this rank's chunk either
    from kvconnect import CorruptChunkError

    data = engine.storage.export_chunk(engine.chunks(tokens, include_partial=False)[0].key)
    with pytest.raises(CorruptChunkError):
        other.storage.import_chunk(data, other.chunks(tokens, include_partial=False)[0].key)
    assert len(other.pool) == 0


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([1.0, 2.0]),
        np.array([[1, 2]]),
        np.array([True, False]),
        torch.tensor([1.5]),
        torch.tensor([[1, 2]]),
        torch.tensor([True]),
        [1, -2, 3],
        torch.tensor([0, -1]),
        ["a", "b"],
    ],
)
def test_bad_tokens(tokens):
    with pytest.raises(TokenError):
        tokens_as_int64(tokens)


def test_empty_tokens_have_no_keys():
    layout = zoo.mla(max_tokens=300).layout()
    assert tokens_as_int64([]).dtype == np.int64
    assert _keys(layout, tokens=np.zeros(0, np.int64)) == []


# -- namespaces (LoRA adapters, tenant salts) ----------------------------------------
def test_namespace_changes_every_key_and_empty_is_none():
    layout = zoo.mla(max_tokens=300).layout()
    keyer = ChunkKeyer(layout.fingerprint, 256)
    bounds = [(0, 256), (256, 512), (512, 768)]
    tok = tokens_as_int64(TOKENS[:768])
    base = keyer.keys(tok, bounds)
    assert keyer.keys(tok, bounds, "") == keyer.keys(tok, bounds, b"") == keyer.keys(tok, bounds, None) == base
    seen = {tuple(base)}
    for ns in ("tenant-a", "tenant-b", b"tenant-a\x00", "lora:sql-adapter", "\u00e9", b"\xff" * 4096):
        keys = keyer.keys(tok, bounds, ns)
        assert not set(keys) & set().union(*seen), f"{ns!r}: a key collides with another namespace's"
        assert keyer.keys(tok, bounds, ns) == keys  # pure
        seen.add(tuple(keys))
    assert keyer.keys(tok, bounds, "\u00e9") == keyer.keys(tok, bounds, "\u00e9".encode())  # str is its UTF-8


def test_namespace_chain_cannot_be_reproduced_by_tokens():
    """A namespace enters h_0 in unkeyed mode; chunk steps are keyed, so a prompt that spells
    the namespace's bytes as tokens does not land on the namespace's chain."""
    layout = zoo.mla(max_tokens=300).layout()
    keyer = ChunkKeyer(layout.fingerprint, 4)
    ns = np.arange(1, 5, dtype="<u4").tobytes()  # 16 bytes = the bytes of one 4-token chunk
    tok = tokens_as_int64(np.arange(100, 108))
    spelled = tokens_as_int64(np.concatenate([np.arange(1, 5), np.arange(100, 108)]))
    under_ns = keyer.keys(tok, [(0, 4), (4, 8)], ns)
    shifted = keyer.keys(spelled, [(0, 4), (4, 8), (8, 12)])
    assert not set(under_ns) & set(shifted)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    chunk=st.sampled_from([1, 3, 8]),
    namespaces=st.lists(st.binary(max_size=24), min_size=2, max_size=4, unique=True),
)
def test_namespaced_chains_are_prefix_chains_and_disjoint(tokens, chunk, namespaces):
    from kvconnect.layout.rows import chunk_bounds

    keyer = ChunkKeyer(zoo.mla(max_tokens=64).layout().fingerprint, chunk)
    tok = tokens_as_int64(np.array(tokens, dtype=np.int64))
    bounds = chunk_bounds(len(tok), chunk, True)
    chains = {ns: keyer.keys(tok, bounds, ns) for ns in namespaces}
    for ns, keys in chains.items():
        cut = len(bounds) // 2
        assert keyer.keys(tok[: bounds[cut - 1][1]] if cut else tok[:0], bounds[:cut], ns) == keys[:cut]
    seen: set = set()
    for keys in chains.values():  # no key of one namespace appears in another's chain
        assert not seen & set(keys)
        seen |= set(keys)


@pytest.mark.parametrize("bad", [7, ["a"], b"x" * 4097, "y" * 4097])
def test_bad_namespace_is_a_token_error(bad):
    layout = zoo.mla(max_tokens=300).layout()
    with pytest.raises(TokenError, match="namespace"):
        ChunkKeyer(layout.fingerprint, 256).keys(tokens_as_int64(TOKENS[:256]), [(0, 256)], bad)


def test_engine_namespaces_do_not_share_chunks(rng):
    case = zoo.mla(max_tokens=600)
    tokens = zoo.random_tokens(rng, 512)
    engine = KVCacheEngine(case.layout(), zoo.small_config(256))
    assert engine.store(tokens, zoo.random_tables(case, 512, rng), namespace="tenant-a") == 512
    assert engine.lookup(tokens, namespace="tenant-a") == 512
    assert engine.lookup(tokens) == 0 and engine.lookup(tokens, namespace="tenant-b") == 0
    dst = case.clone(fill=0x5A)
    before = dst.snapshot()
    dst_engine = KVCacheEngine(dst.layout(), zoo.small_config(256))
    assert zoo.transplant(engine, dst_engine, tokens) == 0  # no namespace: nothing to move
    moved = [(c.key, engine.storage.export_chunk(c.key)) for c in engine.chunks(tokens, include_partial=False, namespace="tenant-a")]
    assert all(dst_engine.storage.import_chunk(data, key) for key, data in moved)
    assert dst_engine.retrieve(tokens, zoo.random_tables(case, 512, rng), namespace="tenant-b") == 0
    assert dst.same_bytes(before)  # a miss writes nothing
    assert dst_engine.retrieve(tokens, zoo.random_tables(case, 512, rng), namespace="tenant-a") == 512
    with pytest.raises(TokenError):
        engine.lookup(tokens, namespace=3)
