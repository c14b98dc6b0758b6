"""Chunk keys: a prefix hash chain over token ids, namespaced by layout and chunk size.

h_0 = BLAKE3(fingerprint || chunk size [|| 0x01 || len(ns) || ns]); h_i = BLAKE3-keyed(key=h_{i-1},
tokens of chunk i); the key of chunk i is the first 16 bytes of h_i. Token ids are hashed as little-endian
uint32 (every real vocabulary fits; larger ids raise TokenError), so keys are a pure function
of tokens and identity: equal across processes, TP ranks that hold the same part (every rank
of every TP size for replicated KV, the ranks holding the same KV heads for head-sharded KV:
the fingerprint is a TP-free model identity plus each group's part identity, docs/design.md
"The identity of a chunk"), and machines, and independent of the engine's block size. BLAKE3 is cryptographic, so crafted prompts
cannot collide into another prefix's chunk. A 128K-token prompt hashes in under a millisecond.

A *namespace* (``ns``) is whatever besides token ids decides the KV of a request: a LoRA
adapter, or a per-tenant salt that keeps one tenant's prefixes from hitting another's (vLLM's
``cache_salt``). It enters h_0 only, length-prefixed and in BLAKE3's unkeyed mode while chunk
steps use the keyed mode, so no namespace or token sequence can reproduce another
namespace's chain. The empty namespace gives the keys of a request without one.

A *generation* (``ChunkKeyer(..., generation=)``) is what an engine's reset changes (see
``KVCacheEngine.reset``): random bytes folded into h_0 after the chunk size, tagged and
length-prefixed, so chains of different generations never meet. No generation (before any
reset, and after every restart) leaves h_0 as above. A generation is empty or
``GENERATION_BYTES`` bytes (``generation_bytes`` checks one that came from outside: the vLLM
scheduler names its generation to its workers and, in P/D params, to a decode server).

*Extra keys* (``keys(..., extras=)``, kvconnect/chunks/extra_keys.py) are what besides token
ids decides one chunk's KV: the multimodal items whose placeholders the chunk covers. They
enter only the step of their chunk, after its token bytes (``extras_bytes``: tagged,
length-suffixed, never a multiple of 4 bytes long, so no token sequence reproduces them), so
a chunk without extras hashes exactly as it would in a text-only prompt, and every later
chunk of the prompt differs through the chain.

A generation's *retirement key* (``ChunkKeyer.retirement_key``) is BLAKE3(identity || 0x03 ||
"retired"), in the unkeyed mode like h_0 but with a tag no seed carries, so no chain of any
namespace reaches it: the marker a P/D producer's reset leaves in the shared tier, by which a
decode server learns that params naming that generation are stale (``KVCacheEngine.reset``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import blake3
import numpy as np
import torch

from ..errors import TokenError
from .extra_keys import ChunkExtras, extras_bytes
from ..layout.spec import ChunkKey, Fingerprint


@dataclass(frozen=True)
class Chunk:
    """Chunk ``index`` of a token sequence: tokens [start, end), stored under ``key``;
    ``extras``: its extra keys (multimodal items it covers, kvconnect/chunks/extra_keys.py)."""

    index: int
    start: int
    end: int
    key: ChunkKey
    extras: ChunkExtras = ()


KEY_BYTES = 16
MAX_NAMESPACE_BYTES = 4096
GENERATION_BYTES = 16
Tokens = Union[torch.Tensor, np.ndarray, Sequence[int]]
Namespace = Union[str, bytes, None]


TOKEN_BYTES = 4


def tokens_as_int64(tokens: Tokens) -> np.ndarray:
    """Token ids as a 1-D int64 array, validated to lie in [0, 2**32)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TokenError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        array = tokens.detach().to("cpu", torch.int64).numpy()
    else:
        array = np.asarray(tokens)
        if array.size == 0:
            array = array.astype(np.int64)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise TokenError(f"tokens must be a 1-D sequence of ints, got dtype {array.dtype} shape {array.shape}")
        array = array.astype("<i8", copy=False)
    if array.size and (array.min() < 0 or array.max() >= 1 << 32):
        raise TokenError("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(array)


def namespace_bytes(namespace: Namespace) -> bytes:
    """A namespace as bytes (str as UTF-8; None is the empty namespace); TokenError if unusable."""
    if namespace is None:
        return b""
    if isinstance(namespace, str):
        namespace = namespace.encode("utf-8")
    if not isinstance(namespace, (bytes, bytearray, memoryview)):
        raise TokenError(f"a namespace must be str or bytes, got {type(namespace).__name__}")
    namespace = bytes(namespace)
    if len(namespace) > MAX_NAMESPACE_BYTES:
        raise TokenError(f"a namespace holds at most {MAX_NAMESPACE_BYTES} bytes, got {len(namespace)}")
    return namespace


def new_generation() -> bytes:
    """A fresh random generation (what a reset moves to)."""
    return os.urandom(GENERATION_BYTES)


def generation_bytes(generation) -> bytes:
    """A generation as bytes: empty (no reset yet) or GENERATION_BYTES bytes; TokenError otherwise."""
    if not isinstance(generation, (bytes, bytearray, memoryview)):
        raise TokenError(f"a key generation must be bytes, got {type(generation).__name__}")
    generation = bytes(generation)
    if len(generation) not in (0, GENERATION_BYTES):
        raise TokenError(f"a key generation is empty or {GENERATION_BYTES} bytes, got {len(generation)}")
    return generation


class ChunkKeyer:
    """Computes the key chain of a token sequence for one layout and chunk size."""

    def __init__(self, fingerprint: Fingerprint, chunk_tokens: int, generation: bytes = b"") -> None:
        self.chunk_tokens = chunk_tokens
        self.generation = bytes(generation)
        self._identity = bytes(fingerprint) + int(chunk_tokens).to_bytes(8, "little")
        if self.generation:  # empty: the keys every engine computes before its first reset
            self._identity += b"\x02" + len(self.generation).to_bytes(4, "little") + self.generation
        self._seed = blake3.blake3(self._identity).digest()

    def retirement_key(self) -> ChunkKey:
        """The key of the marker saying this generation was left by a reset (module doc)."""
        return ChunkKey(blake3.blake3(self._identity + b"\x03retired").digest()[:KEY_BYTES])

    def seed(self, namespace: Namespace = None) -> bytes:
        """h_0 of a namespace's chains."""
        ns = namespace_bytes(namespace)
        if not ns:
            return self._seed
        return blake3.blake3(self._identity + b"\x01" + len(ns).to_bytes(4, "little") + ns).digest()

    def keys(self, tokens: np.ndarray, bounds: Sequence[tuple[int, int]], namespace: Namespace = None,
             extras: Optional[Sequence[ChunkExtras]] = None) -> list[ChunkKey]:
        """Keys of consecutive chunks ``bounds`` (which must start at 0 and tile the prefix);
        ``extras``: each chunk's extra keys (one entry per chunk of ``bounds``; None: none)."""
        data = memoryview(np.ascontiguousarray(tokens, dtype="<u4")).cast("B")
        if extras is not None and len(extras) != len(bounds):
            raise TokenError(f"extra keys name {len(extras)} chunks, the bounds {len(bounds)}")
        out: list[ChunkKey] = []
        chain = self.seed(namespace)
        for i, (start, end) in enumerate(bounds):
            step = blake3.blake3(data[start * TOKEN_BYTES : end * TOKEN_BYTES], key=chain)
            if extras is not None and extras[i]:
                step.update(extras_bytes(extras[i]))
            chain = step.digest()
            out.append(ChunkKey(chain[:KEY_BYTES]))
        return out
