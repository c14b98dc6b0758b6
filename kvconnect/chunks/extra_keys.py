"""Per-chunk extra keys: what besides a chunk's token ids decides its KV (multimodal items).

A multimodal prompt stands each image (audio clip, video) for a run of placeholder tokens
whose ids are the same for every image: the tokens alone do not decide the KV. As vLLM's
own block hash does (``vllm/v1/core/kv_cache_utils.py``, ``_gen_mm_extra_hash_keys``), a
chunk that covers part of an item's placeholder range is keyed by that item's hash (vLLM:
``MultiModalFeatureSpec.identifier``) and where the item starts relative to the chunk
(vLLM: ``(identifier, offset - start_token_idx)``): the same image at the same place gives
the same keys, another image behind the same placeholder tokens other keys, and the chunks
before the first item have no extras and stay shared with text-only prompts.

``MediaItem`` is one item of a prompt; ``media_extras(items, bounds)`` gives each chunk's
``ChunkExtras`` (empty when the chunk touches no item); ``extras_bytes`` is how the key
chain (kvconnect/chunks/keys.py) folds them into that chunk's step. An extras value is
plain data: it travels in the vLLM adapter's lookup messages and plans as (identifier,
offset, length) triples, and in chunk events as the per-chunk pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import TokenError

ChunkExtras = tuple[tuple[str, int], ...]  # per chunk: (item identifier, item offset - chunk start), in item order

MAX_ITEMS = 4096  # a prompt's items, as the lookup channel accepts them
MAX_IDENTIFIER_BYTES = 1024
EXTRAS_TAG = b"\x03"


@dataclass(frozen=True)
class MediaItem:
    """One multimodal item of a prompt: its placeholder tokens are [offset, offset + length)."""

    identifier: str  # the item's content hash (vLLM: MultiModalFeatureSpec.identifier)
    offset: int
    length: int


def media_items(triples: Sequence) -> tuple[MediaItem, ...]:
    """Items from (identifier, offset, length) triples, checked: identifiers non-empty str of
    at most MAX_IDENTIFIER_BYTES, offsets >= 0 and non-decreasing, lengths > 0; TokenError otherwise."""
    if len(triples) > MAX_ITEMS:
        raise TokenError(f"a prompt holds at most {MAX_ITEMS} multimodal items, got {len(triples)}")
    out: list[MediaItem] = []
    for triple in triples:
        item = triple if isinstance(triple, MediaItem) else MediaItem(*triple)
        ok = (isinstance(item.identifier, str) and 0 < len(item.identifier.encode("utf-8")) <= MAX_IDENTIFIER_BYTES
              and isinstance(item.offset, int) and isinstance(item.length, int) and item.offset >= 0 and item.length > 0)
        if not ok:
            raise TokenError(f"a multimodal item needs a non-empty identifier, offset >= 0 and length > 0, got {item!r}")
        if out and item.offset < out[-1].offset:
            raise TokenError("multimodal items must be sorted by offset")
        out.append(item)
    return tuple(out)


def as_triples(items: Sequence[MediaItem]) -> list[list]:
    """Items as plain (identifier, offset, length) lists (msgpack / plan form)."""
    return [[item.identifier, item.offset, item.length] for item in items]


def media_extras(items: Sequence[MediaItem], bounds: Sequence[tuple[int, int]]) -> list[ChunkExtras]:
    """Each chunk's extras: the items whose placeholder range overlaps [start, end), with
    their offset relative to the chunk's start (negative for an item begun in an earlier chunk)."""
    out: list[ChunkExtras] = []
    for start, end in bounds:
        out.append(tuple((item.identifier, item.offset - start) for item in items
                         if item.offset < end and item.offset + item.length > start))
    return out


def extras_bytes(extras: ChunkExtras) -> bytes:
    """The bytes a chunk's step appends after its token bytes; b"" for no extras.

    payload = for each item: u32 len(identifier) || identifier (UTF-8) || i64 offset, zero-padded
    to a multiple of 4; appended: payload || u32 len(payload) || EXTRAS_TAG (little-endian).
    A chunk without extras hashes its token bytes only (a multiple of 4 bytes); one with
    extras hashes 1 more than a multiple of 4, so no token sequence reproduces it, and the
    suffix (tag, length) splits tokens from payload, whose items are length-prefixed."""
    if not extras:
        return b""
    parts = []
    for identifier, offset in extras:
        ident = identifier.encode("utf-8")
        parts.append(len(ident).to_bytes(4, "little") + ident + int(offset).to_bytes(8, "little", signed=True))
    payload = b"".join(parts)
    payload += b"\x00" * (-len(payload) % 4)
    return payload + len(payload).to_bytes(4, "little") + EXTRAS_TAG
