"""First-fit allocator of contiguous page runs over the cache server's shared segment.

Why pages and not size classes: one server serves engines whose layouts have different
chunk sizes, and it cannot know them in advance. Size classes would need a split of the
pool per class decided up front (or a rebalancer); fixed pages with one contiguous run per
entry adapt to whatever clients arrive. Each client's chunks all need the same run length
(``ceil(slot_bytes / page_bytes)``), so with one layout per node (the common case: every
TP rank of one model has the same chunk size) freeing any entry frees exactly a run that
fits the next one and the allocator behaves like the in-process fixed-slot pool: no
fragmentation, no search. With mixed layouts the server evicts LRU entries until a run
fits; waste is under one page per entry.

Free space is kept as maximal extents (coalesced on free) in a sorted list, so ``alloc``
is a first-fit scan over the extents and ``free`` is O(log n) plus a list insert.
Double frees and out-of-range frees raise ValueError: the server treats that as an
internal error, never as a crash.
"""

from __future__ import annotations

import bisect
from typing import Optional


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._starts: list[int] = [0] if num_pages else []  # sorted starts of free extents
        self._length: dict[int, int] = {0: num_pages} if num_pages else {}
        self.free_pages = num_pages

    def alloc(self, num_pages: int) -> Optional[int]:
        """First page of a free run of ``num_pages`` pages, or None when no run is long enough."""
        if num_pages <= 0:
            raise ValueError(f"a run needs at least one page, got {num_pages}")
        for i, start in enumerate(self._starts):
            length = self._length[start]
            if length < num_pages:
                continue
            del self._length[start]
            if length == num_pages:
                del self._starts[i]
            else:
                self._starts[i] = start + num_pages  # stays sorted: still below the next extent
                self._length[start + num_pages] = length - num_pages
            self.free_pages -= num_pages
            return start
        return None

    def free(self, start: int, num_pages: int) -> None:
        """Return the run ``[start, start + num_pages)``; it must be entirely allocated."""
        end = start + num_pages
        if num_pages <= 0 or start < 0 or end > self.num_pages:
            raise ValueError(f"run [{start}, {end}) is outside [0, {self.num_pages})")
        i = bisect.bisect_right(self._starts, start)
        left = self._starts[i - 1] if i > 0 else None
        right = self._starts[i] if i < len(self._starts) else None
        if left is not None and left + self._length[left] > start:
            raise ValueError(f"double free: page {start} is already free")
        if right is not None and right < end:
            raise ValueError(f"double free: page {right} in [{start}, {end}) is already free")
        self.free_pages += num_pages
        if right == end:  # merge with the extent after
            num_pages += self._length.pop(right)
            del self._starts[i]
        if left is not None and left + self._length[left] == start:  # merge with the extent before
            self._length[left] += num_pages
            return
        self._starts.insert(i, start)
        self._length[start] = num_pages

    def fits(self, num_pages: int) -> bool:
        return any(self._length[s] >= num_pages for s in self._starts)

    @property
    def num_extents(self) -> int:
        return len(self._starts)

    def largest_run(self) -> int:
        return max(self._length.values(), default=0)
