# A request's life in the slots, cimported by the scheduler's decode rounds (_rounds.pyx).
from libc.stdint cimport int32_t

from tspd_core.sched._slots cimport Slots


cdef class Lifecycle(Slots):
    cdef object _admit(self, request_id, prompt_len, page_keys, bint remote, Py_ssize_t headroom)
    cdef object check_prompt(self, request_id, prompt_len, page_keys)
    cdef int check_new(self, request_id) except -1
    cdef object row(self, Py_ssize_t slot, Py_ssize_t count)
    cdef int complete_prompt(self, Py_ssize_t slot) except -1
    cdef object reserve(self, Py_ssize_t slot, Py_ssize_t start, Py_ssize_t end)
    cdef object copy_on_write(self, Py_ssize_t slot, Py_ssize_t logical_page, int32_t dst)
