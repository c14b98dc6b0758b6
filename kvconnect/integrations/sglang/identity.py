"""The model SGLang serves, named as the vLLM adapter names it: ``name@revision#digest``.

``HiCacheStorageConfig.model_name`` is only the model's path (or served name): a second
revision of a model at the same path, or a directory rewritten with another checkpoint, would
load the first one's KV from a shared tier. The backend is constructed in SGLang's scheduler
process, where SGLang keeps the process's ``ModelConfig`` (``runtime_context.
process_model_config()``, read by ``runtime.process_model_config``: model path, revision, Hugging Face config, serving dtype,
quantisation); its fields go through ``kvconnect.layout.model_identity``, the same function the
vLLM adapter uses. A backend built outside a scheduler (no published server arguments: a
benchmark, a unit test) has no such config and is named ``model_name@#digest`` of nothing;
``model_name`` (``KVCONNECT_MODEL_NAME`` or the extra config) always wins when set.
"""

from __future__ import annotations

from typing import Any, Optional

from kvconnect.integrations.sglang.runtime import process_model_config
from kvconnect.layout.model_identity import model_identity


def sglang_model_identity(storage_model_name: Optional[str], model_config: Any = None) -> str:
    """``name@revision#digest`` of ``model_config`` (default: this process's SGLang ``ModelConfig``);
    without one, ``storage_model_name@#digest`` of no config fields."""
    mc = model_config if model_config is not None else process_model_config()
    if mc is None:  # no name at all stays unnamed: a shared tier then refuses to start (engine.py)
        return model_identity(storage_model_name, None, None) if storage_model_name else ""
    name = str(getattr(mc, "model_path", None) or storage_model_name or "")
    return model_identity(name, getattr(mc, "revision", None), getattr(mc, "hf_config", None),
                          getattr(mc, "dtype", None), getattr(mc, "quantization", None))
