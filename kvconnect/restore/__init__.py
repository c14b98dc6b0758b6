"""Restore points: where a prompt can resume, what is stored for it, and how it is read back.

Imports ``kvconnect.errors``, ``layout``, ``chunks``, ``storage`` and ``transfer``; never the
engine above it, the server or an adapter.
"""
