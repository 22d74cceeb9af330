"""The prefix KV store: full prompt pages keyed by chained per-page keys, LRU-evicted.

An entry maps one page key (see :mod:`tspd_core.sched.keys`) to one physical page and holds one
reference on that page in the :class:`BlockPool`. Requests that reuse a prefix hold their own
reference on top. An entry is **evictable** when the store's reference is the only one left.

Recency is recorded when a holder *releases* pages: the released chain is stamped so that its
first page (the root of the prefix) is the newest, so the tails of cold prefixes go first and
the shared roots stay longest (a parent is always at least as recent as its children)::

    release(root, a, b)          stamps: b=t+1  a=t+2  root=t+3
    evict order (oldest first):  b, a, root

Entries inserted together form a **run** (their keys and pages, in chain order). A lookup
finds the first key in the map, then compares the rest of that run with the wanted keys in
one vectorised step, so a 768-page prefix hit costs a few dict look-ups, not 768.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from tspd_core.sched.errors import InvalidInput
from tspd_core.sched.keys import KeyArray, as_keys
from tspd_core.sched.lru import EvictionQueue
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
        self._run = np.zeros(size, dtype=np.int64)  # run holding each cached page
        self._offset = np.zeros(size, dtype=np.int64)  # its index inside that run
        self._runs: dict[int, tuple[KeyArray, PageArray]] = {}
        self._run_live: dict[int, int] = {}
        self._run_ids = 0
        self._clock = 0
        self._evictable = 0
        self._queue = EvictionQueue(size)
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
        wanted = as_keys(keys)[:limit]
        n, done, parts = len(wanted), 0, []
        while done < n:
            page = self._page_of.get(int(wanted[done]))
            if page is None:
                break
            run_keys, run_pages = self._runs[int(self._run[page])]
            start = int(self._offset[page])
            span = min(n - done, len(run_keys) - start)
            cand_keys = run_keys[start : start + span]
            cand = run_pages[start : start + span]
            ok = (cand_keys == wanted[done : done + span]) & self._cached[cand]
            ok &= self._key[cand] == cand_keys  # the page still holds that key
            good = span if ok.all() else int(np.argmin(ok))
            if not good:  # cannot happen while the map and the runs agree; never spin
                break
            parts.append(cand[:good])
            done += good
        return np.concatenate(parts) if parts else np.zeros(0, dtype=PAGE_DTYPE)

    def attach(self, keys: ArrayLike, limit: int | None = None) -> PageArray:
        """Like :meth:`match`, and take one reference per matched page for the caller."""
        pages = self.match(keys, limit)
        self.acquire(pages, trusted=True)
        return pages

    def acquire(self, pages: PageArray, *, trusted: bool = False) -> None:
        """Take one more reference on pages the caller already holds or that are cached.

        ``trusted`` skips the pool's id checks (see :class:`BlockPool`)."""
        if len(pages):
            self._pool.incref(pages, trusted=trusted)
            lone = self._cached[pages] & (self._pool.refcounts[pages] == 2)
            self._evictable -= int(np.count_nonzero(lone))

    def release(self, pages: PageArray, *, trusted: bool = False) -> PageArray:
        """Give back one reference per page (chain order); return the pages that became free.

        ``trusted`` skips the pool's id checks (see :class:`BlockPool`)."""
        freed = self._pool.decref(pages, trusted=trusted)
        held = pages[self._cached[pages]][::-1]  # leaf first: the root gets the newest stamp
        if len(held):
            stamps = np.arange(self._clock + 1, self._clock + 1 + len(held), dtype=np.int64)
            self._clock += len(held)
            self._stamp[held] = stamps
            lone = self._pool.refcounts[held] == 1
            if lone.any():
                self._evictable += int(np.count_nonzero(lone))
                self._queue.push(held[lone], stamps[lone], self._current)
        return freed

    def insert(self, keys: ArrayLike, pages: ArrayLike, *, trusted: bool = False) -> int:
        """Add entries for ``keys[i] → pages[i]`` the caller holds; return how many were added.

        Keys already present keep their page (the caller's copy stays private); pages already
        cached under another key are skipped. When the store is full, evictable entries make
        room first; insertion stops (keeping chain order) when no room is left.
        """
        wanted = as_keys(keys)
        ids = np.asarray(pages, dtype=PAGE_DTYPE)
        if ids.ndim != 1 or len(ids) != len(wanted):
            raise InvalidInput(f"insert: {len(wanted)} keys but {ids.size} pages")
        skip = len(self.match(wanted))  # the stored prefix: nothing to add there
        new_keys, new_pages = self._fresh(wanted[skip:], ids[skip:])
        room = self._max_entries - len(self._page_of)
        if len(new_keys) > room:
            self.evict(len(new_keys) - room)
            room = max(0, self._max_entries - len(self._page_of))
            new_keys, new_pages = new_keys[:room], new_pages[:room]
        if not len(new_keys):
            return 0
        self._pool.incref(new_pages, trusted=trusted)
        self._cached[new_pages] = True
        self._key[new_pages] = new_keys
        self._page_of.update(zip(new_keys.tolist(), new_pages.tolist(), strict=True))
        self._run_ids += 1
        self._runs[self._run_ids] = (new_keys, new_pages)
        self._run_live[self._run_ids] = len(new_keys)
        self._run[new_pages] = self._run_ids
        self._offset[new_pages] = np.arange(len(new_pages))
        return len(new_keys)

    def _fresh(self, keys: KeyArray, pages: PageArray) -> tuple[KeyArray, PageArray]:
        # Entries to add: neither key stored nor page cached, no key twice. The usual case
        # (all new) is checked with set operations; anything else takes the per-key path.
        klist = keys.tolist()
        distinct = set(klist)
        if (
            len(distinct) == len(klist)
            and self._page_of.keys().isdisjoint(distinct)
            and not self._cached[pages].any()
        ):
            return keys.copy(), pages.copy()
        cached = self._cached[pages].tolist()
        picked, seen = [], set()
        for i, key in enumerate(klist):
            if not cached[i] and key not in self._page_of and key not in seen:
                seen.add(key)
                picked.append(i)
        chosen = np.array(picked, dtype=np.intp)
        return keys[chosen], pages[chosen]

    def evict(self, count: int) -> int:
        """Drop up to ``count`` evictable entries, oldest first; return how many were dropped."""
        pages = self._queue.pop(min(count, self._evictable), self._evictable_now)
        if len(pages):
            self._drop(pages)
        return len(pages)

    def clear(self) -> int:
        """Evict every evictable entry; return how many were dropped."""
        return self.evict(self._evictable)

    def _current(self, pages: PageArray, stamps: NDArray[np.int64]) -> NDArray[np.bool_]:
        current: NDArray[np.bool_] = self._stamp[pages] == stamps
        return current

    def _evictable_now(self, pages: PageArray, stamps: NDArray[np.int64]) -> NDArray[np.bool_]:
        lone = self._pool.refcounts[pages] == 1
        now: NDArray[np.bool_] = self._cached[pages] & lone & (self._stamp[pages] == stamps)
        return now

    def _drop(self, pages: PageArray) -> None:
        self._cached[pages] = False
        for key in self._key[pages].tolist():
            del self._page_of[key]
        runs, counts = np.unique(self._run[pages], return_counts=True)
        for run, gone in zip(runs.tolist(), counts.tolist(), strict=True):
            self._run_live[run] -= gone
            if not self._run_live[run]:  # no page of the run is cached any more
                del self._run_live[run], self._runs[run]
        self._evictable -= len(pages)
        self.evicted_total += len(pages)
        self._pool.decref(pages, trusted=True)
