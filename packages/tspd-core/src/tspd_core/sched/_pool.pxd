# The block pool's C-level interface, cimported by the prefix store and the scheduler.
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t


cdef class Memory:
    cdef char *data
    cdef Py_ssize_t shape[2]
    cdef Py_ssize_t strides[2]
    cdef int ndim
    cdef Py_ssize_t itemsize
    cdef char *fmt
    cdef bint sealed


# check_ids modes: the caller must hold a reference of its own; prefix-store entries refused.
cdef enum:
    HELD = 1
    UNCACHED = 2


cdef Memory new_memory(str fmt, Py_ssize_t rows, Py_ssize_t cols=*)
cdef object read_only(Memory memory)
cdef object as_ids(object pages, str what)


cdef class BlockPool:
    cdef readonly Py_ssize_t num_pages
    cdef Py_ssize_t top
    # References per page (0 = free), and how many of them native holders own: the prefix
    # store's entry and scheduler page tables. ``rc - owned`` is what outside callers hold.
    cdef int32_t[::1] rc
    cdef int32_t[::1] owned
    # Set by the pool's prefix store: the page is an entry (its last reference is the store's).
    cdef uint8_t[::1] cached
    cdef int32_t[::1] stack
    cdef int64_t[::1] mark
    cdef int32_t[::1] freed
    # How many times each page was freed: tells a page freed (and maybe reused) since.
    cdef int64_t[::1] frees
    cdef int64_t mark_gen
    cdef bint has_store
    cdef object rc_view

    cdef int take(self, Py_ssize_t count, int32_t[:] out, int32_t owned) except -1
    cdef int push_free(self, int32_t[:] pages) except -1
    cdef int add(self, int32_t[:] pages, bint owned) except -1
    cdef Py_ssize_t drop(self, int32_t[:] pages, bint owned) except -1
    cdef int check_ids(self, const int64_t[::1] ids, str what, int mode) except -1
