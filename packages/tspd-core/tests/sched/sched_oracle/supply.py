"""Where a scheduler gets pages from and gives them back to: the pool, plus the prefix store.

All of a scheduler's page references go through one :class:`PageSupply`, so that releases
reach the prefix store's recency and evictable accounting, and allocation falls back to evicting
unreferenced prefix pages only when the pool runs short.
"""

from __future__ import annotations

import numpy as np

from sched_oracle.pool import BlockPool, as_index
from sched_oracle.prefix import PrefixKvStore
from tspd_core.sched.errors import InvalidInput
from tspd_core.sched.pool import PageArray


class PageSupply:
    """A pool and its (optional) prefix store, used as one source of pages.

    Threading: not thread-safe; owned by the scheduler's loop.
    """

    __slots__ = ("pool", "store")

    def __init__(self, pool: BlockPool, store: PrefixKvStore | None) -> None:
        if store is not None and store.pool is not pool:
            raise InvalidInput("the prefix store must be built on the scheduler's block pool")
        self.pool = pool
        self.store = store

    def reclaimable(self) -> int:
        """Pages an allocation can get: free ones plus evictable prefix entries."""
        spare = self.store.evictable_count() if self.store is not None else 0
        return self.pool.free_count() + spare

    def can_supply(self, count: int, attached: PageArray) -> bool:
        """Whether ``count`` pages can be allocated once ``attached`` prefix pages are held."""
        spare = self.reclaimable()
        if self.store is not None and len(attached):
            spare -= int(np.count_nonzero(self.pool.refcounts[as_index(attached)] == 1))
        return count <= spare

    def allocate(self, count: int) -> PageArray | None:
        """``count`` fresh pages, evicting prefix entries if the pool is short; else None."""
        short = count - self.pool.free_count()
        if short > 0:
            if self.store is None or self.store.evictable_count() < short:
                return None
            self.store.evict(short)
        return self.pool.try_allocate(count)

    def match(self, keys: np.ndarray, limit: int) -> PageArray:
        """Pages of the longest stored prefix of ``keys[:limit]`` (empty without a store); the
        caller takes its references with :meth:`acquire`."""
        if self.store is None or limit <= 0 or not len(keys):
            return np.zeros(0, dtype=np.int32)
        return self.store.match(keys, limit)

    def acquire(self, pages: PageArray) -> None:
        """One more reference on pages that are already in use."""
        if self.store is not None:
            self.store.acquire(pages, trusted=True)
        else:
            self.pool.incref(pages, trusted=True)

    def release(self, pages: PageArray) -> PageArray:
        """Give back one reference per page (in page-table order); return the freed pages."""
        if self.store is not None:
            return self.store.release(pages, trusted=True)
        return self.pool.decref(pages, trusted=True)

    def release_each(self, pages: PageArray) -> None:
        """Like :meth:`release`, but ``pages`` may repeat an id (several references to drop)."""
        for layer in _layers(pages):
            self.release(layer)

    def acquire_each(self, pages: PageArray) -> None:
        """Like :meth:`acquire`, but ``pages`` may repeat an id."""
        for layer in _layers(pages):
            self.acquire(layer)

    def insert(self, keys: np.ndarray, pages: PageArray) -> int:
        """Offer full prompt pages to the prefix store; return how many entries were added."""
        if self.store is None or not len(keys):
            return 0
        return self.store.insert(keys, pages, trusted=True)


def _layers(pages: PageArray) -> list[PageArray]:
    # Split into arrays of distinct ids (the pool's fancy-index updates count an id once per
    # call); k-th occurrences of each id go to layer k, order kept within a layer.
    if len(pages) < 2:
        return [pages]
    order = np.argsort(pages, kind="stable")
    ranked = pages[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    rank = np.arange(len(pages)) - np.repeat(starts, np.diff(np.r_[starts, len(pages)]))
    layer = np.empty(len(pages), dtype=np.intp)
    layer[order] = rank
    return [pages[layer == k] for k in range(int(rank.max()) + 1)]
