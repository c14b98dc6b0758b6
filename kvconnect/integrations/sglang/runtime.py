"""What SGLang published about this process: its ``ModelConfig`` and its resolved server
settings (``sglang.srt.runtime_context``). The backend is built in SGLang's scheduler process,
where they exist; a backend built elsewhere (a benchmark, a unit test: no published server
arguments) reads None from each."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


def _published(read: Callable[[Any], Any], what: str) -> Optional[Any]:
    """``read(runtime_context)`` where SGLang published server arguments in this process, else None."""
    try:
        from sglang.srt import runtime_context
    except ImportError:  # an SGLang without the runtime context
        return None
    try:
        if runtime_context.get_server_args() is None:
            return None
        return read(runtime_context)
    except Exception:  # noqa: BLE001 - SGLang raises various errors when nothing is published
        logger.debug("kvconnect: no SGLang %s in this process", what, exc_info=True)
        return None


def process_model_config() -> Optional[Any]:
    """SGLang's ``ModelConfig`` of this process (model path, revision, Hugging Face config,
    serving dtype, quantisation), or None."""
    return _published(lambda rc: rc.process_model_config(), "model config")


def mamba_radix_cache_strategy() -> Optional[str]:
    """SGLang's resolved Mamba radix-cache strategy in this process ("no_buffer",
    "extra_buffer", ...: its published ``exec`` config, ``auto`` already resolved), or None."""
    def read(rc) -> Optional[str]:
        bag = rc.get_exec()
        value = getattr(getattr(bag, "mamba", bag), "mamba_radix_cache_strategy", None)
        return None if value is None else str(value)

    return _published(read, "exec config")
