# The prefix store's C-level interface, cimported by the scheduler.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

from tspd_core.sched._pool cimport BlockPool


cdef class PrefixKvStore:
    cdef readonly BlockPool pool
    cdef readonly Py_ssize_t max_entries
    cdef readonly int64_t evicted_total
    cdef Py_ssize_t n_entries
    cdef Py_ssize_t evictable
    # The key -> page map: open addressing, linear probing, page 0 = an empty slot. It holds
    # at most one entry per page, in a table of at least twice the pool's pages.
    cdef uint64_t[::1] map_keys
    cdef int32_t[::1] map_pages
    cdef uint64_t map_mask
    cdef int map_shift
    cdef uint64_t[::1] key_of
    # Evictable pages, oldest first: a doubly linked list through the page ids, 0 the sentinel.
    cdef int32_t[::1] lru_prev
    cdef int32_t[::1] lru_next
    cdef uint8_t[::1] in_lru
    cdef int32_t[::1] picks
    cdef int32_t[::1] victims
    cdef int32_t[::1] lone

    cdef Py_ssize_t home(self, uint64_t key)
    cdef int32_t lookup(self, uint64_t key)
    cdef void map_put(self, uint64_t key, int32_t page)
    cdef void map_delete(self, uint64_t key)
    cdef void lru_append(self, int32_t page)
    cdef void lru_unlink(self, int32_t page)
    cdef Py_ssize_t match_into(self, const uint64_t[:] keys, Py_ssize_t limit, int32_t[:] out) except -1
    cdef Py_ssize_t count_evictable(self, int32_t[:] pages)
    cdef int acquire_pages(self, int32_t[:] pages, bint owned) except -1
    cdef Py_ssize_t release_pages(self, int32_t[:] pages, bint owned) except -1
    cdef Py_ssize_t evict_pages(self, Py_ssize_t count) except -1
    cdef Py_ssize_t insert_pages(self, const uint64_t[:] keys, int32_t[:] pages) except -1
