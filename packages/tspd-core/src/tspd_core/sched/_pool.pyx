# cython: language_level=3, boundscheck=True, wraparound=False, initializedcheck=True
"""The block pool: physical KV pages with reference counts, and the memory all native
scheduler state lives in.

Pages are numbered ``1 .. num_pages`` (the arena's page ids, wire.md §4/§5); page 0 is the null
page, is never handed out and never counted. A page is *free* when its reference count is 0
and *used* otherwise, so ``free_count() + used_count() == num_pages`` at all times.

Free pages sit on a stack. Allocation pops the most recently freed pages first (warm pages
stay warm) and is deterministic: a fresh pool hands out ``1, 2, 3, ...`` in that order, and
pages released together come back in the order they were released.

Indexing: every array access is bounds-checked (``boundscheck``); negative indices are not
wrapped (``wraparound=False``), so a negative index raises like any other out-of-range one
instead of quietly addressing the end of an array. Page ids from callers are checked first
and refused with :class:`~tspd_core.sched.errors.InvalidInput`.
"""

cimport cython
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITABLE
from cpython.mem cimport PyMem_Calloc, PyMem_Free

import numpy as np

from tspd_core.sched._build import check_built_from
from tspd_core.sched.errors import InvalidInput, PoolExhausted, SchedulerError

cdef extern from *:
    """
    #ifndef TSPD_SOURCE_SHA256
    #define TSPD_SOURCE_SHA256 ""
    #endif
    """
    const char *TSPD_SOURCE_SHA256

check_built_from(__file__, "_pool", TSPD_SOURCE_SHA256.decode("ascii"))

cdef int64_t INT32_MAX = 2147483647


@cython.auto_pickle(False)
cdef class Memory:
    """A zeroed C array owned by one native scheduler object.

    The owner takes its writable views right after construction; :func:`read_only` then seals
    it, and every later view (``np.asarray``, ``memoryview``) is read-only, so what callers
    read (reference counts, page tables) they cannot write, not even through ``.base``.
    """

    def __dealloc__(self):
        PyMem_Free(self.data)

    def __getbuffer__(self, Py_buffer *view, int flags):
        if flags & PyBUF_WRITABLE and self.sealed:
            raise BufferError("scheduler memory: its views are read-only")
        view.buf = self.data
        view.obj = self
        view.len = self.shape[0] * self.strides[0]
        view.readonly = self.sealed
        view.itemsize = self.itemsize
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = self.fmt
        view.ndim = self.ndim
        view.shape = NULL
        if flags & PyBUF_ND:
            view.shape = self.shape
        view.strides = NULL
        if flags & PyBUF_STRIDES == PyBUF_STRIDES:
            view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass


cdef dict ITEMSIZE = {"i": 4, "q": 8, "Q": 8, "b": 1, "B": 1}
cdef dict FORMATS = {fmt: fmt.encode() for fmt in ITEMSIZE}  # kept alive: fmt points into them


cdef Memory new_memory(str fmt, Py_ssize_t rows, Py_ssize_t cols=-1):
    """``rows`` (x ``cols``) zeroed items of struct format ``fmt`` (i, q, Q, b, B)."""
    cdef Memory m = Memory.__new__(Memory)
    cdef bytes code = FORMATS[fmt]
    m.itemsize = ITEMSIZE[fmt]
    m.fmt = code
    cdef Py_ssize_t width = 1 if cols < 0 else cols
    m.ndim = 1 if cols < 0 else 2
    m.shape[0], m.shape[1] = rows, width
    m.strides[1] = m.itemsize
    m.strides[0] = m.itemsize * width
    m.data = <char *>PyMem_Calloc(max(rows * width, 1), m.itemsize)
    if m.data == NULL:
        raise MemoryError(f"cannot allocate {rows} x {width} items for the scheduler")
    return m


cdef object read_only(Memory memory):
    """Seal ``memory`` (its owner holds its writable views by now) and view it read-only."""
    memory.sealed = True
    return np.asarray(memory)


cdef object as_ids(object pages, str what):
    """``pages`` as a contiguous int64 array; anything but a 1-D integer array is refused, so
    a conversion never hides bad input from the id checks."""
    ids = np.asarray(pages)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InvalidInput(f"{what}: page ids must be a 1-D integer array, got {ids!r}")
    return np.ascontiguousarray(ids, dtype=np.int64)


@cython.auto_pickle(False)
cdef class BlockPool:
    """Reference-counted physical pages ``1 .. num_pages`` of one rank's KV arena.

    Ownership: every holder of a page (a request's page table, a prefix-store entry, a caller
    that allocated or increfed it) owns exactly one reference per hold and gives it back once.
    The pool counts which references its prefix store and its schedulers own and refuses any
    call that would move one of theirs: a caller's :meth:`decref` must drop a reference the
    caller holds (so a page released twice raises instead of freeing a page a request still
    maps), and prefix-store entries move only through the store's ``acquire`` / ``release``
    (which keep its recency and evictable count).

    Checks: every call validates its page ids (a 1-D integer array; range; in use; no repeat)
    and raises :class:`InvalidInput` with nothing changed.

    Threading: not thread-safe. One engine loop (or one simulated instance) owns the pool; the
    scheduler and the prefix store built on it are driven from that same loop.
    """

    def __cinit__(self, num_pages):
        if not isinstance(num_pages, int) or num_pages < 1 or num_pages > INT32_MAX:
            raise InvalidInput(f"num_pages must be an int in 1 .. 2**31-1, got {num_pages!r}")
        cdef Py_ssize_t n = num_pages, i
        self.num_pages = n
        cdef Memory rc = new_memory("i", n + 1)
        self.rc = rc
        self.rc_view = read_only(rc)
        self.owned = new_memory("i", n + 1)
        self.cached = new_memory("B", n + 1)
        self.mark = new_memory("q", n + 1)
        self.freed = new_memory("i", n + 1)
        self.frees = new_memory("q", n + 1)
        self.stack = new_memory("i", n)
        for i in range(n):  # stored descending, top at the end: page 1 comes out first
            self.stack[i] = <int32_t>(n - i)
        self.top = n

    def free_count(self):
        """Pages with no reference (O(1))."""
        return self.top

    def used_count(self):
        """Pages with at least one reference (O(1))."""
        return self.num_pages - self.top

    def refcount(self, page):
        """References currently held on ``page``."""
        if not isinstance(page, (int, np.integer)) or not 1 <= page <= self.num_pages:
            raise InvalidInput(f"page id {page} outside 1 .. {self.num_pages}")
        return self.rc[<Py_ssize_t>page]

    @property
    def refcounts(self):
        """Read-only view of every page's reference count, indexed by page id (0 = null)."""
        return self.rc_view

    def try_allocate(self, count):
        """Take ``count`` free pages (reference count 1 each), or ``None`` if too few are free."""
        if not isinstance(count, (int, np.integer)):
            raise InvalidInput(f"page count must be an int, got {count!r}")
        if count < 0:
            raise InvalidInput(f"cannot allocate a negative number of pages ({count})")
        if count > self.top:
            return None
        out = np.empty(count, dtype=np.int32)
        self.take(count, out, 0)
        return out

    def allocate(self, count):
        """Take ``count`` free pages; raise :class:`PoolExhausted` if too few are free."""
        pages = self.try_allocate(count)
        if pages is None:
            raise PoolExhausted(
                f"block pool has {self.top} free pages of {self.num_pages}, {count} requested; "
                "finish or preempt a request, or size the pool larger"
            )
        return pages

    def incref(self, pages):
        """Add one reference to each (already used) page in ``pages`` (no repeats)."""
        ids = as_ids(pages, "incref")
        self.check_ids(ids, "incref", UNCACHED)
        self.add(ids.astype(np.int32), False)

    def decref(self, pages):
        """Drop one reference (the caller's) from each page; return the pages that became
        free. Freed pages go back on the free stack so that the next allocation returns them
        in the order they appear in ``pages``."""
        ids = as_ids(pages, "decref")
        self.check_ids(ids, "decref", HELD | UNCACHED)
        cdef Py_ssize_t n = self.drop(ids.astype(np.int32), False)
        return np.asarray(self.freed)[:n].copy()

    def free_unshared(self, pages):
        """Drop the only reference of each page in ``pages`` (each held once, by the caller
        alone). Same free-stack order as :meth:`decref`."""
        ids = as_ids(pages, "free_unshared")
        self.check_ids(ids, "free_unshared", HELD | UNCACHED)
        cdef const int64_t[::1] v = ids
        cdef Py_ssize_t i
        for i in range(v.shape[0]):
            if self.rc[v[i]] != 1:
                raise InvalidInput("free_unshared: pages held more than once")
        self.drop(ids.astype(np.int32), False)

    def _snapshot(self):
        """Copies of the pool's state (for tests): counts, owned counts, the free stack."""
        return {
            "refcounts": np.asarray(self.rc).copy(),
            "owned": np.asarray(self.owned).copy(),
            "cached": np.asarray(self.cached).copy(),
            "free_stack": np.asarray(self.stack)[: self.top].copy(),
        }

    # -- the C-level interface (the prefix store and the scheduler) -------------------------

    cdef int take(self, Py_ssize_t count, int32_t[:] out, int32_t owned) except -1:
        """Pop ``count`` free pages into ``out`` (top of the stack first), each with one
        reference, ``owned`` of it by a native holder."""
        if count < 0 or count > self.top:
            raise SchedulerError(f"internal: cannot take {count} pages, {self.top} are free")
        cdef Py_ssize_t i
        cdef int32_t page
        for i in range(count):
            page = self.stack[self.top - 1 - i]
            self.rc[page] = 1
            self.owned[page] = owned
            out[i] = page
        self.top -= count
        return 0

    cdef int push_free(self, int32_t[:] pages) except -1:
        """Put freed ``pages`` on the stack so that they come out again in this order."""
        cdef Py_ssize_t i, n = pages.shape[0]
        if self.top + n > self.num_pages:
            raise SchedulerError(f"internal: free stack overflow, {self.top} + {n} pages")
        for i in range(n):
            self.stack[self.top + i] = pages[n - 1 - i]
        self.top += n
        return 0

    cdef int add(self, int32_t[:] pages, bint owned) except -1:
        """One more reference on each of ``pages`` (in use; may repeat), ``owned`` by a
        native holder."""
        cdef Py_ssize_t i, n = pages.shape[0]
        for i in range(n):
            if self.rc[pages[i]] <= 0:
                raise SchedulerError(f"internal: page {pages[i]} is free, cannot add a reference")
        for i in range(n):
            self.rc[pages[i]] += 1
            if owned:
                self.owned[pages[i]] += 1
        return 0

    cdef Py_ssize_t drop(self, int32_t[:] pages, bint owned) except -1:
        """Drop one reference from each of ``pages`` (distinct), ``owned`` by a native holder;
        the pages left with none go on the free stack (next allocated in this order) and into
        ``self.freed[:n]``; returns ``n``."""
        cdef Py_ssize_t i, n = 0, count = pages.shape[0]
        self.mark_gen += 1
        for i in range(count):
            if self.rc[pages[i]] <= 0 or (owned and self.owned[pages[i]] <= 0):
                raise SchedulerError(f"internal: page {pages[i]} has no such reference to drop")
            if self.mark[pages[i]] == self.mark_gen:
                raise SchedulerError(f"internal: page {pages[i]} repeats in one drop")
            self.mark[pages[i]] = self.mark_gen
        for i in range(count):
            self.rc[pages[i]] -= 1
            if owned:
                self.owned[pages[i]] -= 1
            if self.rc[pages[i]] == 0:
                self.freed[n] = pages[i]
                self.frees[pages[i]] += 1
                n += 1
        self.push_free(self.freed[:n])
        return n

    cdef int check_ids(self, const int64_t[::1] ids, str what, int mode) except -1:
        """Refuse ids out of range, free, repeated; with ``UNCACHED`` prefix-store entries;
        with ``HELD`` pages the caller holds no reference of its own on."""
        cdef Py_ssize_t i, n = ids.shape[0]
        cdef int64_t page
        for i in range(n):
            if ids[i] < 1 or ids[i] > self.num_pages:
                raise InvalidInput(
                    f"{what}: page ids must lie in 1 .. {self.num_pages}, got {np.asarray(ids)}"
                )
        for i in range(n):
            if self.rc[ids[i]] <= 0:
                bad = [p for p in np.asarray(ids).tolist() if self.rc[p] <= 0]
                raise InvalidInput(f"{what}: pages {bad} are free (no reference to move)")
        self.mark_gen += 1
        for i in range(n):
            page = ids[i]
            if self.mark[page] == self.mark_gen:
                raise InvalidInput(f"{what}: page ids repeat in {np.asarray(ids).tolist()}")
            self.mark[page] = self.mark_gen
        if mode & UNCACHED:
            for i in range(n):
                if self.cached[ids[i]]:
                    bad = [p for p in np.asarray(ids).tolist() if self.cached[p]]
                    raise InvalidInput(
                        f"{what}: pages {bad} are prefix-store entries; move their references "
                        "through PrefixKvStore.acquire / release"
                    )
        if mode & HELD:
            for i in range(n):
                if self.rc[ids[i]] - self.owned[ids[i]] < 1:
                    bad = [p for p in np.asarray(ids).tolist() if self.rc[p] <= self.owned[p]]
                    raise InvalidInput(
                        f"{what}: pages {bad} carry no reference of the caller's, only the "
                        "prefix store's or a scheduler's (released twice?)"
                    )
        return 0
