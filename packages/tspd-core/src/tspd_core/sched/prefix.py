"""The prefix KV store: full prompt pages keyed by chained per-page keys, LRU-evicted.

An entry maps one page key (see :mod:`tspd_core.sched.keys`) to one physical page and holds one
reference on that page in the :class:`BlockPool`. Requests that reuse a prefix hold their own
reference on top. An entry is **evictable** when the store's reference is the only one left.

Recency is recorded when a holder *releases* pages: the released chain is stamped so that its
first page (the root of the prefix) is the newest, so the tails of cold prefixes go first and
the shared roots stay longest (a parent is always at least as recent as its children)::

    release(root, a, b)          stamps: b=t+1  a=t+2  root=t+3
    evict order (oldest first):  b, a, root

Evictable pages wait in a FIFO in stamp order; an entry whose page was reused or re-stamped
since it was queued is skipped when reached (lazy deletion), so eviction costs O(evicted).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from tspd_core.sched.errors import InvalidInput
from tspd_core.sched.keys import as_keys
from tspd_core.sched.pool import PAGE_DTYPE, BlockPool, PageArray


class PrefixKvStore:
    """Bounded map of chained page keys to shared prefix pages, with LRU eviction.

    Ownership: the store owns one pool reference per entry. :meth:`attach` hands the caller an
    extra reference per matched page; the caller gives every reference back through
    :meth:`release` (never straight to the pool, or recency and the evictable count drift).

    Ordering: key arrays are in chain order (root first); :meth:`match` and :meth:`attach`
    stop at the first missing key.

    Threading: not thread-safe; driven by the loop that owns the pool.
    """

    def __init__(self, pool: BlockPool, max_entries: int | None = None) -> None:
        limit = pool.num_pages if max_entries is None else max_entries
        if limit < 0:
            raise InvalidInput(f"max_entries must be >= 0, got {max_entries}")
        self._pool = pool
        self._max_entries = limit
        self._page_of: dict[int, int] = {}
        size = pool.num_pages + 1
        self._cached = np.zeros(size, dtype=bool)
        self._key = np.zeros(size, dtype=np.uint64)
        self._stamp = np.zeros(size, dtype=np.int64)
        self._clock = 0
        self._evictable = 0
        self._q_page = np.zeros(max(64, size), dtype=PAGE_DTYPE)
        self._q_stamp = np.zeros(max(64, size), dtype=np.int64)
        self._q_head = 0
        self._q_tail = 0
        self.evicted_total = 0  #: entries evicted since construction (a metric)

    @property
    def pool(self) -> BlockPool:
        """The pool whose pages this store references."""
        return self._pool

    @property
    def max_entries(self) -> int:
        """Most entries the store keeps (defaults to the pool's page count)."""
        return self._max_entries

    def __len__(self) -> int:
        return len(self._page_of)

    def __contains__(self, key: object) -> bool:
        return key in self._page_of

    def evictable_count(self) -> int:
        """Entries held by nobody but the store: pages :meth:`evict` can free (O(1))."""
        return self._evictable

    def entries(self) -> dict[int, int]:
        """A copy of the key → page map (for inspection and tests)."""
        return dict(self._page_of)

    def is_cached(self, pages: ArrayLike) -> NDArray[np.bool_]:
        """Whether each page is held by an entry."""
        return self._cached[np.asarray(pages, dtype=np.intp)]

    def match(self, keys: ArrayLike, limit: int | None = None) -> PageArray:
        """Pages of the longest stored prefix of ``keys[:limit]`` (no reference taken)."""
        wanted = as_keys(keys)[:limit].tolist()
        got = list(map(self._page_of.get, wanted))
        try:
            hit = got.index(None)
        except ValueError:
            hit = len(got)
        return np.array(got[:hit], dtype=PAGE_DTYPE)

    def attach(self, keys: ArrayLike, limit: int | None = None) -> PageArray:
        """Like :meth:`match`, and take one reference per matched page for the caller."""
        pages = self.match(keys, limit)
        if len(pages):
            self._evictable -= int(np.count_nonzero(self._pool.refcounts[pages] == 1))
            self._pool.incref(pages)
        return pages

    def acquire(self, pages: PageArray) -> None:
        """Take one more reference on pages the caller already holds or that are cached."""
        if len(pages):
            lone = self._cached[pages] & (self._pool.refcounts[pages] == 1)
            self._evictable -= int(np.count_nonzero(lone))
            self._pool.incref(pages)

    def release(self, pages: PageArray) -> PageArray:
        """Give back one reference per page (chain order); return the pages that became free."""
        freed = self._pool.decref(pages)
        held = pages[self._cached[pages]][::-1]  # leaf first: the root gets the newest stamp
        if len(held):
            stamps = np.arange(self._clock + 1, self._clock + 1 + len(held), dtype=np.int64)
            self._clock += len(held)
            self._stamp[held] = stamps
            lone = self._pool.refcounts[held] == 1
            if lone.any():
                self._evictable += int(np.count_nonzero(lone))
                self._push(held[lone], stamps[lone])
        return freed

    def insert(self, keys: ArrayLike, pages: ArrayLike) -> int:
        """Add entries for ``keys[i] → pages[i]`` the caller holds; return how many were added.

        Keys already present keep their page (the caller's copy stays private); pages already
        cached under another key are skipped. When the store is full, evictable entries make
        room first; insertion stops (keeping chain order) when no room is left.
        """
        wanted = as_keys(keys)
        ids = np.asarray(pages, dtype=PAGE_DTYPE)
        if ids.ndim != 1 or len(ids) != len(wanted):
            raise InvalidInput(f"insert: {len(wanted)} keys but {ids.size} pages")
        fresh = ~self._cached[ids]
        picked: list[int] = []
        seen: set[int] = set()
        for i, (key, new) in enumerate(zip(wanted.tolist(), fresh.tolist(), strict=True)):
            if new and key not in self._page_of and key not in seen:
                seen.add(key)
                picked.append(i)
        room = self._max_entries - len(self._page_of)
        if len(picked) > room:
            self.evict(len(picked) - room)
            picked = picked[: max(0, self._max_entries - len(self._page_of))]
        if not picked:
            return 0
        chosen = np.array(picked, dtype=np.intp)
        new_pages, new_keys = ids[chosen], wanted[chosen]
        self._pool.incref(new_pages)
        self._cached[new_pages] = True
        self._key[new_pages] = new_keys
        self._page_of.update(zip(new_keys.tolist(), new_pages.tolist(), strict=True))
        return len(picked)

    def evict(self, count: int) -> int:
        """Drop up to ``count`` evictable entries, oldest first; return how many were dropped."""
        need = min(count, self._evictable)
        done = 0
        while done < need and self._q_head < self._q_tail:
            end = min(self._q_tail, self._q_head + max(2 * (need - done), 64))
            pages = self._q_page[self._q_head : end]
            valid = (
                self._cached[pages]
                & (self._pool.refcounts[pages] == 1)
                & (self._stamp[pages] == self._q_stamp[self._q_head : end])
            )
            idx = np.flatnonzero(valid)[: need - done]
            if len(idx) == need - done:
                self._q_head += int(idx[-1]) + 1
            else:
                self._q_head = end
            if len(idx):
                self._drop(pages[idx].copy())
                done += len(idx)
        return done

    def clear(self) -> int:
        """Evict every evictable entry; return how many were dropped."""
        return self.evict(self._evictable)

    def _drop(self, pages: PageArray) -> None:
        self._cached[pages] = False
        for key in self._key[pages].tolist():
            del self._page_of[key]
        self._evictable -= len(pages)
        self.evicted_total += len(pages)
        self._pool.decref(pages)

    def _push(self, pages: PageArray, stamps: NDArray[np.int64]) -> None:
        n = len(pages)
        if self._q_tail + n > len(self._q_page):
            self._compact(n)
        self._q_page[self._q_tail : self._q_tail + n] = pages
        self._q_stamp[self._q_tail : self._q_tail + n] = stamps
        self._q_tail += n

    def _compact(self, incoming: int) -> None:
        # Keep only entries that can still be evicted; grow if live entries fill the buffer.
        pages = self._q_page[self._q_head : self._q_tail]
        stamps = self._q_stamp[self._q_head : self._q_tail]
        live = self._stamp[pages] == stamps
        pages, stamps = pages[live], stamps[live]
        size = len(self._q_page)
        while 2 * (len(pages) + incoming) > size:  # keep half free: compaction stays amortised
            size *= 2
        if size != len(self._q_page):
            self._q_page = np.zeros(size, dtype=PAGE_DTYPE)
            self._q_stamp = np.zeros(size, dtype=np.int64)
        self._q_page[: len(pages)] = pages
        self._q_stamp[: len(pages)] = stamps
        self._q_head, self._q_tail = 0, len(pages)
