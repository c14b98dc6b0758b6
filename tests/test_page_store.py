"""PageStore and page-key folding: pages stored under engine-supplied keys (SGLang HiCache).

Byte-exact round trips over page planes with padded, strided page grids and random page
indices; bytes outside the target pages untouched; keys folded with the layout identity;
a corrupted or truncated page on disk is a miss; an unreachable remote tier is a miss within
its timeout; the page-count restore rule agrees with SGLang's own rules (brute force).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.config import Config
from kvconnect.engine import KVCacheEngine
from kvconnect.errors import BlockTableError, TokenError
from kvconnect.layout.kv_layout import KVLayout
from kvconnect.chunks.page_keys import PageKeyFolder, page_chunks
from kvconnect.page_store import PageStore, restorable_prefixes
from kvconnect.layout.spec import GroupSpec

PAGE = 4


def sglang_key(i: int, salt: str = "") -> str:
    import hashlib

    return hashlib.sha256(f"{salt}page{i}".encode()).hexdigest()


def page_layout(num_pages=12, pieces=((3, 40), (2, 24)), *, model="m", identity=None, padded=8):
    """Two pools as SGLang describes them: each piece a [num_pages, bytes] view with padding between pages."""
    kv, groups, layer_groups, backing = {}, [], {}, []
    for g, (count, nbytes) in enumerate(pieces):
        base = torch.randint(0, 256, (num_pages * (count * nbytes + padded),), dtype=torch.uint8)
        backing.append(base)
        stride = count * nbytes + padded
        kv[f"pool{g}"] = tuple(torch.as_strided(base, (num_pages, nbytes), (stride, 1), j * nbytes) for j in range(count))
        groups.append(GroupSpec(block_size=PAGE))
        layer_groups[f"pool{g}"] = g
    layout = KVLayout.from_tensors(kv, groups=groups, layer_groups=layer_groups, layout_hints="page", model_name=model,
                                   identity=identity or {})
    return layout, backing


def make_store(layout, tmp_path=None, **config):
    base = Config(chunk_size=PAGE, max_local_cpu_size=0.01, num_threads=1)
    if tmp_path is not None:
        base = dataclasses.replace(base, local_disk=str(tmp_path), max_local_disk_size=0.05)
    return PageStore(KVCacheEngine(layout, dataclasses.replace(base, **config)))


def page_bytes(layout, group, page):
    return [t[page].clone() for t, p in zip(layout.tensors, layout.planes) if p.group_index == group]


def test_keys_fold_identity_page_size_pool_and_namespace():
    layout, _ = page_layout()
    other_model, _ = page_layout(model="other")
    other_id, _ = page_layout(identity={"tp": "1/2"})
    keys = [sglang_key(i) for i in range(3)]
    a = PageKeyFolder(layout.fingerprint, PAGE).fold(keys)
    assert a == PageKeyFolder(layout.fingerprint, PAGE).fold(keys)  # deterministic across processes
    assert len({bytes(k) for k in a}) == 3 and all(len(k) == 16 for k in a)
    for other in (PageKeyFolder(other_model.fingerprint, PAGE), PageKeyFolder(other_id.fingerprint, PAGE),
                  PageKeyFolder(layout.fingerprint, 2 * PAGE), PageKeyFolder(layout.fingerprint, PAGE, namespace="pool1")):
        assert not set(a) & set(other.fold(keys))
    chunks = page_chunks(a, PAGE, first_page=2)
    assert [(c.start, c.end) for c in chunks] == [(8, 12), (12, 16), (16, 20)]
    with pytest.raises(TokenError):
        PageKeyFolder(layout.fingerprint, PAGE).fold([""])
    with pytest.raises(TokenError):
        PageKeyFolder(layout.fingerprint, PAGE).fold([123])


@given(st.data())
def test_round_trip_random_pages_byte_exact_and_nothing_else_touched(data):
    layout, _ = page_layout()
    store = make_store(layout)
    n = data.draw(st.integers(1, 6))
    src = data.draw(st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True))
    dst = data.draw(st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True))
    group = data.draw(st.integers(0, 1))
    keys = [sglang_key(i, "rt") for i in range(n)]
    want = [page_bytes(layout, group, p) for p in src]
    assert store.store(group, keys, np.array(src)) == [True] * n
    assert store.store(group, keys, np.array(src)) == [True] * n  # already stored: not rewritten
    assert store.counters.pages_stored == n
    before = [t.clone() for t in layout.tensors]
    assert store.leading_hits(group, keys + [sglang_key(99)]) == n
    assert store.leading_hits(1 - group, keys) == 0  # another pool's pages are other objects
    assert store.load(group, keys, np.array(dst)) == [True] * n
    planes = [i for i, p in enumerate(layout.planes) if p.group_index == group]
    for k, page in enumerate(dst):
        for j, plane in enumerate(planes):
            assert torch.equal(layout.tensors[plane][page], want[k][j])
    for i, (t, b) in enumerate(zip(layout.tensors, before)):
        touched = dst if layout.planes[i].group_index == group else []
        keep = [p for p in range(12) if p not in touched]
        assert torch.equal(t[keep], b[keep])
    store.engine.close()


def test_load_stops_at_the_first_missing_page_and_leaves_later_pages_alone():
    layout, _ = page_layout()
    store = make_store(layout)
    keys = [sglang_key(i, "lead") for i in range(4)]
    store.store(0, [keys[0], keys[2], keys[3]], np.array([0, 2, 3]))
    before = [t.clone() for t in layout.tensors]
    assert store.load(0, keys, np.array([8, 9, 10, 11])) == [True, False, False, False]
    assert store.load(0, keys, np.array([8, 9, 10, 11]), leading_only=False) == [True, False, True, True]
    assert torch.equal(layout.tensors[0][9], before[0][9])
    store.engine.close()


def test_bad_page_indices_raise_before_anything_moves():
    layout, _ = page_layout()
    store = make_store(layout)
    with pytest.raises(BlockTableError):
        store.store(0, [sglang_key(1)], np.array([12]))
    with pytest.raises(BlockTableError):
        store.load(0, [sglang_key(1), sglang_key(2)], np.array([1]))
    assert store.counters.pages_stored == 0
    store.engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_page_on_disk_is_a_miss_never_loaded(tmp_path, damage):
    layout, _ = page_layout()
    store = make_store(layout, tmp_path)
    keys = [sglang_key(i, damage) for i in range(3)]
    store.store(0, keys, np.array([0, 1, 2]))
    assert store.engine.storage.flush(10)
    store.engine.close()
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".kvc"))
    assert len(files) == 3
    victim = files[0]
    if damage == "flip":
        with open(victim, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\xff\x00\xff")
    elif damage == "truncate":
        os.truncate(victim, os.path.getsize(victim) - 7)
    # "foreign": the files stay intact and another deployment (other model) reads the tier
    layout2, _ = page_layout(model="foreign" if damage == "foreign" else "m")
    fresh = make_store(layout2, tmp_path)
    before = [t.clone() for t in layout2.tensors]
    loaded = fresh.load(0, keys, np.array([5, 6, 7]), leading_only=False)
    if damage == "foreign":
        assert loaded == [False, False, False]  # keys and files of another layout never match
    else:
        assert sum(loaded) == 2
    for i, ok in enumerate(loaded):
        if not ok:
            assert all(torch.equal(t[5 + i], b[5 + i]) for t, b in zip(layout2.tensors, before))
    fresh.engine.close()


def test_unreachable_remote_tier_is_a_fast_miss():
    layout, _ = page_layout()
    store = make_store(layout, remote_url="redis://127.0.0.1:1", remote_timeout_s=0.2)
    keys = [sglang_key(i, "remote") for i in range(3)]
    start = time.monotonic()
    assert store.leading_hits(0, keys) == 0
    assert store.load(0, keys, np.array([0, 1, 2])) == [False] * 3
    assert store.store(0, keys, np.array([0, 1, 2])) == [True] * 3  # the pool holds them
    assert time.monotonic() - start < 5
    store.engine.close()


def _sglang_rule(windows, present):
    """SGLang 0.5.23 HiCacheFile.batch_exists_v2's rules, written out: legal prefix ends."""
    n = len(present[0])
    kv = next((i for i in range(n) if not present[0][i]), n)
    legal = set(range(1, kv + 1))
    for w, p in zip(windows[1:], present[1:]):
        if w is None:
            b = next((i for i in range(kv) if not p[i]), kv)
            legal &= set(range(1, b + 1))
        else:
            legal &= {P for P in range(1, kv + 1) if all(p[i] for i in range(max(0, P - w), P))}
    return sorted(legal)


@given(st.data())
def test_restorable_prefixes_match_sglang_rules(data):
    n = data.draw(st.integers(0, 10))
    pools = data.draw(st.integers(0, 3))
    windows = [None] + [data.draw(st.one_of(st.none(), st.integers(1, 4))) for _ in range(pools)]
    present = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(pools + 1)]
    assert restorable_prefixes(1, windows, present) == _sglang_rule(windows, present)


def test_intact_chunk_with_other_rows_under_a_page_key_is_dropped_not_loaded():
    """A well-formed chunk (valid checksum) whose rows are not this pool's page: a miss, dropped."""
    from kvconnect.chunks import chunk_format
    from kvconnect.chunks.chunk_format import ChunkHeader

    layout, _ = page_layout()
    store = make_store(layout)
    (key,) = store.keys(0, [sglang_key(1, "odd")])
    rows = tuple((0, 1) if p.group_index == 1 else (0, 0) for p in layout.planes)  # pool 1's rows
    nbytes = sum(p.row_bytes for p in layout.planes if p.group_index == 1)
    header = ChunkHeader(fingerprint=layout.fingerprint, key=key, token_start=0, token_end=PAGE, group_mask=1,
                         plane_rows=rows, payload_bytes=nbytes)
    assert store.engine.storage.import_chunk(chunk_format.encode(header, np.zeros(nbytes, np.uint8)), key)
    before = [t.clone() for t in layout.tensors]
    assert store.load(0, [sglang_key(1, "odd")], np.array([3])) == [False]
    assert all(torch.equal(t, b) for t, b in zip(layout.tensors, before))
    assert store.counters.pages_corrupt == 1
    assert store.engine.storage.masks([key]) == [None]
    store.engine.close()
