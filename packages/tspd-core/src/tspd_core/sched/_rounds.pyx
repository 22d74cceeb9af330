# cython: language_level=3, boundscheck=True, wraparound=False, initializedcheck=True
"""Ragged decode rounds: prepare (reserve pages, lay out the batch), commit, abort, discard.

A round takes every DECODE request in slot order. Preparing it reserves the page for each
request's next position (a new tail page, or a private copy of a shared page) and counts the
step as *pending*; committing it records one token per request; aborting the newest round
undoes its reservations exactly. Rounds are committed first-in first-out, so an engine with a
device token feed can prepare and launch step N+1 before it commits step N::

    prepare(N) launch(N) prepare(N+1) launch(N+1) commit(N) prepare(N+2) ... commit(N+1)

For a request with a step pending, the next round's input token is that step's output, still
on the device: its item says ``token_on_host=False`` and names the previous round's row.
"""

cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy

from collections import deque

import numpy as np

from tspd_core.sched._build import check_built_from
from tspd_core.sched.errors import (
    BackendMismatch,
    ContextFull,
    InvalidInput,
    PoolExhausted,
    WrongState,
)
from tspd_core.sched.rounds import DecodeRound, RoundCommit

from tspd_core.sched._pool cimport new_memory
from tspd_core.sched._lifecycle cimport Lifecycle
from tspd_core.sched._slots cimport DECODE

cdef extern from *:
    """
    #ifndef TSPD_SOURCE_SHA256
    #define TSPD_SOURCE_SHA256 ""
    #endif
    """
    const char *TSPD_SOURCE_SHA256

check_built_from(__file__, "_rounds", TSPD_SOURCE_SHA256.decode("ascii"))

cdef int64_t TOKEN_MAX = 2147483647


@cython.auto_pickle(False)
@cython.final
cdef class Round:
    """What a prepared round reserved, kept until it is committed or aborted."""

    cdef int64_t round_id
    cdef Py_ssize_t n, n_grow, n_cow
    cdef int32_t[::1] slots
    cdef int64_t[::1] serials
    cdef int64_t[::1] admissions  # to tell a discarded request from a finished one
    cdef uint8_t[::1] grew  # per item: a new tail page was appended
    cdef int32_t[::1] prev_rows  # last_row before this round
    cdef int32_t[::1] cow_item  # items whose page was copied on write, their logical page
    cdef int32_t[::1] cow_page
    cdef int32_t[::1] cow_src  # and the shared page they left
    cdef int64_t[::1] cow_frees  # the pool's free count of that page after the round left it
    cdef int32_t[::1] alloc  # allocation order: grown items' pages, then copy destinations


@cython.auto_pickle(False)
cdef class RoundsCore(Lifecycle):
    """The decode-round half of :class:`~tspd_core.sched.RequestScheduler` (same object)."""

    cdef object inflight
    cdef int64_t next_round
    # Scratch: per item (capacity) and per page (the pool's pages).
    cdef int32_t[::1] item_slot
    cdef int32_t[::1] item_pos
    cdef uint8_t[::1] item_grew
    cdef int32_t[::1] item_page
    cdef int32_t[::1] item_cur
    cdef uint8_t[::1] item_flag
    cdef int32_t[::1] layer
    cdef int32_t[::1] writers

    def __cinit__(self, *args, **kwargs):
        self.inflight = deque()
        self.next_round = 1
        self.item_slot = new_memory("i", self.capacity)
        self.item_pos = new_memory("i", self.capacity)
        self.item_grew = new_memory("B", self.capacity)
        self.item_page = new_memory("i", self.capacity)
        self.item_cur = new_memory("i", self.capacity)
        self.item_flag = new_memory("B", self.capacity)
        self.layer = new_memory("i", self.capacity)
        self.writers = new_memory("i", self.pool.num_pages + 1)

    def rounds_in_flight(self):
        """Rounds prepared and not yet committed or aborted."""
        return len(self.inflight)

    def _decoding_count(self):
        cdef Py_ssize_t s, n = 0
        for s in range(self.capacity):
            n += self.states[s] == DECODE
        return n

    def prepare_decode_round(self, items, block_table):
        """Lay out the next decode step of every DECODE request into caller scratch.

        Reserves the page each request writes (allocating or copying on write) and marks
        the step pending. Raises WrongState (a request without an input token), ContextFull,
        PoolExhausted or InvalidInput (scratch too small or not from ``new_round_scratch``)
        with nothing changed.
        """
        cdef int32_t[:] o_slot, o_pos, o_token, o_feed, o_off, o_len
        cdef int32_t[::1] table
        cdef int64_t[:] o_serial
        cdef uint8_t[:] o_host
        try:
            o_slot, o_serial, o_pos, o_token = items.slot, items.serial, items.position, items.token
            o_feed, o_off, o_len = items.feed_row, items.table_offset, items.table_len
            host = items.token_on_host
            if host.dtype != np.bool_:
                raise TypeError(f"token_on_host is {host.dtype}, not bool")
            o_host = host.view(np.uint8)
            table = block_table
        except (AttributeError, TypeError, ValueError, BufferError) as exc:
            raise InvalidInput(
                "decode round scratch must be writable arrays from new_round_scratch "
                f"(a contiguous int32 block table): {exc}"
            ) from exc
        cdef Py_ssize_t n = self.decoding_slots()
        self.check_ready(n)
        cdef Py_ssize_t total = self.plan(n)
        cdef Py_ssize_t held = min(
            o_slot.shape[0], o_serial.shape[0], o_pos.shape[0], o_token.shape[0],
            o_host.shape[0], o_feed.shape[0], o_off.shape[0], o_len.shape[0],
        )  # fmt: skip
        if held < n or table.shape[0] < total:
            raise InvalidInput(
                f"decode round needs {n} items and {total} block-table entries; "
                f"scratch holds {held} and {table.shape[0]} (see new_round_scratch)"
            )
        cdef Round record = self.reserve_round(n)
        cdef Py_ssize_t i, s, off = 0, length
        for i in range(n):
            s = self.item_slot[i]
            length = self.num_pages_of[s]
            o_slot[i] = <int32_t>s
            o_serial[i] = self.serial[s]
            o_pos[i] = self.item_pos[i]
            o_host[i] = self.pending[s] == 0
            o_token[i] = self.token[s] if o_host[i] else 0
            o_feed[i] = 0 if o_host[i] else self.last_row[s]
            o_off[i] = <int32_t>off
            o_len[i] = <int32_t>length
            if length:  # the slot's row, bounds checked, then copied whole
                table[off + length - 1] = self.tables[s, length - 1]
                memcpy(&table[off], &self.tables[s, 0], length * sizeof(int32_t))
            off += length
            self.pending[s] += 1
            self.last_row[s] = <int32_t>i
        self.inflight.append(record)
        self.next_round += 1
        copies = np.empty((record.n_cow, 2), dtype=np.int32)
        for i in range(record.n_cow):
            copies[i, 0] = record.cow_src[i]
            copies[i, 1] = record.alloc[record.n_grow + i]
        return DecodeRound(
            record.round_id, items.head(n), block_table[:total], copies,
            record.n_grow + record.n_cow,
        )  # fmt: skip

    cdef Py_ssize_t decoding_slots(self) except -1:
        # Every DECODE slot, ascending, into item_slot; returns how many.
        cdef Py_ssize_t s, n = 0
        for s in range(self.capacity):
            if self.states[s] == DECODE:
                self.item_slot[n] = <int32_t>s
                self.item_pos[n] = self.kv_len[s] + self.pending[s]
                n += 1
        return n

    cdef int check_ready(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t i, s
        for i in range(n):
            s = self.item_slot[i]
            if not self.has_token[s] and not self.pending[s]:
                raise WrongState(
                    f"request {self.rids[s]!r} is in DECODE without a known input token "
                    "(tokens were recorded as a count); record_token it or finish it before "
                    "a decode round"
                )
        for i in range(n):
            if self.item_pos[i] >= self.max_context:
                raise ContextFull(
                    f"request {self.rids[self.item_slot[i]]!r} reached the max context of "
                    f"{self.max_context} tokens; finish it before the next decode round"
                )
        return 0

    cdef Py_ssize_t plan(self, Py_ssize_t n) except -1:
        """Which items grow a tail page, which write a page they must copy first (item_flag);
        returns the block-table entries the round needs. Changes nothing."""
        cdef Py_ssize_t i, s, total = 0, page
        for i in range(n):
            s = self.item_slot[i]
            page = self.item_pos[i] // self.page_size
            self.item_page[i] = <int32_t>page
            self.item_grew[i] = page == self.num_pages_of[s]
            total += self.num_pages_of[s] + self.item_grew[i]
            self.item_cur[i] = 0 if self.item_grew[i] else self.tables[s, page]
        self.mark_shared(n)
        return total

    cdef int mark_shared(self, Py_ssize_t n) except -1:
        # Which writers must copy: every writer of a page that someone outside the round also
        # holds; of a page held only by this round's writers, all but the last in slot order.
        cdef Py_ssize_t i
        cdef int32_t page, writers, refs
        for i in range(n):
            if not self.item_grew[i]:
                self.writers[self.item_cur[i]] += 1
        for i in range(n - 1, -1, -1):
            self.item_flag[i] = 0
            if self.item_grew[i]:
                continue
            page = self.item_cur[i]
            refs = self.pool.rc[page]
            writers = self.writers[page]
            if writers > 0:  # the last writer in slot order: keeps a page only it and ...
                self.writers[page] = -writers
                self.item_flag[i] = refs > 1 and refs != writers  # ... its co-writers hold
            else:
                self.item_flag[i] = refs > 1
        for i in range(n):
            if not self.item_grew[i]:
                self.writers[self.item_cur[i]] = 0
        return 0

    cdef Round reserve_round(self, Py_ssize_t n):
        """Allocate the round's pages (the only step that can fail: PoolExhausted, nothing
        changed), then point the tables at them and release the pages copied from."""
        cdef Py_ssize_t i, j, s, n_grow = 0, n_cow = 0
        for i in range(n):
            n_grow += self.item_grew[i]
            n_cow += self.item_flag[i]
        cdef Round r = Round.__new__(Round)
        r.round_id, r.n, r.n_grow, r.n_cow = self.next_round, n, n_grow, n_cow
        r.alloc = new_memory("i", n_grow + n_cow)
        if not self.alloc(n_grow + n_cow, r.alloc):
            raise PoolExhausted(
                f"decode round needs {n_grow + n_cow} new pages, {self.reclaimable()} free or "
                "evictable; finish or preempt a request"
            )
        r.slots, r.prev_rows, r.grew = new_memory("i", n), new_memory("i", n), new_memory("B", n)
        r.serials, r.admissions = new_memory("q", n), new_memory("q", n)
        r.cow_item, r.cow_page = new_memory("i", n_cow), new_memory("i", n_cow)
        r.cow_src, r.cow_frees = new_memory("i", n_cow), new_memory("q", n_cow)
        cdef Py_ssize_t grown = 0, copied = 0
        for i in range(n):
            s = self.item_slot[i]
            r.slots[i], r.serials[i], r.admissions[i] = s, self.serial[s], self.admission[s]
            r.prev_rows[i], r.grew[i] = self.last_row[s], self.item_grew[i]
            if self.item_grew[i]:
                self.tables[s, self.item_page[i]] = r.alloc[grown]
                self.num_pages_of[s] += 1
                grown += 1
            elif self.item_flag[i]:
                r.cow_item[copied], r.cow_page[copied] = i, self.item_page[i]
                r.cow_src[copied] = self.item_cur[i]
                self.tables[s, self.item_page[i]] = r.alloc[n_grow + copied]
                copied += 1
        self.release_each(r.cow_src)  # several writers may leave one page
        for i in range(n_cow):
            r.cow_frees[i] = self.pool.frees[r.cow_src[i]]
        self.cow_copies += n_cow
        return r

    cdef int release_each(self, int32_t[:] pages) except -1:
        # Like release, but ids may repeat: the k-th occurrences of each id go in pass k
        # (a pass releases distinct ids), order kept within a pass.
        cdef Py_ssize_t i, k, m, n = pages.shape[0], passes = 0
        for i in range(n):
            self.layer[i] = self.writers[pages[i]]
            self.writers[pages[i]] += 1
            passes = max(passes, self.layer[i] + 1)
        for i in range(n):
            self.writers[pages[i]] = 0
        cdef int32_t[::1] part = new_memory("i", n)
        for k in range(passes):
            m = 0
            for i in range(n):
                if self.layer[i] == k:
                    part[m] = pages[i]
                    m += 1
            self.release(part[:m])
        return 0

    def commit_decode_round(self, round_id, outputs):
        """Record one token per item of the oldest round in flight, checked as a batch.

        ``outputs`` must hold exactly the round's rows in item order (slot and serial echoed,
        tokens in 0 .. 2**31-1); otherwise BackendMismatch and nothing changes (the round stays
        in flight). Items whose request finished or discarded since launch are dropped.
        """
        if not self.inflight:
            raise WrongState(f"commit of round {round_id}: no decode round is in flight")
        cdef Round r = self.inflight[0]
        if round_id != r.round_id:
            raise WrongState(
                f"rounds commit in launch order: round {r.round_id} is the oldest in "
                f"flight, got {round_id}"
            )
        slot_col, serial_col, token_col = self.check_outputs(r, outputs)
        cdef const int64_t[::1] tokens = token_col
        cdef Py_ssize_t i, s, kept = 0
        for i in range(r.n):
            s = r.slots[i]
            if self.serial[s] == r.serials[i]:
                self.kv_len[s] += 1
                self.pending[s] -= 1
                self.token[s] = <int32_t>tokens[i]
                self.has_token[s] = 1
                kept += 1
        self.inflight.popleft()
        self.rounds_committed += 1
        return RoundCommit(round_id, kept, r.n - kept)

    cdef tuple check_outputs(self, Round r, outputs):
        cdef Py_ssize_t n = r.n, i, row = -1
        if len(outputs) != n:
            raise BackendMismatch(
                f"round {r.round_id}: {len(outputs)} outputs for {n} items; the batch is "
                "rejected whole and stays in flight"
            )
        columns = []
        for name in ("slot", "serial", "token"):
            column = np.asarray(getattr(outputs, name))
            if column.shape != (n,) or (n and column.dtype.kind not in "iu"):
                raise BackendMismatch(
                    f"round {r.round_id}: output {name} must be {n} integers, got "
                    f"{column.dtype} {column.shape}"
                )
            columns.append(np.ascontiguousarray(column, dtype=np.int64))
        cdef const int64_t[::1] slots = columns[0], serials = columns[1], tokens = columns[2]
        for i in range(n):
            if slots[i] != r.slots[i] or serials[i] != r.serials[i]:
                raise BackendMismatch(
                    f"round {r.round_id}: output row {i} is (slot {slots[i]}, serial "
                    f"{serials[i]}), expected (slot {r.slots[i]}, serial {r.serials[i]}) of "
                    f"request {self.rids[r.slots[i]]!r}; outputs must follow item order"
                )
        for i in range(n):
            if tokens[i] < 0 or tokens[i] > TOKEN_MAX:
                raise BackendMismatch(
                    f"round {r.round_id}: output row {i} has token {tokens[i]}, "
                    "outside 0 .. 2**31-1"
                )
        return tuple(columns)

    def abort_decode_round(self, round_id):
        """Undo the newest prepared round (its launch failed or was cancelled): its pages
        and copies are released and its steps are no longer pending."""
        newest = self.inflight[len(self.inflight) - 1] if self.inflight else None
        if newest is None or (<Round>newest).round_id != round_id:
            newest_id = None if newest is None else (<Round>newest).round_id
            raise WrongState(f"only the newest round in flight ({newest_id}) can be aborted")
        cdef Round r = newest
        cdef Py_ssize_t reverted = self.check_revert(r)
        self.inflight.pop()
        cdef Py_ssize_t i, k, s, m = 0, j = 0
        cdef int32_t[::1] back = new_memory("i", reverted)
        cdef int32_t[::1] freed = new_memory("i", r.n_grow + r.n_cow)
        for k in range(r.n_cow):  # the copies were never launched: back to their source
            if self.item_flag[k]:
                s = r.slots[r.cow_item[k]]
                self.tables[s, r.cow_page[k]] = r.cow_src[k]
                back[j] = r.cow_src[k]
                j += 1
        self.acquire(back)
        self.cow_copies -= reverted
        k = 0
        for i in range(r.n):
            s = r.slots[i]
            if self.serial[s] != r.serials[i]:  # finished or discarded since: done already
                k += r.grew[i]
                continue
            if r.grew[i]:
                self.num_pages_of[s] -= 1
                self.tables[s, self.num_pages_of[s]] = 0
                freed[m] = r.alloc[k]
                m += 1
                k += 1
            self.pending[s] -= 1
            self.last_row[s] = r.prev_rows[i]
        for k in range(r.n_cow):
            if self.item_flag[k]:
                freed[m] = r.alloc[r.n_grow + k]
                m += 1
        self.release(freed[:m])

    cdef Py_ssize_t check_revert(self, Round r) except -1:
        # Which copies to revert (item_flag[k]): every request that still has the copy's
        # destination at that page, even one that discarded its steps since (its table would
        # otherwise keep an uncopied page). Its source must still be in use: checked here,
        # before anything changes.
        cdef Py_ssize_t k, i, s, count = 0
        for k in range(r.n_cow):
            i = r.cow_item[k]
            s = r.slots[i]
            self.item_flag[k] = (
                self.admission[s] == r.admissions[i]
                and self.tables[s, r.cow_page[k]] == r.alloc[r.n_grow + k]
            )
            if self.item_flag[k] and self.pool.frees[r.cow_src[k]] != r.cow_frees[k]:
                raise WrongState(
                    f"round {r.round_id} cannot be undone: page {r.cow_src[k]}, which request "
                    f"{self.rids[s]!r} copied from, was freed since; finish {self.rids[s]!r}"
                )
            count += self.item_flag[k]
        return count

    def discard_pending(self, request_id):
        """Drop a request's launched-but-uncommitted steps (e.g. it hit EOS at step N while
        N+1 was already launched): release the pages only they reserved; their outputs are
        ignored at commit. Returns how many steps were dropped. The request keeps its
        committed tokens and, with a new serial, may decode again or be finished."""
        cdef Py_ssize_t slot = self.lookup(request_id), i
        cdef Py_ssize_t dropped = self.pending[slot]
        if not dropped:
            return 0
        cdef Py_ssize_t keep = self.pages_for(self.kv_len[slot])
        cdef Py_ssize_t have = self.num_pages_of[slot]
        cdef int32_t[::1] extra = new_memory("i", max(0, have - keep))
        for i in range(keep, have):
            extra[i - keep] = self.tables[slot, i]
            self.tables[slot, i] = 0
        self.num_pages_of[slot] = <int32_t>min(keep, have)
        self.pending[slot] = 0
        self.new_serial(slot)
        self.release(extra)
        return dropped
