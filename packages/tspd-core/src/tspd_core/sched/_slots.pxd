# The scheduler's slot table, cimported by its lifecycle (_lifecycle.pyx) and rounds.
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t

from tspd_core.sched._pool cimport BlockPool
from tspd_core.sched._prefix cimport PrefixKvStore


cdef enum:  # RequestState's values
    FREE = 0
    AWAITING_KV = 1
    PREFILL = 2
    PREFILLED = 3
    DECODE = 4


cdef class Slots:
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t logical_pages
    cdef readonly Py_ssize_t page_size
    cdef readonly Py_ssize_t max_context
    cdef readonly BlockPool pool
    cdef readonly PrefixKvStore prefixes
    cdef object __weakref__
    # Per-slot columns (slot s describes the request in slot s; a free slot is all zero).
    cdef int8_t[::1] states
    cdef int64_t[::1] serial
    cdef int64_t[::1] admission
    cdef int32_t[::1] prompt_len
    cdef int32_t[::1] prefix_tokens
    cdef int32_t[::1] kv_len
    cdef int32_t[::1] pending
    cdef int32_t[::1] num_pages_of
    cdef int32_t[::1] token
    cdef uint8_t[::1] has_token
    cdef int32_t[::1] last_row
    cdef int32_t[:, ::1] tables
    cdef object tables_view
    cdef list rids
    cdef list keys
    cdef dict index
    # Free slots: a binary min-heap (the lowest free slot goes first).
    cdef int32_t[::1] heap
    cdef Py_ssize_t heap_size
    cdef int64_t serials
    cdef int64_t admissions
    cdef int64_t prompt_tokens
    cdef int64_t hit_tokens
    cdef int64_t cow_copies
    cdef int64_t rounds_committed
    cdef int32_t[::1] buf
    cdef int32_t[::1] one

    cdef Py_ssize_t pages_for(self, Py_ssize_t tokens)
    cdef Py_ssize_t lookup(self, object request_id) except -1
    cdef Py_ssize_t in_state(self, object request_id, str what, int a, int b) except -1
    cdef Py_ssize_t reclaimable(self)
    cdef bint alloc(self, Py_ssize_t count, int32_t[:] out) except -1
    cdef int acquire(self, int32_t[:] pages) except -1
    cdef int release(self, int32_t[:] pages) except -1
    cdef Py_ssize_t take(self, request_id) except -1
    cdef void new_serial(self, Py_ssize_t slot)
    cdef int clear(self, Py_ssize_t slot) except -1
    cdef void heap_push(self, int32_t slot)
    cdef void heap_sift_down(self, int32_t slot)
