"""Chunks as stored objects: their keys and their byte format.

- ``keys``: the key chain of a token sequence (fingerprint, namespace, generation).
- ``page_keys``: keys of whole engine pages handed over under the engine's own keys.
- ``chunk_format``: the header, checksum and plane-major payload every tier stores.

Imports only ``kvconnect.errors``, ``kvconnect.layout`` and its own modules.
"""
