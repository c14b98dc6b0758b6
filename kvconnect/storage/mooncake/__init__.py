"""The Mooncake Store tier: a distributed lower tier whose objects live in the memory segments
of Mooncake client processes, found through a master.

- ``config``: ``mooncakestore://`` URLs and the client settings file -> ``MooncakeSpec``;
- ``link``: the connection, its breaker and the count of calls in flight (shared with the
  node server's segment holder);
- ``codes``: what each Mooncake return code means, and the tally of failures by kind;
- ``workers``: the lookup threads, so a stalled master never holds the engine's step;
- ``buffers``: the registered header scratch slots;
- ``objects``: what lookups, writes and reads share (names, the link, code meanings, masks
  seen, removes, registered pools);
- ``tier``: ``MooncakeTier`` (lookups, writes, removes) and ``reads``: its ``MooncakeReader``.

It imports the storage package's tier contract (``..tier``) and host-memory checks, the chunk
format, keys and errors; nothing above storage.
"""
