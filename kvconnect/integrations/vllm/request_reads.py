"""What the connector reads from vLLM's requests and scheduler output: a request's prompt,
namespace (LoRA, cache salt) and tokens, its block ids, the step's scheduled and preempted
requests. Reads by attribute, never importing vLLM.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import msgpack
import numpy as np

from kvconnect.chunks.extra_keys import MediaItem, media_items
from kvconnect.chunks.keys import MAX_NAMESPACE_BYTES

from .metadata import BlockIds, RequestView, freeze_block_ids

logger = logging.getLogger(__name__)


def request_view(request: Any) -> RequestView:
    """A request's prompt, namespace and media; not cacheable when more than these decides its KV.

    A LoRA adapter (by name and path, as vLLM's own prefix cache keys it) and vLLM's
    per-request ``cache_salt`` change the KV of the same token ids: they form the request's
    namespace, so its chunks are found only by requests with the same adapter and salt.
    Multimodal inputs (placeholder tokens stand for different images) key the chunks that
    cover them (``request_media``). Prompt embeddings have no token ids that decide their
    KV: such requests are neither looked up nor saved (said once, ``_refuse_once``).
    """
    prompt = getattr(request, "prompt_token_ids", None)
    tokens = np.asarray(prompt if prompt is not None else [], dtype=np.int64)
    namespace = request_namespace(request)
    media = request_media(request)
    embeds = getattr(request, "prompt_embeds", None) is not None
    if embeds:
        _refuse_once("prompt_embeds", "requests with prompt embeddings are neither looked up nor saved "
                     "(no token ids decide their KV)")
    cacheable = (
        prompt is not None
        and media is not None
        and not embeds
        and namespace is not None
        and len(namespace) <= MAX_NAMESPACE_BYTES
    )
    return RequestView(req_id=request.request_id, prompt_tokens=tokens, num_tokens=int(request.num_tokens),
                       cacheable=bool(cacheable), namespace=namespace or b"", media=media or ())


def request_media(request: Any) -> Optional[tuple[MediaItem, ...]]:
    """A request's multimodal items as vLLM's block hash keys them (``Request.mm_features``:
    ``identifier`` and ``mm_position.offset`` / ``length``, kept in vLLM's order, which is by
    offset); () without any; None when an item cannot be keyed (no identifier, bad range:
    the request is then neither looked up nor saved, said once)."""
    features = getattr(request, "mm_features", None)
    if not features:
        return ()
    try:
        return media_items([(f.identifier, int(f.mm_position.offset), int(f.mm_position.length)) for f in features])
    except (AttributeError, TypeError, ValueError) as exc:
        _refuse_once("mm_features", f"a multimodal request whose items cannot be keyed is neither looked up nor saved ({exc})")
        return None


_REFUSED: set[str] = set()


def _refuse_once(what: str, why: str) -> None:
    if what not in _REFUSED:
        _REFUSED.add(what)
        logger.info("kvconnect: %s", why)


def request_namespace(request: Any) -> Optional[bytes]:
    """The namespace bytes of a request: empty without LoRA and salt (the keys of plain requests);
    None for an adapter without a name (it cannot be told apart from others: not cached)."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None)
        if not name:
            return None
        parts.append(["lora", str(name), str(getattr(lora, "lora_path", "") or "")])
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(["cache_salt", str(salt)])
    return msgpack.packb(parts) if parts else b""


def all_token_ids(request: Any) -> np.ndarray:
    """A request's prompt and generated token ids so far (vLLM's ``all_token_ids``)."""
    return np.asarray(request.all_token_ids, dtype=np.int64)


def num_computed_tokens(request: Any) -> int:
    return int(request.num_computed_tokens)


def block_ids_of(blocks: Any) -> BlockIds:
    """vLLM's KVCacheBlocks as per-group block ids."""
    return freeze_block_ids(blocks.get_block_ids())


def scheduled_tokens(scheduler_output: Any) -> dict[str, int]:
    return dict(scheduler_output.num_scheduled_tokens)


def preempted_ids(scheduler_output: Any) -> set[str]:
    """Requests whose blocks the scheduler freed for this step (``SchedulerOutput.preempted_req_ids``,
    vLLM 0.23 and 0.32; None when there are none)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def current_block_ids(scheduler_output: Any, kv_cache_manager: Any, req_id: str) -> Optional[BlockIds]:
    """A scheduled request's block ids as the scheduler holds them now (freed blocks as 0)."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    if state is not None:
        ids = state.get_block_ids(req_id)
        if ids is not None:
            return freeze_block_ids(ids)
    if kv_cache_manager is not None:
        return freeze_block_ids(kv_cache_manager.get_block_ids(req_id))
    return None
