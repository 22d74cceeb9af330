"""A FIFO of (page, stamp) pairs in stamp order with lazy deletion: the prefix store's LRU.

Pages enter when they become evictable, stamped from a clock that only grows, so the FIFO is
in recency order without any re-sorting. A page that is reused or re-stamped after it was
queued leaves a stale pair behind; the caller's validity test skips it when it reaches the
head. Popping costs O(popped + skipped), and every pair is skipped at most once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from sched_oracle.pool import IndexArray

#: ``valid(pages, stamps)`` → mask of pairs that still name an evictable page.
Validity = Callable[[IndexArray, NDArray[np.int64]], NDArray[np.bool_]]


class EvictionQueue:
    """Recency-ordered queue of evictable pages; owned by one prefix store (not thread-safe)."""

    __slots__ = ("_head", "_pages", "_stamps", "_tail")

    def __init__(self, capacity: int) -> None:
        self._head = 0
        self._tail = 0
        self._alloc(max(64, capacity))

    def _alloc(self, size: int) -> None:
        self._pages = np.zeros(size, dtype=np.intp)
        self._stamps = np.zeros(size, dtype=np.int64)

    def __len__(self) -> int:
        return self._tail - self._head

    def push(self, pages: IndexArray, stamps: NDArray[np.int64], live: Validity) -> None:
        """Append pairs (stamps must exceed every stamp pushed before)."""
        n = len(pages)
        if self._tail + n > len(self._pages):
            self._compact(n, live)
        self._pages[self._tail : self._tail + n] = pages
        self._stamps[self._tail : self._tail + n] = stamps
        self._tail += n

    def pop(self, count: int, valid: Validity) -> IndexArray:
        """Remove and return up to ``count`` valid pages, oldest first."""
        taken: list[IndexArray] = []
        done = 0
        while done < count and self._head < self._tail:
            end = min(self._tail, self._head + max(2 * (count - done), 64))
            pages = self._pages[self._head : end]
            idx = valid(pages, self._stamps[self._head : end]).nonzero()[0][: count - done]
            self._head = self._head + int(idx[-1]) + 1 if len(idx) == count - done else end
            if len(idx):
                taken.append(pages[idx])  # fancy indexing copies: safe after the head moves
                done += len(idx)
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.intp)

    def _compact(self, incoming: int, live: Validity) -> None:
        # Drop stale pairs; grow so at least half stays free (compaction stays amortised).
        pages = self._pages[self._head : self._tail]
        stamps = self._stamps[self._head : self._tail]
        keep = live(pages, stamps)
        pages, stamps = pages[keep], stamps[keep]
        size = len(self._pages)
        while 2 * (len(pages) + incoming) > size:
            size *= 2
        if size != len(self._pages):
            self._alloc(size)
        self._pages[: len(pages)] = pages
        self._stamps[: len(pages)] = stamps
        self._head, self._tail = 0, len(pages)
