"""The ``kv_transfer_params`` kvconnect speaks in vLLM's prefill/decode protocol.

vLLM's P/D protocol (vLLM's ``vllm-router --vllm-pd-disaggregation``, its toy proxies, NIXL's
connector) runs a request twice: on a prefill server with ``max_tokens`` 1 and
``kv_transfer_params`` ``{"do_remote_decode": true, ...}``, then, on a decode server, the
original request with the ``kv_transfer_params`` the prefill response carried (vllm-router
0.1.17 forwards that object unchanged for its default, NIXL-style, protocol). The params are
whatever the prefill server's connector returns from ``request_finished``; kvconnect returns::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": "<producer engine id>",
     "kvconnect": {"v": 1, "tokens": 300, "chunk_tokens": 64, "tp_size": 1,
                   "prompt_digest": "<hex>", "model": "<model@revision>",
                   "generation": "<32 hex digits, or empty>"}}

``do_remote_prefill`` is the field vLLM's own scheduler and output processor recognise (they
count such a request as a P/D decode and report the producer's ``remote_prefill_cached_tokens``);
``kvconnect`` names what the producer stored: the first ``tokens`` prompt tokens (the whole
prompt, its partial last chunk included) in ``chunk_tokens``-token chunks, under a TP size,
for the prompt whose token ids and namespace (LoRA adapter, cache_salt) hash to
``prompt_digest``, under the key ``generation`` the producer's scheduler had when it admitted
the prefill (keys.py; empty until the producer's first reset, a new random one after each):
the decode side looks up and loads under it, whatever its own generation, so a pair keeps
finding the producer's chunks across a reset of either side, unless the producer's reset
retired that generation (pd.py: a replay of params from before it loads nothing). Params without ``generation``
(from a producer before this field) name the empty generation. Nothing in the params is
trusted: a field of the wrong type makes them unusable (``TransferParamsError``), and the decode
side then does a plain lookup; a well-formed generation no producer used is a miss (the chunks
are looked for under keys nobody stored), bounded by the decode side's wait like any params
naming chunks that never land.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import blake3
import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.chunks.keys import GENERATION_BYTES

KEY = "kvconnect"
VERSION = 1
DIGEST_HEX_CHARS = 32  # 128 bits
GENERATION_HEX_CHARS = 2 * GENERATION_BYTES
_MAX_TEXT = 512


class TransferParamsError(KVConnectError, ValueError):
    """``kv_transfer_params`` carry a ``kvconnect`` entry that is not one this version reads."""


@dataclass(frozen=True)
class StoredPrefill:
    """What a producer stored for one prefill (the ``kvconnect`` entry of the params)."""

    tokens: int
    chunk_tokens: int
    tp_size: int
    prompt_digest: str
    model: str = ""
    engine_id: str = ""
    generation: bytes = b""  # the producer's key generation (kvconnect/chunks/keys.py): empty or GENERATION_BYTES bytes

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` the producer returns from ``request_finished``."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id or None,
            KEY: {"v": VERSION, "tokens": self.tokens, "chunk_tokens": self.chunk_tokens, "tp_size": self.tp_size,
                  "prompt_digest": self.prompt_digest, "model": self.model, "generation": self.generation.hex()},
        }


def prompt_digest(tokens: np.ndarray, namespace: bytes = b"") -> str:
    """A hash of a prompt's token ids and namespace: the decode side checks it is the same prompt."""
    h = blake3.blake3(np.ascontiguousarray(tokens, dtype="<i8").tobytes())
    h.update(len(namespace).to_bytes(4, "little") + namespace)
    return h.hexdigest(length=DIGEST_HEX_CHARS // 2)


def wants_remote_decode(params: Any) -> bool:
    """True for a prefill whose decode runs elsewhere (``do_remote_decode`` is true)."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def remote_prefill(params: Any) -> Optional[StoredPrefill]:
    """The producer's ``StoredPrefill`` named by a decode request's params, or None when the
    params name none (no params, not a remote prefill, or another connector's params).

    Raises TransferParamsError when the ``kvconnect`` entry is there but malformed.
    """
    if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
        return None
    entry = params.get(KEY)
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise TransferParamsError(f"kv_transfer_params[{KEY!r}] must be an object, got {type(entry).__name__}")
    if entry.get("v") != VERSION:
        raise TransferParamsError(f"kv_transfer_params[{KEY!r}] version {entry.get('v')!r} is not {VERSION}")
    tokens = _int(entry, "tokens", minimum=1)
    chunk_tokens = _int(entry, "chunk_tokens", minimum=1)
    tp_size = _int(entry, "tp_size", minimum=1)
    digest = entry.get("prompt_digest")
    if not isinstance(digest, str) or len(digest) != DIGEST_HEX_CHARS or any(c not in "0123456789abcdef" for c in digest):
        raise TransferParamsError(f"kv_transfer_params[{KEY!r}]['prompt_digest'] must be {DIGEST_HEX_CHARS} lowercase hex digits")
    model = entry.get("model", "")
    engine_id = params.get("remote_engine_id") or ""
    if not isinstance(model, str) or len(model) > _MAX_TEXT or not isinstance(engine_id, str) or len(engine_id) > _MAX_TEXT:
        raise TransferParamsError(f"kv_transfer_params[{KEY!r}]: model and remote_engine_id must be short strings")
    return StoredPrefill(tokens, chunk_tokens, tp_size, digest, model, engine_id, _generation(entry))


def _generation(entry: Mapping) -> bytes:
    """The producer's key generation: "" (or absent: a producer before the field) or 32 lowercase hex digits."""
    value = entry.get("generation", "")
    if not isinstance(value, str) or len(value) not in (0, GENERATION_HEX_CHARS) or any(c not in "0123456789abcdef" for c in value):
        shown = repr(value) if isinstance(value, str) and len(value) <= 64 else type(value).__name__
        raise TransferParamsError(f"kv_transfer_params[{KEY!r}]['generation'] must be empty or {GENERATION_HEX_CHARS} "
                                  f"lowercase hex digits, got {shown}")
    return bytes.fromhex(value)


def _int(entry: Mapping, name: str, *, minimum: int) -> int:
    value = entry.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or value > 1 << 40:
        raise TransferParamsError(f"kv_transfer_params[{KEY!r}][{name!r}] must be an integer >= {minimum}, got {value!r}")
    return value


def mismatch(stored: StoredPrefill, *, prompt: np.ndarray, namespace: bytes, chunk_tokens: int,
             model: str = "") -> Optional[str]:
    """Why the producer's chunks cannot serve this decode server's request, or None.

    Chunk keys fold in the model and the chunk size: a producer serving another model (or
    revision) or chunk size stored chunks this server can never find, so waiting for them
    would only cost the wait. Params that name no model (built by hand or by another proxy)
    are not checked on it: at worst they cost the bounded wait. The TP size is not decided
    here: another size's chunks are readable where the decode side's layout can cut its
    heads out of them, which its workers say (pd.py, ``PDScheduler``).
    """
    if stored.model and model and stored.model != model:
        return f"the producer serves model {stored.model!r}, this server {model!r}"
    if stored.chunk_tokens != chunk_tokens:
        return f"the producer stores {stored.chunk_tokens}-token chunks, this server {chunk_tokens}-token ones"
    if stored.tokens > len(prompt):
        return f"the producer stored {stored.tokens} tokens of a {len(prompt)}-token prompt"
    if stored.prompt_digest != prompt_digest(prompt, namespace):
        return "the producer stored another prompt (token ids, LoRA adapter or cache_salt differ)"
    return None
