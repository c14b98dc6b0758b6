"""Thin engine adapters, installed as ``kvconnect.integrations.*``.

Adapters only translate an engine's types into kvconnect's (``KVLayout``, per-group block
ids, tokens) and call the engine-neutral core. They use the engine's official extension
points only.
"""
