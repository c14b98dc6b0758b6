"""What a KV cache looks like: groups, planes, rows, views, slots.

- ``spec``: the value types an adapter fills in (``GroupSpec``, ``PlaneSpec``, ``DCPSpec``,
  ``RowRegions``) and the key/fingerprint types.
- ``kv_layout``: ``KVLayout``, the engine's tensors as planes of rows, with its fingerprint.
- ``detect``: how a tensor's shape becomes planes (block-major, K/V-split, regions).
- ``views``: engine tensors that alias one another (counted once).
- ``rows``: per group, which rows a chunk stores and a restore at P needs.
- ``slots``: block ids from an engine's slot mapping.

Imports only ``kvconnect.errors`` and its own modules: everything else builds on it.
"""
