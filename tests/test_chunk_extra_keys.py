"""Per-chunk extra keys (kvconnect/chunks/extra_keys.py): a chunk covering part of a multimodal
item's placeholders is keyed by the item's hash and offset; chunks without extras hash as in a
text-only prompt; the encoding is never a token sequence's; events and the lookup channel carry them."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "storage"))

import kv_rig  # noqa: E402
from kvconnect import TokenError  # noqa: E402
from kvconnect.chunks.extra_keys import MediaItem, extras_bytes, media_extras, media_items  # noqa: E402
from kvconnect.chunks.keys import ChunkKeyer  # noqa: E402
from kvconnect.integrations.vllm.lookup_channel import _media, pack_media  # noqa: E402
from kvconnect.layout.rows import chunk_bounds  # noqa: E402

C = kv_rig.CHUNK_TOKENS  # 32
N = 5 * C
IMAGE = MediaItem("img-a", C + 8, 2 * C)  # covers chunks 1 (from offset 8), 2 and 3 (its first 8 tokens)


def _keys(tokens, media=(), chunk=C):
    bounds = chunk_bounds(len(tokens), chunk, True)
    extras = media_extras(media_items(media), bounds) if media else None
    return ChunkKeyer(b"\x07" * 32, chunk).keys(np.asarray(tokens), bounds, None, extras)


def test_media_extras_name_the_items_a_chunk_covers_with_their_offset():
    bounds = chunk_bounds(N, C, True)
    second = MediaItem("img-b", 4 * C - 4, 4)  # ends exactly at chunk 3's end
    assert media_extras((IMAGE, second), bounds) == [
        (), (("img-a", 8),), (("img-a", 8 - C),), (("img-a", 8 - 2 * C), ("img-b", C - 4)), ()]


def test_a_chunk_without_extras_hashes_as_in_a_text_prompt():
    tokens = kv_rig.tokens(0, N)
    plain = _keys(tokens)
    keyed = _keys(tokens, (IMAGE,))
    assert keyed[0] == plain[0]  # text before the first image is shared with text-only prompts
    assert all(a != b for a, b in zip(keyed[1:], plain[1:]))  # the image's chunks, and every chunk after them
    # extras of empty chunks everywhere equal no extras at all
    assert ChunkKeyer(b"\x07" * 32, C).keys(tokens, chunk_bounds(N, C, True), None, [()] * 5) == plain


def test_same_image_same_place_same_keys_other_image_or_place_other_keys():
    tokens = kv_rig.tokens(0, N)
    keyed = _keys(tokens, (IMAGE,))
    assert _keys(tokens, (MediaItem("img-a", C + 8, 2 * C),)) == keyed
    other = _keys(tokens, (MediaItem("img-b", C + 8, 2 * C),))
    assert other[0] == keyed[0] and all(a != b for a, b in zip(other[1:], keyed[1:]))
    moved = _keys(tokens, (MediaItem("img-a", C + 9, 2 * C),))
    assert moved[0] == keyed[0] and all(a != b for a, b in zip(moved[1:], keyed[1:]))


def test_extras_are_never_a_token_sequence():
    """Token bytes are a multiple of 4 long; a step with extras hashes 1 more than a multiple of 4."""
    for extras in ((("a", 0),), (("img", -5), ("bé", 7)), (("x" * 13, 1 << 40),)) + tuple(((("i" * k), 0),) for k in range(1, 9)):
        data = extras_bytes(extras)  # padded payload (4m) + its length (4) + the tag (1)
        assert len(data) % 4 == 1 and data.endswith(b"\x03")
    assert extras_bytes(()) == b""


@pytest.mark.parametrize("bad", [
    [("", 0, 4)], [("a", -1, 4)], [("a", 0, 0)], [(b"a", 0, 4)], [("a", 5, 4), ("b", 2, 4)], [("a" * 2000, 0, 4)],
])
def test_bad_items_are_refused_before_any_key(bad):
    with pytest.raises(TokenError):
        media_items(bad)


def test_lookup_channel_round_trips_media_and_refuses_bad_ones():
    items = (IMAGE, MediaItem("img-b", 200, 16))
    assert _media({"mm": pack_media(items)}) == items
    assert _media({}) == ()
    for raw in (b"\x93\xa1a\x00\x04", pack_media(()) + b"x", 5):
        with pytest.raises(Exception):
            _media({"mm": raw})


def test_engine_hits_the_same_image_misses_another_and_shares_the_text_before_it(tmp_path):
    layout = kv_rig.mla_layout()
    eng = kv_rig.make_engine(layout)
    log = eng.enable_events()
    seed = 3
    table = kv_rig.block_table(layout, N)
    kv_rig.write_rows(layout, table, seed, N)
    tokens = kv_rig.tokens(seed, N)
    assert eng.store(tokens, table, media=(IMAGE,)) == N
    stored = [e for e in log.drain() if e.kind == "stored"]
    assert [e.extra_keys for e in stored] == [(), (("img-a", 8),), (("img-a", 8 - C),), (("img-a", 8 - 2 * C),), ()]
    assert eng.lookup(tokens, media=(IMAGE,)) == N
    assert eng.lookup(tokens, media=(MediaItem("img-b", C + 8, 2 * C),)) == C  # only the text before the image
    assert eng.lookup(tokens) == C  # a text-only prompt of the same ids shares chunk 0 only
    kv_rig.wipe(layout)
    assert eng.retrieve(tokens, table, media=(IMAGE,)) == N
    kv_rig.assert_restored(layout, table, seed, N)
    eng.close()
