"""How often an engine asks its own pool and tiers what they hold.

    lookup_asks(engine, tokens) -> (the engine's lookup of tokens, its StorageManager.masks calls)

For the other-TP reader's tests (tests/test_other_tp.py, tests/test_other_tp_states.py): the
restore scheme hands the reader what it found of this rank's own objects, so a lookup asks
them as often with the reader as without it.
"""

from __future__ import annotations


def lookup_asks(engine, tokens) -> tuple[int, int]:
    """The engine's lookup of ``tokens`` and how many ``masks`` calls it made on its own storage."""
    calls = []
    own = engine.storage.masks
    engine.storage.masks = lambda keys: calls.append(len(keys)) or own(keys)
    try:
        return engine.lookup(tokens), len(calls)
    finally:
        engine.storage.masks = own
