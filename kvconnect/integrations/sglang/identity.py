"""The model SGLang serves, named as the vLLM adapter names it: ``name@revision#digest``.

``HiCacheStorageConfig.model_name`` is only the model's path (or served name): a second
revision of a model at the same path, or a directory rewritten with another checkpoint, would
load the first one's KV from a shared tier. The backend is constructed in SGLang's scheduler
process, where SGLang keeps the process's ``ModelConfig`` (``runtime_context.
process_model_config()``: model path, revision, Hugging Face config, serving dtype,
quantisation); its fields go through ``kvconnect.layout.model_identity``, the same function the
vLLM adapter uses. A backend built outside a scheduler (no published server arguments: a
benchmark, a unit test) has no such config and is named ``model_name@#digest`` of nothing;
``model_name`` (``KVCONNECT_MODEL_NAME`` or the extra config) always wins when set.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from kvconnect.layout.model_identity import model_identity

logger = logging.getLogger(__name__)


def process_model_config() -> Optional[Any]:
    """SGLang's ``ModelConfig`` of this process, or None where no server arguments were published."""
    try:
        from sglang.srt.runtime_context import get_server_args, process_model_config as sglang_model_config
    except ImportError:  # an SGLang without the runtime context
        return None
    try:
        if get_server_args() is None:
            return None
        return sglang_model_config()
    except Exception:  # noqa: BLE001 - SGLang raises various errors when no config is published
        logger.debug("kvconnect: no SGLang model config in this process", exc_info=True)
        return None


def sglang_model_identity(storage_model_name: Optional[str], model_config: Any = None) -> str:
    """``name@revision#digest`` of ``model_config`` (default: this process's SGLang ``ModelConfig``);
    without one, ``storage_model_name@#digest`` of no config fields."""
    mc = model_config if model_config is not None else process_model_config()
    if mc is None:  # no name at all stays unnamed: a shared tier then refuses to start (engine.py)
        return model_identity(storage_model_name, None, None) if storage_model_name else ""
    name = str(getattr(mc, "model_path", None) or storage_model_name or "")
    return model_identity(name, getattr(mc, "revision", None), getattr(mc, "hf_config", None),
                          getattr(mc, "dtype", None), getattr(mc, "quantization", None))
