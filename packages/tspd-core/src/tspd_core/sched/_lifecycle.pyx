# cython: language_level=3, boundscheck=True, wraparound=False, initializedcheck=True
"""A request's life in the scheduler's slots: admission, prompt completion, copy-on-write,
fork, finish (the slot table: ``_slots.pyx``; decode rounds: ``_rounds.pyx``, a subclass).

Every public method checks everything that can fail before it changes anything: it completes
or raises with the state as it was (an allocation may evict unreferenced prefix entries only
once it is sure to succeed).
"""

cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t

import numpy as np

from tspd_core.sched._build import check_built_from
from tspd_core.sched.errors import (
    CapacityFull,
    ContextFull,
    DuplicateRequest,
    InvalidInput,
    PoolExhausted,
    WrongState,
)
from tspd_core.sched.keys import as_keys
from tspd_core.sched.request import Admission, CopyOnWrite, RequestState

from tspd_core.sched._prefix cimport PrefixKvStore
from tspd_core.sched._slots cimport (
    AWAITING_KV,
    DECODE,
    PREFILL,
    PREFILLED,
    Slots,
)

cdef extern from *:
    """
    #ifndef TSPD_SOURCE_SHA256
    #define TSPD_SOURCE_SHA256 ""
    #endif
    """
    const char *TSPD_SOURCE_SHA256

check_built_from(__file__, "_lifecycle", TSPD_SOURCE_SHA256.decode("ascii"))


cdef tuple STATES = tuple(RequestState)  # by value: STATES[s] is RequestState(s)
cdef object NO_KEYS = np.zeros(0, dtype=np.uint64)
NO_KEYS.flags.writeable = False
cdef int64_t TOKEN_MAX = 2147483647
cdef tuple INTS = (int, np.integer)
#: An admission hands its pages out as a list up to this many (cheaper than an array there;
#: ``Admission.pages`` makes it one on first read), as an int32 array beyond.
cdef Py_ssize_t LIST_PAGES = 64


@cython.auto_pickle(False)
cdef class Lifecycle(Slots):
    """The lifecycle part of :class:`~tspd_core.sched.RequestScheduler` (same object)."""

    # -- admission ----------------------------------------------------------------------------

    def admit(self, request_id, prompt_len, page_keys=None, *, remote_kv=False):
        """Admit a request, attach its prefix hit, allocate all its prompt pages at once.

        ``page_keys`` are the chained keys of the prompt's full pages (``page_keys`` or
        ``page_keys_from_block_hashes``), at most ``prompt_len // page_size`` of them; the
        scheduler keeps the array until the prompt completes (do not change it meanwhile).
        With ``remote_kv`` the request waits for its prompt KV from a peer (PD decode side)
        instead of prefilling. Raises DuplicateRequest, CapacityFull, PoolExhausted,
        InvalidInput.
        """
        admission = self._admit(request_id, prompt_len, page_keys, remote_kv, 0)
        if admission is None:
            raise PoolExhausted(
                f"cannot admit {request_id!r}: {self.pages_for(prompt_len)} prompt pages minus "
                f"its prefix hit exceed the {self.reclaimable()} free or evictable pages; "
                "finish a request or retry later"
            )
        return admission

    def try_admit(
        self, request_id, prompt_len, page_keys=None, *, remote_kv=False, headroom=0
    ):
        """Like :meth:`admit`, but an expected shortage (no free slot, too few pages) returns
        None with nothing changed. Bad input and duplicates still raise.

        ``headroom`` (a watermark) also counts as a shortage fewer than that many pages left
        free or evictable after the admission, e.g. pages the caller holds back for outputs."""
        if not isinstance(headroom, int) or headroom < 0:
            raise InvalidInput(f"headroom must be an int >= 0, got {headroom!r}")
        if not self.heap_size and request_id not in self.index:
            self.check_prompt(request_id, prompt_len, page_keys)
            return None
        # (beyond any pool, a headroom is a shortage like any other, not an overflow)
        return self._admit(request_id, prompt_len, page_keys, remote_kv, min(headroom, 1 << 62))

    cdef object _admit(self, request_id, prompt_len, page_keys, bint remote, Py_ssize_t headroom):
        keys = self.check_prompt(request_id, prompt_len, page_keys)
        self.check_new(request_id)
        cdef const uint64_t[:] wanted = keys
        cdef Py_ssize_t length = prompt_len, need = self.pages_for(length), hit = 0
        cdef Py_ssize_t limit = (length - 1) // self.page_size
        cdef PrefixKvStore store = self.prefixes
        if store is not None and limit > 0 and wanted.shape[0]:
            hit = store.match_into(wanted, limit, self.buf)
        # The hits stop being evictable once held: the supply after taking them must cover
        # the fresh pages plus the headroom.
        cdef Py_ssize_t spare = self.reclaimable()
        if hit:
            spare -= store.count_evictable(self.buf[:hit])
        if need - hit + headroom > spare:
            return None
        if hit:
            store.acquire_pages(self.buf[:hit], True)
        self.alloc(need - hit, self.buf[hit:need])
        cdef Py_ssize_t slot = self.take(request_id), i
        for i in range(need):
            self.tables[slot, i] = self.buf[i]
        self.num_pages_of[slot] = <int32_t>need
        self.prompt_len[slot] = <int32_t>length
        self.prefix_tokens[slot] = self.kv_len[slot] = <int32_t>(hit * self.page_size)
        self.keys[slot] = keys if wanted.shape[0] else None
        self.states[slot] = AWAITING_KV if remote else PREFILL
        self.admissions += 1
        self.prompt_tokens += length
        self.hit_tokens += hit * self.page_size
        return Admission(
            request_id, slot, self.serial[slot], STATES[self.states[slot]], length,
            hit * self.page_size, self.row(slot, need), hit,
        )  # fmt: skip

    cdef object check_prompt(self, request_id, prompt_len, page_keys):
        if not isinstance(prompt_len, INTS) or not 1 <= prompt_len <= self.max_context:
            raise InvalidInput(
                f"request {request_id!r}: prompt_len must be in 1 .. {self.max_context} "
                f"(logical_pages x page_size), got {prompt_len!r}"
            )
        keys = NO_KEYS if page_keys is None else as_keys(page_keys)
        if len(keys) > prompt_len // self.page_size:
            raise InvalidInput(
                f"request {request_id!r}: {len(keys)} page keys for a {prompt_len}-token prompt "
                f"with {prompt_len // self.page_size} full pages; pass keys of full pages only"
            )
        return keys

    cdef int check_new(self, request_id) except -1:
        """Raise if ``request_id`` is active or no slot is free (checks only)."""
        if request_id in self.index:
            raise DuplicateRequest(
                f"request {request_id!r} is already active in slot {self.index[request_id]}; "
                "finish it first or use a fresh id"
            )
        if not self.heap_size:
            raise CapacityFull(
                f"all {self.capacity} request slots are taken; finish a request before "
                f"admitting {request_id!r}"
            )
        return 0

    cdef object row(self, Py_ssize_t slot, Py_ssize_t count):
        # A copy of the slot's first ``count`` table entries: a list when short (see LIST_PAGES).
        if count <= LIST_PAGES:
            return [self.tables[slot, i] for i in range(count)]
        return self.tables_view[slot, :count].copy()

    # -- lifecycle ------------------------------------------------------------------------------

    def advance_prefill(self, request_id, num_tokens):
        """Record ``num_tokens`` more prompt tokens prefilled (chunked prefill); return the
        prefilled total. Their pages were allocated at admission."""
        cdef Py_ssize_t slot = self.in_state(request_id, "advance_prefill", PREFILL, PREFILL)
        cdef int64_t done = self.kv_len[slot], left = self.prompt_len[slot] - done
        if not isinstance(num_tokens, int) or not 1 <= num_tokens <= left:
            raise InvalidInput(
                f"request {request_id!r}: advance_prefill by {num_tokens!r}; {left} of its "
                "prompt tokens are left to prefill"
            )
        self.kv_len[slot] = <int32_t>(done + num_tokens)
        return done + num_tokens

    def mark_prefill_complete(self, request_id):
        """All prompt KV is written: offer the full prompt pages to the prefix store and wait
        for the first decode token (or, on a PD prefill peer, hold the pages until finish)."""
        self.complete_prompt(self.in_state(request_id, "mark_prefill_complete", PREFILL, PREFILL))

    def seed_decode_token(self, request_id, token):
        """Publish the token the next decode step consumes (the first token sampled after
        prefill, or the first token that arrived with the KV on a PD decode peer) and make
        the request runnable. From AWAITING_KV this also completes the prompt."""
        cdef Py_ssize_t slot = self.in_state(
            request_id, "seed_decode_token", PREFILLED, AWAITING_KV
        )
        if not isinstance(token, INTS) or not 0 <= token <= TOKEN_MAX:
            raise InvalidInput(f"request {request_id!r}: token must be an int in 0 .. 2**31-1")
        if self.states[slot] == AWAITING_KV:
            self.complete_prompt(slot)
        self.token[slot] = <int32_t>token
        self.has_token[slot] = 1
        self.states[slot] = DECODE

    cdef int complete_prompt(self, Py_ssize_t slot) except -1:
        self.kv_len[slot] = self.prompt_len[slot]
        keys = self.keys[slot]
        cdef const uint64_t[:] wanted
        if keys is not None and self.prefixes is not None:
            wanted = keys
            self.prefixes.insert_pages(wanted, self.tables[slot, : wanted.shape[0]])
        self.keys[slot] = None
        self.states[slot] = PREFILLED
        return 0

    def record_token(self, request_id, token):
        """One decode step done outside a round: same as ``record_tokens(id, [token])``."""
        return self.record_tokens(request_id, np.array([token]))

    def record_tokens(self, request_id, tokens):
        """Advance a decode request by several tokens at once (bulk path for the simulator).

        ``tokens`` is either a count (token ids unknown here: the next input stays off the
        host) or the token ids (the last one becomes the next input). Pages for the new
        positions are allocated; if the first written page is shared it is copied on write and
        the copy returned. Raises WrongState with steps in flight, ContextFull, PoolExhausted.
        """
        cdef Py_ssize_t slot = self.in_state(request_id, "record_tokens", DECODE, DECODE)
        count, last = count_tokens(request_id, tokens)
        if self.pending[slot]:
            raise WrongState(
                f"request {request_id!r} has {self.pending[slot]} decode steps in flight; "
                "commit or discard them before recording tokens directly"
            )
        cdef int64_t start = self.kv_len[slot]
        if start + count > self.max_context:
            raise ContextFull(
                f"request {request_id!r}: {start} + {count} tokens exceed the max context of "
                f"{self.max_context}; finish it"
            )
        copy = self.reserve(slot, start, start + count)
        self.kv_len[slot] = <int32_t>(start + count)
        if count:
            self.has_token[slot] = last is not None
            self.token[slot] = 0 if last is None else last
        return copy

    cdef object reserve(self, Py_ssize_t slot, Py_ssize_t start, Py_ssize_t end):
        # Pages for positions [start, end): new tail pages plus a copy of a shared first page.
        cdef Py_ssize_t have = self.num_pages_of[slot], i
        cdef Py_ssize_t grow = max(0, self.pages_for(end) - have)
        cdef Py_ssize_t first = start // self.page_size
        cdef bint shared = (
            end > start and first < have and self.pool.rc[self.tables[slot, first]] > 1
        )
        if not self.alloc(grow + shared, self.buf[: grow + shared]):
            raise PoolExhausted(
                f"request {self.rids[slot]!r} needs {grow + shared} pages, "
                f"{self.reclaimable()} free or evictable; finish or preempt a request"
            )
        for i in range(grow):
            self.tables[slot, have + i] = self.buf[i]
        self.num_pages_of[slot] = <int32_t>(have + grow)
        if not shared:
            return None
        return self.copy_on_write(slot, first, self.buf[grow])

    cdef object copy_on_write(self, Py_ssize_t slot, Py_ssize_t logical_page, int32_t dst):
        cdef int32_t src = self.tables[slot, logical_page]
        self.tables[slot, logical_page] = dst
        self.one[0] = src
        self.release(self.one)
        self.cow_copies += 1
        return CopyOnWrite(logical_page, src, dst)

    def ensure_writable(self, request_id, logical_page):
        """Make ``logical_page`` private before writing it: None if it already is, else the
        copy the backend must perform (src -> dst) before writing (copy-on-write)."""
        cdef Py_ssize_t slot = self.lookup(request_id)
        cdef Py_ssize_t have = self.num_pages_of[slot]
        if not isinstance(logical_page, int) or not 0 <= logical_page < have:
            raise InvalidInput(
                f"request {request_id!r}: logical page {logical_page!r} outside its {have} pages"
            )
        if self.pool.rc[self.tables[slot, logical_page]] <= 1:
            return None
        if not self.alloc(1, self.buf[:1]):
            raise PoolExhausted(
                f"copy-on-write for {request_id!r} needs a page and none is free or evictable"
            )
        return self.copy_on_write(slot, logical_page, self.buf[0])

    def fork(self, parent_id, child_id):
        """Start ``child_id`` sharing every page of ``parent_id`` (parallel sampling): the
        first write of either into a shared page is copied on write. The parent must be
        PREFILLED or DECODE with no step in flight; the child starts in the same state."""
        cdef Py_ssize_t slot = self.in_state(parent_id, "fork", PREFILLED, DECODE)
        if self.pending[slot]:
            raise WrongState(f"request {parent_id!r} has decode steps in flight; fork after commit")
        self.check_new(child_id)
        cdef Py_ssize_t count = self.num_pages_of[slot], i
        self.pool.add(self.tables[slot, :count], True)  # held by the parent: never evictable
        cdef Py_ssize_t child = self.take(child_id)
        for i in range(count):
            self.tables[child, i] = self.tables[slot, i]
        self.num_pages_of[child] = self.num_pages_of[slot]
        self.prompt_len[child] = self.prompt_len[slot]
        self.prefix_tokens[child] = self.prefix_tokens[slot]
        self.kv_len[child] = self.kv_len[slot]
        self.token[child] = self.token[slot]
        self.has_token[child] = self.has_token[slot]
        self.states[child] = self.states[slot]
        return Admission(
            child_id, child, self.serial[child], STATES[self.states[child]],
            self.prompt_len[child], self.prefix_tokens[child],
            self.tables_view[child, :count].copy(), count,
        )  # fmt: skip

    def finish(self, request_id):
        """Release every page of the request and free its slot (completion and cancellation
        alike, in any state; outputs of its steps still in flight are dropped at commit)."""
        cdef Py_ssize_t slot = self.lookup(request_id)
        self.release(self.tables[slot, : self.num_pages_of[slot]])
        self.clear(slot)


cdef tuple count_tokens(request_id, tokens):
    if isinstance(tokens, INTS):
        if tokens < 0:
            raise InvalidInput(f"request {request_id!r}: cannot record {tokens} tokens")
        return int(tokens), None
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
        raise InvalidInput(f"request {request_id!r}: tokens must be a count or 1-D int array")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > TOKEN_MAX):
        raise InvalidInput(f"request {request_id!r}: token ids must lie in 0 .. 2**31-1")
    return len(ids), (int(ids[len(ids) - 1]) if len(ids) else None)
