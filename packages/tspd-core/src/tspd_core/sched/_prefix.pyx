# cython: language_level=3, boundscheck=True, wraparound=False, initializedcheck=True
"""The prefix KV store: full prompt pages keyed by chained per-page keys, LRU-evicted.

An entry maps one page key (see :mod:`tspd_core.sched.keys`) to one physical page and holds one
reference on that page in the :class:`BlockPool`. Requests that reuse a prefix hold their own
reference on top. An entry is **evictable** when the store's reference is the only one left.

Recency is recorded when a holder *releases* pages: the released chain enters the LRU list
leaf first, so its first page (the root of the prefix) is the newest, the tails of cold
prefixes go first and the shared roots stay longest (a parent is always at least as recent as
its children)::

    release(root, a, b)          LRU (oldest first):  ... b, a, root
    evict order:                 b, a, root

State, all owned here: the key -> page map (open addressing, linear probing, deletion by
backward shift, so an evicted key is gone at once), each cached page's key, and the LRU list of
evictable pages (doubly linked through the page ids: acquiring a page unlinks it in O(1)). The
pool's ``cached`` flags say which pages are entries, so the pool refuses to move their
references behind the store's back.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

import numpy as np

from tspd_core.sched._build import check_built_from
from tspd_core.sched.errors import InvalidInput, SchedulerError
from tspd_core.sched.keys import as_keys

from tspd_core.sched._pool cimport HELD, BlockPool, as_ids, new_memory

cdef extern from *:
    """
    #ifndef TSPD_SOURCE_SHA256
    #define TSPD_SOURCE_SHA256 ""
    #endif
    """
    const char *TSPD_SOURCE_SHA256

check_built_from(__file__, "_prefix", TSPD_SOURCE_SHA256.decode("ascii"))

cdef uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL
cdef uint64_t U64_MAX = 0xFFFFFFFFFFFFFFFFULL


@cython.auto_pickle(False)
cdef class PrefixKvStore:
    """Bounded map of chained page keys to shared prefix pages, with LRU eviction.

    Ownership: the store owns one pool reference per entry. :meth:`attach` hands the caller an
    extra reference per matched page; the caller gives every reference back through
    :meth:`release` (the pool refuses to move an entry's references itself, since recency and
    the evictable count would drift). One store per pool.

    Ordering: key arrays are in chain order (root first); :meth:`match` and :meth:`attach`
    stop at the first missing key.

    Threading: not thread-safe; driven by the loop that owns the pool.
    """

    def __cinit__(self, pool, max_entries=None):
        if not isinstance(pool, BlockPool):
            raise InvalidInput(f"a prefix store is built on a BlockPool, got {pool!r}")
        cdef BlockPool p = pool
        limit = p.num_pages if max_entries is None else max_entries
        if not isinstance(limit, (int, np.integer)) or limit < 0:
            raise InvalidInput(f"max_entries must be >= 0, got {max_entries}")
        if p.has_store:
            raise InvalidInput("this block pool already has a prefix store; build one per pool")
        self.pool = p
        self.max_entries = limit
        cdef Py_ssize_t size = 16, n = p.num_pages + 1
        self.map_shift = 60
        while size < 2 * n:
            size *= 2
            self.map_shift -= 1
        self.map_mask = size - 1
        self.map_keys = new_memory("Q", size)
        self.map_pages = new_memory("i", size)
        self.key_of = new_memory("Q", n)
        self.lru_prev = new_memory("i", n)
        self.lru_next = new_memory("i", n)
        self.in_lru = new_memory("B", n)
        self.picks = new_memory("i", n)
        self.victims = new_memory("i", n)
        self.lone = new_memory("i", n)
        p.has_store = True

    def __len__(self):
        return self.n_entries

    def __contains__(self, key):
        if not isinstance(key, (int, np.integer)) or not 0 <= key <= U64_MAX:
            return False
        return self.lookup(key) != 0

    def evictable_count(self):
        """Entries held by nobody but the store: pages :meth:`evict` can free (O(1))."""
        return self.evictable

    def entries(self):
        """A copy of the key -> page map, in page order (for inspection and tests)."""
        cdef Py_ssize_t page
        return {
            self.key_of[page]: page
            for page in range(1, self.pool.num_pages + 1)
            if self.pool.cached[page]
        }

    def is_cached(self, pages):
        """Whether each page is held by an entry."""
        ids = as_ids(pages, "is_cached")
        if ids.size and (ids.min() < 1 or ids.max() > self.pool.num_pages):
            raise InvalidInput(f"is_cached: page ids must lie in 1 .. {self.pool.num_pages}")
        return np.asarray(self.pool.cached)[ids] != 0

    def match(self, keys, limit=None):
        """Pages of the longest stored prefix of ``keys[:limit]`` (no reference taken)."""
        wanted = as_keys(keys)[:limit]
        out = np.empty(len(wanted), dtype=np.int32)
        cdef Py_ssize_t n = self.match_into(wanted, len(wanted), out)
        return out[:n].copy()

    def attach(self, keys, limit=None):
        """Like :meth:`match`, and take one reference per matched page for the caller."""
        pages = self.match(keys, limit)
        self.acquire_pages(pages, False)
        return pages

    def acquire(self, pages):
        """Take one more reference on pages that are in use (cached or held by the caller)."""
        ids = as_ids(pages, "acquire")
        self.pool.check_ids(ids, "acquire", 0)
        self.acquire_pages(ids.astype(np.int32), False)

    def release(self, pages):
        """Give back one reference (the caller's) per page, in chain order; return the pages
        that became free."""
        ids = as_ids(pages, "release")
        self.pool.check_ids(ids, "release", HELD)
        cdef Py_ssize_t n = self.release_pages(ids.astype(np.int32), False)
        return np.asarray(self.pool.freed)[:n].copy()

    def insert(self, keys, pages):
        """Add entries for ``keys[i] -> pages[i]`` the caller holds; return how many were added.

        Keys already present keep their page (the caller's copy stays private); pages already
        cached under another key are skipped. When the store is full, evictable entries make
        room first; insertion stops (keeping chain order) when no room is left.
        """
        wanted = as_keys(keys)
        ids = as_ids(pages, "insert")
        if len(ids) != len(wanted):
            raise InvalidInput(f"insert: {len(wanted)} keys but {ids.size} pages")
        self.pool.check_ids(ids, "insert", 0)
        return self.insert_pages(wanted, ids.astype(np.int32))

    def evict(self, count):
        """Drop up to ``count`` evictable entries, oldest first; return how many were dropped."""
        if not isinstance(count, (int, np.integer)):
            raise InvalidInput(f"evict: count must be an int, got {count!r}")
        return self.evict_pages(max(0, min(count, self.evictable)))

    def clear(self):
        """Evict every evictable entry; return how many were dropped."""
        return self.evict_pages(self.evictable)

    def _snapshot(self):
        """The store's state (for tests): entries, LRU order (oldest first), counters."""
        order = []
        cdef int32_t page = self.lru_next[0]
        while page:
            order.append(page)
            page = self.lru_next[page]
        return {
            "entries": self.entries(),
            "lru": order,
            "evictable": self.evictable,
            "len": self.n_entries,
            "evicted_total": self.evicted_total,
        }

    # -- the key map ----------------------------------------------------------------------

    cdef Py_ssize_t home(self, uint64_t key):
        return <Py_ssize_t>((key * GOLDEN) >> self.map_shift)

    cdef int32_t lookup(self, uint64_t key):
        """The page stored under ``key``, 0 when none."""
        cdef Py_ssize_t i = self.home(key)
        while self.map_pages[i]:
            if self.map_keys[i] == key:
                return self.map_pages[i]
            i = (i + 1) & self.map_mask
        return 0

    cdef void map_put(self, uint64_t key, int32_t page):
        # ``key`` is absent (checked by the caller); the table is at most half full.
        cdef Py_ssize_t i = self.home(key)
        while self.map_pages[i]:
            i = (i + 1) & self.map_mask
        self.map_keys[i] = key
        self.map_pages[i] = page

    cdef void map_delete(self, uint64_t key):
        # Backward-shift deletion: move later entries of the probe run into the hole unless
        # their home lies cyclically in (hole, slot], so every look-up still finds them.
        cdef Py_ssize_t i = self.home(key), j, h
        while self.map_pages[i] and self.map_keys[i] != key:
            i = (i + 1) & self.map_mask
        j = i  # (an absent key stops at an empty slot: nothing after it belongs before it)
        while True:
            j = (j + 1) & self.map_mask
            if not self.map_pages[j]:
                break
            h = self.home(self.map_keys[j])
            if (i <= j and (h <= i or h > j)) or (i > j and h <= i and h > j):
                self.map_keys[i] = self.map_keys[j]
                self.map_pages[i] = self.map_pages[j]
                i = j
        self.map_pages[i] = 0

    # -- the LRU list ---------------------------------------------------------------------

    cdef void lru_append(self, int32_t page):
        cdef int32_t last = self.lru_prev[0]
        self.lru_next[last] = page
        self.lru_prev[page] = last
        self.lru_next[page] = 0
        self.lru_prev[0] = page
        self.in_lru[page] = 1

    cdef void lru_unlink(self, int32_t page):
        cdef int32_t before = self.lru_prev[page], after = self.lru_next[page]
        self.lru_next[before] = after
        self.lru_prev[after] = before
        self.in_lru[page] = 0

    # -- the C-level interface (the scheduler) ----------------------------------------------

    cdef Py_ssize_t match_into(
        self, const uint64_t[:] keys, Py_ssize_t limit, int32_t[:] out
    ) except -1:
        """Write the pages of the longest stored prefix of ``keys[:limit]`` to ``out``. A
        chain holds each page once: the match also stops at a key whose page it already has
        (only a repeated key can do that; real chained keys never repeat)."""
        cdef Py_ssize_t i, n = min(limit, keys.shape[0])
        cdef int32_t page
        self.pool.mark_gen += 1
        for i in range(n):
            page = self.lookup(keys[i])
            if not page or self.pool.mark[page] == self.pool.mark_gen:
                return i
            self.pool.mark[page] = self.pool.mark_gen
            out[i] = page
        return n

    cdef Py_ssize_t count_evictable(self, int32_t[:] pages):
        """How many of ``pages`` are evictable now."""
        cdef Py_ssize_t i, n = 0
        for i in range(pages.shape[0]):
            n += self.in_lru[pages[i]]
        return n

    cdef int acquire_pages(self, int32_t[:] pages, bint owned) except -1:
        """One more reference per page (in use; may repeat); evictable ones stop being so."""
        self.pool.add(pages, owned)
        cdef Py_ssize_t i
        for i in range(pages.shape[0]):
            if self.in_lru[pages[i]]:
                self.lru_unlink(pages[i])
                self.evictable -= 1
        return 0

    cdef Py_ssize_t release_pages(self, int32_t[:] pages, bint owned) except -1:
        """Drop one reference per page (distinct, chain order): freed pages go to the pool's
        free stack (``pool.freed[:n]``, n returned); entries left to the store alone become
        evictable, leaf first, so the root is the newest."""
        cdef Py_ssize_t n = self.pool.drop(pages, owned), i, lone = 0
        cdef int32_t page
        for i in range(pages.shape[0]):
            page = pages[i]
            if self.pool.cached[page] and self.pool.rc[page] == 1 and not self.in_lru[page]:
                self.lone[lone] = page
                lone += 1
        for i in range(lone - 1, -1, -1):
            self.lru_append(self.lone[i])
        self.evictable += lone
        return n

    cdef Py_ssize_t evict_pages(self, Py_ssize_t count) except -1:
        """Drop the ``count`` oldest evictable entries (count <= evictable): their pages go
        back to the pool's free stack, next allocated in eviction order."""
        if count < 0 or count > self.evictable:
            raise SchedulerError(f"internal: cannot evict {count} of {self.evictable} entries")
        cdef Py_ssize_t i
        cdef int32_t page
        for i in range(count):
            page = self.lru_next[0]
            self.lru_unlink(page)
            self.map_delete(self.key_of[page])
            self.pool.cached[page] = 0
            self.victims[i] = page
        self.n_entries -= count
        self.evictable -= count
        self.evicted_total += count
        self.pool.drop(self.victims[:count], True)
        return count

    cdef Py_ssize_t insert_pages(self, const uint64_t[:] keys, int32_t[:] pages) except -1:
        """:meth:`insert` of checked ids (distinct, in use): skip the stored prefix, pick the
        entries to add (key not stored, page not cached, key not repeated: the map, filled as
        they are picked, tells all three), make room by evicting, drop the picks that still do
        not fit (chain order kept), then cache the rest."""
        cdef Py_ssize_t n = keys.shape[0], skip = 0, picked = 0, i, j, room
        if pages.shape[0] != n:
            raise SchedulerError(f"internal: insert of {n} keys but {pages.shape[0]} pages")
        while skip < n and self.lookup(keys[skip]):
            skip += 1
        for i in range(skip, n):
            if self.pool.cached[pages[i]] or self.lookup(keys[i]):
                continue
            self.map_put(keys[i], pages[i])
            self.picks[picked] = <int32_t>i
            picked += 1
        room = self.max_entries - self.n_entries
        if picked > room:
            self.evict_pages(min(picked - room, self.evictable))
            room = max(0, self.max_entries - self.n_entries)
            for j in range(room, picked):
                self.map_delete(keys[self.picks[j]])
            picked = room
        for j in range(picked):
            i = self.picks[j]
            self.key_of[pages[i]] = keys[i]
            self.pool.cached[pages[i]] = 1
            self.victims[j] = pages[i]
        self.pool.add(self.victims[:picked], True)
        self.n_entries += picked
        return picked
