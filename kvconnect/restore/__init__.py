"""Restore points: where a prompt can resume, what is stored for it, and how it is read back.

- ``points``: where restore points are made (the one retention rule; interval 0 keeps chunks whole).
- ``parts``: a chunk's prefix part and window pieces, and their keys.
- ``gate``: the largest P at which every group can resume, and the one walk of the chunks
  whose window rows P needs.
- ``plan``: block tables, store plans, segment tables for the gather and the scatter.
- ``scheme``: ``RestoreScheme``, implemented by ``whole_chunks`` and ``window_parts``; the
  engine holds one, chosen when it is made.
- ``writes`` (``ObjectWriter``) and ``reads`` (``ChunkLoader``): the write path and the load.
- ``verify``: restores verified in production (a sampled hit served as a miss, its recomputed
  rows compared with the stored objects at its store; a mismatch retires the layout).
- ``other_tp`` (which writer ranks of another TP size hold a rank's heads or state ranges, and ``assemble``)
  and ``other_tp_reads`` (``OtherTPReader``: on a miss, those objects into the pool).

Imports ``errors``, ``events``, ``engine_stats``, ``layout``, ``chunks``, ``metrics``,
``transfer`` and ``storage``; never the engine above it, the server or an adapter.
"""
