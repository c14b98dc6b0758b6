"""Where restore points are made: the retention rule, in one place.

A restore point is a token position at which a request can resume from the cache. A store
makes one at the end of the tokens it stores (the end of a prompt or of stored decode
output: where the engine resumes), one where the stored tokens leave a prefix already
stored (a shared system prompt, a branching conversation), and one at the first chunk end
at or past every multiple of the retention interval (``restore_interval_tokens``).

A store that ends at an engine's prefill step end (``step_end``: the engine computes the rest
of the prompt next step, nobody resumes there) makes no restore point at its end unless
``step_end_parts`` is set (and the next step's store, ``continues``, none at its start); then that point is *short-lived*: its window part goes to the
pool's first-evicted class (``ChunkPool.demote``), where it still serves a request that
diverges there until the pool needs the slot, and a use puts it back under the policy.
Points that are also an interval point or a branch point are kept as any restore point.
A step end inside an already stored prefix is the branch point when the request leaves that
prefix there: the next step's store cannot make it (it does not know the chunk was stored
before this request), so this one does, unless the prompt's next chunk is stored too
(``next_present``: the engine looked it up; then the request walks on along the prefix, as
a request recomputing a shared prefix whose window rows were not kept does at every step).

Interval 0 puts a restore point at every chunk end: every group's rows are then stored in
every chunk anyway, so the engine keeps each chunk whole (``splits_window_groups``).
``KVCacheEngine``, ``kvconnect.sizing`` (what ``kvconnect inspect`` reports) and
``benchmarks/trace_replay.py`` all ask these functions, so they cannot drift apart.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..chunks.keys import Chunk


def splits_window_groups(interval_tokens: int, *, window_parts: bool = True) -> bool:
    """Whether window groups are stored apart from each chunk (only at restore points):
    not at interval 0, nor when the caller keeps chunks whole (``window_parts=False``)."""
    return window_parts and interval_tokens > 0


def is_interval_point(chunk: Chunk, interval_tokens: int) -> bool:
    """Whether ``chunk``'s end is the first chunk end at or past a multiple of the interval
    (every chunk end at interval 0)."""
    return interval_tokens == 0 or chunk.end // interval_tokens > chunk.start // interval_tokens


def restore_points(chunks: Sequence[Chunk], first: int, present: Sequence[bool], interval_tokens: int, *,
                   step_end: bool = False, continues: bool = False, step_end_parts: bool = False,
                   next_present: Optional[bool] = None) -> tuple[list[int], list[int]]:
    """(kept, short_lived): indices k whose chunk end is a restore point of a store of
    ``chunks[first:]``, and those of them whose window part is first-evicted.

    ``present[k]``: chunk k's prefix part was stored before this store (known for k >= first).
    Restore points: the last chunk's end (at a step end: only when that chunk was already stored
    and the prompt's next chunk is not, or not known (``next_present``), or with
    ``step_end_parts``, short-lived);
    where the stored tokens leave an already stored prefix (the end of the last present chunk
    before the first absent one, the store's own start included); every interval point
    (``is_interval_point``). ``continues``: the store starts where the same request's previous
    step-end store ended, so its start is no branch point.
    """
    if first >= len(chunks):
        return [], []
    points = set()
    absent = [k for k in range(first, len(chunks)) if not present[k]]
    if absent and absent[0] > 0 and not (continues and absent[0] == first):
        points.add(absent[0] - 1)  # the branch point (for absent[0] == first: the store's start)
    points.update(k for k in range(first, len(chunks)) if is_interval_point(chunks[k], interval_tokens))
    last = len(chunks) - 1
    short = []
    if not step_end or (present[last] and not next_present):
        # a step end inside an already stored prefix may be where the request leaves it: the
        # next (continuing) store cannot tell, so the branch point is made here
        points.add(last)
    elif step_end_parts and last not in points:
        points.add(last)
        short = [last]
    return sorted(points), short
