"""Oracle: the prefix KV store: full prompt pages keyed by chained per-page keys, LRU-evicted.

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

Per-page state lives in arrays indexed by page id, so that every call costs a fixed handful of
numpy operations whatever its size (the simulator makes ~100 k calls of 10-200 pages per run):

* ``run[p]``: the run holding cached page ``p``, 0 when ``p`` is not cached. A run's page is
  still its entry exactly when ``run[page] == run_id`` (a dropped page reads 0, a re-inserted
  one a newer run), which is all a lookup needs to check.
* ``key[p]``: the key cached page ``p`` holds (stale once ``run[p]`` is 0).
* ``stamp[p]``: the recency stamp of an *evictable* page, 0 otherwise. The eviction queue's
  pair ``(p, s)`` is live exactly when ``stamp[p] == s``: acquiring or dropping a page zeroes
  its stamp, re-releasing it stamps it anew.

The key → page dict is the one per-entry Python structure, and its operations cost a cache
miss or two each, so eviction leaves it alone: a dropped entry stays in the dict, **stale**,
and a look-up checks that its page is still cached under that key (``run[p] != 0 and
key[p] == k``; ``run`` and ``key`` are numpy views of ``array`` buffers, so Python reads them
without numpy's scalar overhead). An insert maps its keys first, in one ``setdefault`` pass
that keeps existing pages (so live entries are still told from stale ones), and caches the
pages after: an entry whose page never gets cached (no room left, bad ids) is just stale.
Re-inserting a key overwrites its stale entry; the dict is rebuilt from the arrays once stale
entries outnumber four times the pool's pages (amortised O(1) per eviction). Likewise, runs
whose pages were all dropped are swept in bulk once the runs kept hold twice as many entries as
the pool has pages, not counted down per drop.

The tests' oracle: the numpy model the native store (``tspd_core.sched._prefix``) must match.
"""

from __future__ import annotations

from array import array
from itertools import repeat

import numpy as np
from numpy.typing import ArrayLike, NDArray

from sched_oracle.lru import EvictionQueue
from sched_oracle.pool import BlockPool, IndexArray, as_index
from tspd_core.sched.errors import InvalidInput
from tspd_core.sched.keys import KeyArray, as_keys
from tspd_core.sched.pool import PAGE_DTYPE, PageArray

_NO_PAGES = np.zeros(0, dtype=PAGE_DTYPE)
#: A run's keys and pages in chain order.
Run = tuple[KeyArray, IndexArray]


class PrefixKvStore:
    """Bounded map of chained page keys to shared prefix pages, with LRU eviction.

    Ownership: the store owns one pool reference per entry. :meth:`attach` hands the caller an
    extra reference per matched page; the caller gives every reference back through
    :meth:`release` (never straight to the pool, or recency and the evictable count drift).

    Ordering: key arrays are in chain order (root first); :meth:`match` and :meth:`attach`
    stop at the first missing key.

    Threading: not thread-safe; driven by the loop that owns the pool.
    """

    #: The key dict is rebuilt once its stale entries outnumber this many times the pages.
    _STALE_FACTOR = 4

    def __init__(self, pool: BlockPool, max_entries: int | None = None) -> None:
        limit = pool.num_pages if max_entries is None else max_entries
        if limit < 0:
            raise InvalidInput(f"max_entries must be >= 0, got {max_entries}")
        self._pool = pool
        self._refs = pool.refcounts
        self._max_entries = limit
        self._page_of: dict[int, int] = {}  # may hold stale entries (see the module doc)
        self._entries = 0  # live entries
        size = pool.num_pages + 1
        self._size = size
        self._run_py = array("q", bytes(8 * size))  # run holding each cached page, else 0
        self._key_py = array("Q", bytes(8 * size))
        self._run: NDArray[np.int64] = np.frombuffer(self._run_py, dtype=np.int64)
        self._key: KeyArray = np.frombuffer(self._key_py, dtype=np.uint64)
        self._stamp = np.zeros(size, dtype=np.int64)  # > 0 exactly for evictable pages
        # A cached page's index inside its run.
        self._offset = np.zeros(size, dtype=np.int64)
        self._runs: dict[int, Run] = {}
        self._run_ids = 0
        self._run_entries = 0  # entries of the runs kept (live or not)
        self._sweep_at = 2 * size
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
        return self._entries

    def __contains__(self, key: object) -> bool:
        page = self._page_of.get(key)  # type: ignore[call-overload]
        return page is not None and self._run_py[page] != 0 and self._key_py[page] == key

    def evictable_count(self) -> int:
        """Entries held by nobody but the store: pages :meth:`evict` can free (O(1))."""
        return self._evictable

    def entries(self) -> dict[int, int]:
        """A copy of the key → page map (for inspection and tests)."""
        run, key = self._run_py, self._key_py
        return {k: p for k, p in self._page_of.items() if run[p] and key[p] == k}

    def is_cached(self, pages: ArrayLike) -> NDArray[np.bool_]:
        """Whether each page is held by an entry."""
        cached: NDArray[np.bool_] = self._run[as_index(pages)] != 0
        return cached

    def match(self, keys: ArrayLike, limit: int | None = None) -> PageArray:
        """Pages of the longest stored prefix of ``keys[:limit]`` (no reference taken); it
        also stops at a repeated page (only a repeated key can bring one)."""
        parts = self._segments(as_keys(keys)[:limit])
        pages = np.concatenate(parts) if parts else _NO_PAGES
        seen = np.unique(pages, return_index=True)[1]
        if len(seen) < len(pages):  # cut at the first page seen before
            repeats = np.setdiff1d(np.arange(len(pages)), seen)
            pages = pages[: repeats.min()]
        return pages.astype(PAGE_DTYPE)

    def _segments(self, wanted: KeyArray) -> list[IndexArray]:
        # The stored prefix of ``wanted`` as slices of runs: find a key in the map, then take
        # as much of its run as still matches (same keys, pages still entries of that run).
        n, done, parts = len(wanted), 0, []
        page_of, run_of, key_of = self._page_of, self._run_py, self._key_py
        while done < n:
            key = int(wanted[done])
            page = page_of.get(key)
            if page is None or not run_of[page] or key_of[page] != key:
                break  # missing, or a stale entry
            run = run_of[page]
            run_keys, run_pages = self._run_arrays(run)
            start = int(self._offset[page])
            span = min(n - done, len(run_keys) - start)
            cand = run_pages[start : start + span]
            bad = run_keys[start : start + span] != wanted[done : done + span]
            bad |= self._run[cand] != run
            good = int(bad.argmax()) if span > 1 else 0
            if not bad[good]:
                good = span
            if not good:  # cannot happen while the map and the runs agree; never spin
                break
            parts.append(cand[:good])
            done += good
        return parts

    def _run_arrays(self, run: int) -> tuple[KeyArray, IndexArray]:
        return self._runs[run]

    def attach(self, keys: ArrayLike, limit: int | None = None) -> PageArray:
        """Like :meth:`match`, and take one reference per matched page for the caller."""
        pages = self.match(keys, limit)
        self.acquire(pages, trusted=True)
        return pages

    def acquire(self, pages: PageArray, *, trusted: bool = False) -> None:
        """Take one more reference on pages the caller already holds or that are cached.

        ``trusted`` skips the pool's id checks (see :class:`BlockPool`)."""
        if len(pages):
            idx = as_index(pages)
            self._pool.incref(idx, trusted=trusted)
            lone = int(np.count_nonzero(self._stamp[idx]))  # were evictable: no longer
            if lone:
                self._evictable -= lone
                self._stamp[idx] = 0

    def release(self, pages: PageArray, *, trusted: bool = False) -> PageArray:
        """Give back one reference per page (chain order); return the pages that became free.

        ``trusted`` skips the pool's id checks (see :class:`BlockPool`)."""
        idx = as_index(pages)
        freed = self._pool.decref(idx, trusted=trusted)
        lone = idx[(self._refs[idx] == 1) & (self._run[idx] != 0)]
        n = len(lone)
        if n:  # leaf first: the root gets the newest stamp
            stamps = np.arange(self._clock + n, self._clock, -1, dtype=np.int64)
            self._clock += n
            self._stamp[lone] = stamps
            self._evictable += n
            self._queue.push(lone[::-1], stamps[::-1], self._live)
        return freed

    def insert(self, keys: ArrayLike, pages: ArrayLike, *, trusted: bool = False) -> int:
        """Add entries for ``keys[i] → pages[i]`` the caller holds; return how many were added.

        Keys already present keep their page (the caller's copy stays private); pages already
        cached under another key are skipped. When the store is full, evictable entries make
        room first; insertion stops (keeping chain order) when no room is left.
        """
        wanted = as_keys(keys)
        ids = as_index(pages)
        if ids.ndim != 1 or len(ids) != len(wanted):
            raise InvalidInput(f"insert: {len(wanted)} keys but {ids.size} pages")
        skip = sum(map(len, self._segments(wanted)))  # the stored prefix: nothing to add
        new_keys, new_pages = self._fresh(wanted[skip:], ids[skip:])  # in the dict already
        room = self._max_entries - self._entries
        if len(new_keys) > room:  # entries cut here stay in the dict as stale ones
            self.evict(len(new_keys) - room)
            room = max(0, self._max_entries - self._entries)
            new_keys, new_pages = new_keys[:room], new_pages[:room]
        n = len(new_keys)
        if not n:
            return 0
        self._pool.incref(new_pages, trusted=trusted)  # checks ids unless trusted
        self._run_ids += 1
        self._run[new_pages] = self._run_ids
        self._key[new_pages] = new_keys
        self._offset[new_pages] = np.arange(n)
        self._entries += n
        self._runs[self._run_ids] = (new_keys, new_pages)
        self._run_entries += n
        if self._run_entries > self._sweep_at:
            self._sweep()
        if len(self._page_of) > self._entries + self._STALE_FACTOR * self._size:
            self._rebuild_map()
        return n

    def _fresh(self, keys: KeyArray, pages: IndexArray) -> tuple[KeyArray, IndexArray]:
        # The entries to add — neither key stored nor page cached, no key twice — with their
        # keys already mapped in the dict. A dict entry only counts once its page is cached
        # under that key, so mapping first is safe: entries never cached stay stale.
        # ``setdefault`` probes each key once and keeps an existing page, so the usual case
        # (every key absent and distinct, every page uncached) costs one dict pass.
        klist, plist = keys.tolist(), pages.tolist()
        page_of = self._page_of
        cached = self._run[pages] != 0
        if np.count_nonzero(cached):
            found = np.fromiter(map(page_of.get, klist, repeat(0)), np.intp, len(klist))
        else:
            before = len(page_of)
            got = list(map(page_of.setdefault, klist, plist))
            if len(page_of) == before + len(klist) and got == plist:
                return keys.copy(), pages.copy()
            found = np.array(got, dtype=np.intp)  # pages kept: tell live entries from stale
        taken = cached | ((self._run[found] != 0) & (self._key[found] == keys))
        picked, seen = [], set()
        for i, (key, skip) in enumerate(zip(klist, taken.tolist(), strict=True)):
            if not skip and key not in seen:
                seen.add(key)
                picked.append(i)
        page_of.update((klist[i], plist[i]) for i in picked)  # replaces stale entries
        chosen = np.array(picked, dtype=np.intp)
        return keys[chosen], pages[chosen]

    def _rebuild_map(self) -> None:
        # Drop the stale entries: rebuild the dict from the cached pages (O(pages), once per
        # 4 x pages evictions).
        cached = np.flatnonzero(self._run)
        self._page_of = dict(zip(self._key[cached].tolist(), cached.tolist(), strict=True))

    def _sweep(self) -> None:
        # Forget the runs no cached page belongs to any more; the next sweep waits until as
        # many entries again were inserted, so the cost stays amortised O(1) per entry.
        live = np.unique(self._run).tolist()
        self._runs = {run: self._runs[run] for run in live if run}
        self._run_entries = sum(len(k) for k, _ in self._runs.values())
        self._sweep_at = max(2 * len(self._run), 2 * self._run_entries)

    def evict(self, count: int) -> int:
        """Drop up to ``count`` evictable entries, oldest first; return how many were dropped."""
        count = min(count, self._evictable)
        if count <= 0:
            return 0
        pages = self._queue.pop(count, self._live)
        self._run[pages] = 0  # their dict entries go stale
        self._stamp[pages] = 0
        self._entries -= len(pages)
        self._evictable -= len(pages)
        self.evicted_total += len(pages)
        self._pool.free_unshared(pages)  # evictable: the store held each page alone
        return len(pages)

    def clear(self) -> int:
        """Evict every evictable entry; return how many were dropped."""
        return self.evict(self._evictable)

    def _live(self, pages: IndexArray, stamps: NDArray[np.int64]) -> NDArray[np.bool_]:
        # A queued pair names an evictable page exactly when its stamp is still the page's.
        live: NDArray[np.bool_] = self._stamp[pages] == stamps
        return live
