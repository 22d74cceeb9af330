# cython: language_level=3, boundscheck=True, wraparound=False, initializedcheck=True
"""The scheduler's slot table: per-slot columns and page tables, the free-slot heap, the page
supply (the pool plus the store as one source), and what callers can inspect. The request
lifecycle that changes them is ``_lifecycle.pyx``; decode rounds are ``_rounds.pyx``.

Slot ``s`` of every column describes the request in that slot; a free slot has state ``FREE``
and an all-zero page-table row. The page table of every slot is allocated once, at
construction (``capacity x logical_pages`` int32; page id 0 marks an unused entry); callers
read rows of it through read-only views. Every page reference the scheduler holds is one the
pool counts as owned by a native holder, so no caller can drop it.
"""

cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t

import numpy as np

from tspd_core.sched._build import check_built_from
from tspd_core.sched.errors import InvalidInput, UnknownRequest, WrongState
from tspd_core.sched.request import RequestState, RequestView, SchedulerStats

from tspd_core.sched._pool cimport BlockPool, Memory, new_memory, read_only
from tspd_core.sched._prefix cimport PrefixKvStore

cdef extern from *:
    """
    #ifndef TSPD_SOURCE_SHA256
    #define TSPD_SOURCE_SHA256 ""
    #endif
    """
    const char *TSPD_SOURCE_SHA256

check_built_from(__file__, "_slots", TSPD_SOURCE_SHA256.decode("ascii"))


cdef tuple STATES = tuple(RequestState)  # by value: STATES[s] is RequestState(s)
cdef int64_t TOKEN_MAX = 2147483647
cdef tuple INTS = (int, np.integer)


@cython.auto_pickle(False)
cdef class Slots:
    """The slot-table part of :class:`~tspd_core.sched.RequestScheduler` (same object)."""

    def __cinit__(self, capacity, logical_pages, *, page_size, pool, prefixes=None):
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidInput(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(capacity, int) or not 1 <= capacity <= 1 << 20:
            raise InvalidInput(f"capacity must be an int in 1 .. 2**20, got {capacity!r}")
        if not isinstance(logical_pages, int) or not 1 <= logical_pages <= 1 << 24:
            raise InvalidInput(f"logical_pages must be an int in 1 .. 2**24, got {logical_pages!r}")
        if not isinstance(pool, BlockPool):
            raise InvalidInput(f"pool must be a BlockPool, got {pool!r}")
        if prefixes is not None and (
            not isinstance(prefixes, PrefixKvStore) or (<PrefixKvStore>prefixes).pool is not pool
        ):
            raise InvalidInput("the prefix store must be built on the scheduler's block pool")
        if logical_pages * page_size > TOKEN_MAX:
            raise InvalidInput("logical_pages x page_size must stay below 2**31 tokens")
        self.capacity, self.logical_pages, self.page_size = capacity, logical_pages, page_size
        self.max_context = logical_pages * page_size
        self.pool, self.prefixes = pool, prefixes
        self.states = new_memory("b", capacity)
        self.serial = new_memory("q", capacity)
        self.admission = new_memory("q", capacity)
        self.prompt_len = new_memory("i", capacity)
        self.prefix_tokens = new_memory("i", capacity)
        self.kv_len = new_memory("i", capacity)
        self.pending = new_memory("i", capacity)
        self.num_pages_of = new_memory("i", capacity)
        self.token = new_memory("i", capacity)
        self.has_token = new_memory("B", capacity)
        self.last_row = new_memory("i", capacity)
        cdef Memory tables = new_memory("i", capacity, logical_pages)
        self.tables = tables
        self.tables_view = read_only(tables)
        self.rids = [None] * capacity
        self.keys = [None] * capacity
        self.index = {}
        self.heap = new_memory("i", capacity)
        cdef Py_ssize_t i
        for i in range(capacity):  # ascending: already a min-heap
            self.heap[i] = <int32_t>i
        self.heap_size = capacity
        self.buf = new_memory("i", logical_pages + 1)
        self.one = new_memory("i", 1)

    # -- sizes and occupancy ----------------------------------------------------------------

    def active_count(self):
        """Requests holding a slot (O(1))."""
        return len(self.index)

    def free_count(self):
        """Free pages in the pool (O(1))."""
        return self.pool.top

    def reclaimable_count(self):
        """Pages an allocation can obtain: free plus evictable prefix pages (O(1))."""
        return self.reclaimable()

    def __contains__(self, request_id):
        return request_id in self.index

    # -- inspection -----------------------------------------------------------------------------

    def state(self, request_id):
        return STATES[self.states[self.lookup(request_id)]]

    def page_table(self, request_id):
        """Read-only int32 view of the request's page table (valid until it next changes)."""
        cdef Py_ssize_t slot = self.lookup(request_id)
        return self.tables_view[slot, : self.num_pages_of[slot]]

    def num_pages(self, request_id):
        return self.num_pages_of[self.lookup(request_id)]

    def slot_of(self, request_id):
        return self.lookup(request_id)

    def request_id_at(self, slot):
        """The request in ``slot``, or None for a free slot."""
        if not isinstance(slot, INTS) or not 0 <= slot < self.capacity:
            raise InvalidInput(f"slot {slot!r} outside 0 .. {self.capacity - 1}")
        return self.rids[slot]

    def view(self, request_id):
        cdef Py_ssize_t slot = self.lookup(request_id)
        token = self.token[slot] if self.has_token[slot] and not self.pending[slot] else None
        return RequestView(
            request_id, slot, self.serial[slot], STATES[self.states[slot]],
            self.prompt_len[slot], self.prefix_tokens[slot], self.kv_len[slot],
            self.pending[slot], self.num_pages_of[slot], token,
        )  # fmt: skip

    def runnable_into(self, out):
        """Write the slots of all runnable requests (PREFILL or DECODE) into ``out`` in slot
        order; return how many. ``out`` must hold ``capacity`` entries at worst."""
        cdef Py_ssize_t s, n = 0
        for s in range(self.capacity):
            n += self.states[s] == PREFILL or self.states[s] == DECODE
        if len(out) < n:
            raise InvalidInput(f"runnable_into: {n} runnable, out holds {len(out)}")
        runnable = np.flatnonzero(
            (np.asarray(self.states) == PREFILL) | (np.asarray(self.states) == DECODE)
        )
        out[:n] = runnable
        return n

    def stats(self):
        store = self.prefixes
        return SchedulerStats(
            len(self.index), self.pool.top, 0 if store is None else len(store),
            0 if store is None else store.evictable_count(), self.admissions,
            self.prompt_tokens, self.hit_tokens, self.cow_copies, self.rounds_committed,
            0 if store is None else store.evicted_total,
        )  # fmt: skip

    def _snapshot(self):
        """Copies of all the scheduler's state, pool's and store's included (for tests)."""
        columns = {
            "state": self.states, "serial": self.serial, "admission": self.admission,
            "prompt_len": self.prompt_len, "prefix_tokens": self.prefix_tokens,
            "kv_len": self.kv_len, "pending": self.pending, "num_pages": self.num_pages_of,
            "token": self.token, "has_token": self.has_token, "last_row": self.last_row,
            "tables": self.tables,
        }  # fmt: skip
        snap = {name: np.asarray(column).copy() for name, column in columns.items()}
        snap.update(
            rids=list(self.rids), index=dict(self.index),
            free_slots=sorted(np.asarray(self.heap)[: self.heap_size].tolist()),
            counters=(self.serials, self.admissions, self.prompt_tokens, self.hit_tokens,
                      self.cow_copies, self.rounds_committed),
            pool=self.pool._snapshot(),
            store=None if self.prefixes is None else self.prefixes._snapshot(),
        )  # fmt: skip
        return snap

    # -- slots ----------------------------------------------------------------------------------

    cdef Py_ssize_t lookup(self, object request_id) except -1:
        """The slot of an active request; :class:`UnknownRequest` otherwise."""
        slot = self.index.get(request_id)
        if slot is None:
            raise UnknownRequest(
                f"request {request_id!r} is not active (never admitted or already finished)"
            )
        return slot

    cdef Py_ssize_t in_state(self, object request_id, str what, int a, int b) except -1:
        cdef Py_ssize_t slot = self.lookup(request_id)
        cdef int state = self.states[slot]
        if state != a and state != b:
            names = " or ".join(dict.fromkeys([STATES[a].name, STATES[b].name]))
            raise WrongState(f"{what}: request {request_id!r} is {STATES[state].name}, needs {names}")
        return slot

    cdef Py_ssize_t take(self, request_id) except -1:
        """Claim the lowest free slot for ``request_id`` with a fresh serial (after check_new)."""
        cdef Py_ssize_t slot = self.heap[0]
        self.heap_size -= 1
        self.heap_sift_down(self.heap[self.heap_size])
        self.serials += 1
        self.serial[slot] = self.admission[slot] = self.serials
        self.rids[slot] = request_id
        self.index[request_id] = slot
        return slot

    cdef void new_serial(self, Py_ssize_t slot):
        """A fresh serial, so outputs of steps launched before no longer match."""
        self.serials += 1
        self.serial[slot] = self.serials

    cdef int clear(self, Py_ssize_t slot) except -1:
        """Return the slot to the free heap (its pages already released)."""
        del self.index[self.rids[slot]]
        self.rids[slot] = None
        self.keys[slot] = None
        cdef Py_ssize_t i
        for i in range(self.num_pages_of[slot]):
            self.tables[slot, i] = 0
        # Serials start at 1: steps launched before never match again. last_row is left.
        self.prompt_len[slot] = self.prefix_tokens[slot] = self.kv_len[slot] = 0
        self.pending[slot] = self.num_pages_of[slot] = self.token[slot] = 0
        self.serial[slot] = self.admission[slot] = 0
        self.has_token[slot] = 0
        self.states[slot] = FREE
        self.heap_push(<int32_t>slot)
        return 0

    cdef void heap_push(self, int32_t slot):
        cdef Py_ssize_t i = self.heap_size, parent
        self.heap_size += 1
        while i:
            parent = (i - 1) >> 1
            if self.heap[parent] <= slot:
                break
            self.heap[i] = self.heap[parent]
            i = parent
        self.heap[i] = slot

    cdef void heap_sift_down(self, int32_t slot):
        # Put ``slot`` (the last entry, already cut off) at the root and sift it down.
        cdef Py_ssize_t i = 0, child, n = self.heap_size
        if not n:
            return
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and self.heap[child + 1] < self.heap[child]:
                child += 1
            if self.heap[child] >= slot:
                break
            self.heap[i] = self.heap[child]
            i = child
        self.heap[i] = slot

    # -- pages: the pool plus the store, one source ------------------------------------------

    cdef Py_ssize_t pages_for(self, Py_ssize_t tokens):
        return -(-tokens // self.page_size)

    cdef Py_ssize_t reclaimable(self):
        return self.pool.top + (0 if self.prefixes is None else self.prefixes.evictable)

    cdef bint alloc(self, Py_ssize_t count, int32_t[:] out) except -1:
        """``count`` fresh pages into ``out`` (evicting prefix entries if the pool is short),
        or False with nothing changed."""
        cdef Py_ssize_t short = count - self.pool.top
        if short > 0:
            if self.prefixes is None or self.prefixes.evictable < short:
                return False
            self.prefixes.evict_pages(short)
        self.pool.take(count, out, 1)
        return True

    cdef int acquire(self, int32_t[:] pages) except -1:
        """One more reference (the scheduler's) on pages in use; may repeat."""
        if self.prefixes is not None:
            self.prefixes.acquire_pages(pages, True)
        else:
            self.pool.add(pages, True)
        return 0

    cdef int release(self, int32_t[:] pages) except -1:
        """Give back the scheduler's reference on each page (distinct, page-table order)."""
        if self.prefixes is not None:
            self.prefixes.release_pages(pages, True)
        else:
            self.pool.drop(pages, True)
        return 0
