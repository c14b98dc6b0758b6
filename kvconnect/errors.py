"""Typed errors raised at kvconnect's public API.

Every error is raised before any byte moves: a caller that catches one knows the
engine's KV memory and the store are exactly as they were.
"""


class KVConnectError(Exception):
    """Base class of every error kvconnect raises on purpose."""


class ConfigError(KVConnectError, ValueError):
    """A configuration value is missing, malformed or out of range (names the key)."""


class LayoutError(KVConnectError, ValueError):
    """A KV layout or group spec is inconsistent (names the layer, plane or group)."""


class BlockTableError(KVConnectError, IndexError):
    """Block ids do not fit the layout: out of range, too few, or absent where needed."""


class TokenError(KVConnectError, ValueError):
    """Tokens or mask are malformed (wrong dtype, shape, or a mask that is not a chunk prefix)."""


class TransferError(KVConnectError, ValueError):
    """A transfer descriptor failed validation (slot, buffer bounds, device or dtype)."""


class CorruptChunkError(KVConnectError, ValueError):
    """A stored chunk failed its magic, version, fingerprint, key, size or checksum check."""


class StorageError(KVConnectError, RuntimeError):
    """A storage tier failed; callers turn this into a miss, never into a crash."""


class UnsupportedLayoutError(LayoutError):
    """An engine's cache holds a group kvconnect cannot restore exactly; the adapter must stay off."""
