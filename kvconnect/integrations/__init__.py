"""Thin engine adapters, installed as ``kvconnect.integrations.*``.

Adapters only translate an engine's types into kvconnect's (``KVLayout``, per-group block
ids, tokens) and call the engine-neutral core. They use the engine's official extension
points only. ``presets`` describes models' caches as each engine allocates them (for
``kvconnect inspect`` / ``bench`` and the benchmarks), with the release facts of the adapters'
tables.
"""
