"""Chunk keys from page keys an engine computed itself (SGLang's HiCache hands these out).

Some engines never show token ids to the cache: SGLang gives a storage backend one key per
page, ``hex(SHA-256(previous digest || page token ids))``, a chain, so a key already names its
whole prefix. kvconnect stores such a page as one chunk of ``page_tokens`` tokens under

    key = BLAKE3-keyed(key = BLAKE3(b"kvconnect-page-keys" || fingerprint || page_tokens
                                    [|| len(ns) || ns] [|| 0x02 || len(gen) || gen]),
                       data = the engine's page key bytes)[:16]

so the layout fingerprint (model, dtypes, row bytes, shard) and the page size decide which
deployments share a page: two deployments that must not share never do, whatever the engine
put in its keys. The engine's key is length-checked and hashed as given (a hex string as its
UTF-8 bytes); the domain tag keeps these keys apart from token-chain keys (kvconnect/chunks/keys.py).

``page_chunks`` gives the ``Chunk`` objects ``KVCacheEngine.store_chunks`` /
``lookup_chunks`` / ``retrieve_chunks`` take: chunk i covers tokens
``[(first_page + i) * page_tokens, (first_page + i + 1) * page_tokens)``.
"""

from __future__ import annotations

from typing import Sequence, Union

import blake3

from ..errors import TokenError
from ..layout.spec import ChunkKey, Fingerprint
from .keys import KEY_BYTES, Namespace, namespace_bytes
from .keys import Chunk

MAX_PAGE_KEY_BYTES = 1024
_DOMAIN = b"kvconnect-page-keys\x00"
PageKey = Union[str, bytes]


class PageKeyFolder:
    """Folds engine page keys with one layout's identity into kvconnect chunk keys."""

    def __init__(self, fingerprint: Fingerprint, page_tokens: int, namespace: Namespace = None,
                 generation: bytes = b"") -> None:
        if not isinstance(page_tokens, int) or page_tokens <= 0:
            raise TokenError(f"page_tokens must be a positive int, got {page_tokens!r}")
        ns = namespace_bytes(namespace)
        seed = _DOMAIN + bytes(fingerprint) + page_tokens.to_bytes(8, "little") + len(ns).to_bytes(4, "little") + ns
        if generation:  # an engine's reset generation (kvconnect/chunks/keys.py): empty before any reset
            seed += b"\x02" + len(generation).to_bytes(4, "little") + bytes(generation)
        self.page_tokens = page_tokens
        self._key = blake3.blake3(seed).digest()

    def fold(self, page_keys: Sequence[PageKey]) -> list[ChunkKey]:
        """One 16-byte chunk key per engine page key; TokenError for an unusable key."""
        out: list[ChunkKey] = []
        for key in page_keys:
            data = key.encode("utf-8") if isinstance(key, str) else key
            if not isinstance(data, (bytes, bytearray)) or not data or len(data) > MAX_PAGE_KEY_BYTES:
                raise TokenError(f"a page key must be a non-empty str or bytes of at most {MAX_PAGE_KEY_BYTES} bytes, got {key!r:.80}")
            out.append(ChunkKey(blake3.blake3(bytes(data), key=self._key).digest(KEY_BYTES)))
        return out

    def chunks(self, page_keys: Sequence[PageKey], first_page: int = 0) -> list[Chunk]:
        """``page_chunks`` of the folded keys."""
        return page_chunks(self.fold(page_keys), self.page_tokens, first_page)


def page_chunks(keys: Sequence[ChunkKey], page_tokens: int, first_page: int = 0) -> list[Chunk]:
    """Consecutive page-sized chunks, page ``first_page + i`` under ``keys[i]``."""
    return [
        Chunk(first_page + i, (first_page + i) * page_tokens, (first_page + i + 1) * page_tokens, key)
        for i, key in enumerate(keys)
    ]
