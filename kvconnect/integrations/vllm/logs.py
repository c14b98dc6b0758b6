"""kvconnect's messages in vLLM's log: routing, the registration line, periodic summaries.

vLLM configures one logger tree, ``vllm`` (its handler, format, ``VLLM_LOGGING_LEVEL``,
``VLLM_CONFIGURE_LOGGING`` / ``VLLM_LOGGING_CONFIG_PATH``), and stops it from propagating to
the root. kvconnect's modules log under ``kvconnect.*``; ``route_to_vllm()`` hands those
records to the ``vllm.kvconnect`` logger, so they appear in vLLM's stream with vLLM's format
and obey vLLM's level (a user who configured a ``kvconnect`` handler of their own is left
alone). What is logged (docs/vllm.md, "What it logs"):

- INFO once per worker at registration: groups, planes, bytes per chunk, tiers, pool size;
- WARNING once when the connector stays off, with the reason;
- INFO at most once per ``KVCONNECT_LOG_INTERVAL_S`` (default 60 s; 0: never) a summary of
  lookups, hits and loads (scheduler) and of saves and the pool (worker), only after activity;
- nothing per request above DEBUG.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

VLLM_LOGGER = "vllm.kvconnect"
_CORE = "kvconnect"


class _ToVllm(logging.Handler):
    """Re-emit a ``kvconnect.*`` record through ``vllm.kvconnect`` (vLLM's handlers and level)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(VLLM_LOGGER)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_to_vllm() -> bool:
    """Send kvconnect's log records to vLLM's logger tree (idempotent). False when the user
    already gave the ``kvconnect`` logger a handler of their own."""
    core = logging.getLogger(_CORE)
    if any(isinstance(h, _ToVllm) for h in core.handlers):
        core.setLevel(logging.getLogger(VLLM_LOGGER).getEffectiveLevel())
        return True
    if core.handlers:
        return False
    core.addHandler(_ToVllm())
    core.setLevel(logging.getLogger(VLLM_LOGGER).getEffectiveLevel())
    core.propagate = False  # vLLM's tree prints it; the root would print it twice
    return True


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class Periodic:
    """Calls ``emit()`` at most once per ``interval_s`` and only after something happened."""

    def __init__(self, interval_s: float, emit: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._emit = emit
        self._clock = clock
        self._last = clock()
        self.dirty = False

    def tick(self) -> bool:
        if self.interval_s <= 0 or not self.dirty:
            return False
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        self.dirty = False
        try:
            self._emit()
        except Exception:  # a summary must never break a step
            logging.getLogger(__name__).debug("kvconnect: summary failed", exc_info=True)
        return True


def registration_line(layout, config, pool, storage, chunk_words: str = "") -> str:
    """The INFO line a worker logs once its engine is built (``chunk_words``: how the chunk
    size came to be, ``chunk_size.describe``: "set" or why it was chosen)."""
    chunk_bytes = getattr(pool, "slot_bytes", 0)
    tiers = ["cpu"] + [t.name for t in getattr(storage, "tiers", [])]
    pool_bytes = getattr(pool, "num_slots", 0) * chunk_bytes
    kinds = ", ".join(f"{row['kind']} block {row['block_size']}" + (f" window {row['window']}" if row["window"] else "")
                      + (f" x1/{row['compress_ratio']}" if row["compress_ratio"] != 1 else "") for row in layout.describe())
    return (f"kvconnect: registered: {layout.num_groups} group(s) [{kinds}], {len(layout.planes)} planes, "
            f"{human_bytes(chunk_bytes)} per {config.chunk_size}-token chunk{f' ({chunk_words})' if chunk_words else ''}, tiers {'+'.join(tiers)}, "
            f"CPU pool {human_bytes(pool_bytes)} ({getattr(pool, 'num_slots', 0)} chunks, {getattr(pool, 'eviction', 'shared')} "
            f"eviction)")
