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

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from sched_oracle.slots import SlotTable
from sched_oracle.supply import PageSupply
from tspd_core.ids import RequestId
from tspd_core.sched.errors import (
    BackendMismatch,
    ContextFull,
    InvalidInput,
    PoolExhausted,
    WrongState,
)
from tspd_core.sched.pool import PAGE_DTYPE, PageArray
from tspd_core.sched.request import RequestState
from tspd_core.sched.rounds import (
    DecodeBackend,
    DecodeItems,
    DecodeOutputs,
    DecodeRound,
    RoundCommit,
)

_TOKEN_MAX = np.iinfo(np.int32).max
_MASK_GATHER_CELLS = 200_000
_DECODE = int(RequestState.DECODE)  # a plain int: enum attribute lookups cost in the hot path


@dataclass(frozen=True, slots=True)
class _InFlight:
    """What a prepared round reserved, kept until it is committed or aborted."""

    round_id: int
    slots: NDArray[np.int32]
    serials: NDArray[np.int64]
    admissions: NDArray[np.int64]  # to tell a discarded request from a finished one
    grew: NDArray[np.bool_]  # per item: a new tail page was appended
    cow: NDArray[np.intp]  # items whose page was copied on write
    cow_page: NDArray[np.int32]  # their logical page
    cow_src: PageArray  # the shared page they left
    alloc: PageArray  # allocation order: grown items' pages, then copy destinations
    prev_rows: NDArray[np.int32]  # last_row before this round


class DecodeRounds:
    """Decode-round half of :class:`~tspd_core.sched.RequestScheduler` (same object)."""

    def __init__(self, slots: SlotTable, supply: PageSupply, page_size: int) -> None:
        self._slots = slots
        self._supply = supply
        self.page_size = page_size
        self.max_context = slots.logical_pages * page_size
        self._inflight: deque[_InFlight] = deque()
        self._next_round = 1
        self._cow_copies = 0
        self._rounds_committed = 0

    def new_round_scratch(self) -> tuple[DecodeItems, PageArray, DecodeOutputs]:
        """Worst-case scratch for one round: items, block table, outputs."""
        cap = self._slots.capacity
        table = np.zeros(cap * self._slots.logical_pages, dtype=PAGE_DTYPE)
        return DecodeItems.empty(cap), table, DecodeOutputs.empty(cap)

    def rounds_in_flight(self) -> int:
        """Rounds prepared and not yet committed or aborted."""
        return len(self._inflight)

    def prepare_decode_round(self, items: DecodeItems, block_table: PageArray) -> DecodeRound:
        """Lay out the next decode step of every DECODE request into caller scratch.

        Reserves the page each request writes (allocating or copying on write) and marks
        the step pending. Raises WrongState (a request without an input token), ContextFull,
        PoolExhausted or InvalidInput (scratch too small) with nothing changed.
        """
        s = self._slots
        slots = np.flatnonzero(s.state == _DECODE).astype(np.int32)
        pos = s.kv_len[slots] + s.pending[slots]
        self._check_ready(slots, pos)
        record, lens = self._plan_round(slots, pos, len(items), len(block_table))
        self._reserve_round(record, pos // self.page_size)
        on_host = s.pending[slots] == 0
        s.pending[slots] += 1
        self._fill_items(items, slots, pos, on_host, lens)
        _gather_tables(s.tables, slots, lens, block_table)
        s.last_row[slots] = np.arange(len(slots), dtype=np.int32)
        self._inflight.append(record)
        self._next_round += 1
        alloc, cow = record.alloc, len(record.cow)
        copies = np.stack([record.cow_src, alloc[len(alloc) - cow :]], axis=1).astype(PAGE_DTYPE)
        total = int(lens.sum())
        return DecodeRound(
            record.round_id, items.head(len(slots)), block_table[:total], copies, len(alloc)
        )

    def _plan_round(
        self, slots: NDArray[np.int32], pos: NDArray[np.int32], n_items: int, n_table: int
    ) -> tuple[_InFlight, NDArray[np.int32]]:
        # Check the scratch, find tail pages to add and shared pages to copy, allocate them
        # all at once (the only step that can fail for lack of pages): nothing changed yet.
        s = self._slots
        page = pos // self.page_size
        grew = page == s.num_pages[slots]
        lens = s.num_pages[slots] + grew
        total = int(lens.sum())
        if n_items < len(slots) or n_table < total:
            raise InvalidInput(
                f"decode round needs {len(slots)} items and {total} block-table entries; "
                f"scratch holds {n_items} and {n_table} (see new_round_scratch)"
            )
        cow = np.flatnonzero(~grew)
        current = s.tables[slots[cow], page[cow]]
        shared = self._shared(current)
        cow, cow_src = cow[shared], current[shared]
        need = int(grew.sum()) + len(cow)
        alloc = self._supply.allocate(need)
        if alloc is None:
            raise PoolExhausted(
                f"decode round needs {need} new pages, {self._supply.reclaimable()} free or "
                "evictable; finish or preempt a request"
            )
        record = _InFlight(
            self._next_round, slots, s.serial[slots].copy(), s.admission[slots].copy(), grew, cow,
            page[cow].astype(np.int32), cow_src, alloc, s.last_row[slots].copy(),
        )  # fmt: skip
        return record, lens

    def _check_ready(self, slots: NDArray[np.int32], pos: NDArray[np.int32]) -> None:
        s = self._slots
        missing = ~s.has_token[slots] & (s.pending[slots] == 0)
        if missing.any():
            rid = s.rids[int(slots[np.argmax(missing)])]
            raise WrongState(
                f"request {rid!r} is in DECODE without a known input token (tokens were "
                "recorded as a count); record_token it or finish it before a decode round"
            )
        full = pos >= self.max_context
        if full.any():
            rid = s.rids[int(slots[np.argmax(full)])]
            raise ContextFull(
                f"request {rid!r} reached the max context of {self.max_context} tokens; "
                "finish it before the next decode round"
            )

    def _shared(self, current: PageArray) -> NDArray[np.bool_]:
        # Which writers must copy: every writer of a page that someone outside the round also
        # holds; of a page held only by this round's writers, all but the last in slot order.
        counts = self._supply.pool.refcounts[current]
        shared: NDArray[np.bool_] = counts > 1
        if shared.any():
            _, where, writers = np.unique(current, return_inverse=True, return_counts=True)
            _, first_rev = np.unique(current[::-1], return_index=True)
            last = np.zeros(len(current), dtype=bool)
            last[len(current) - 1 - first_rev] = True
            shared &= ~(last & (counts == writers[where]))
        return shared

    def _reserve_round(self, record: _InFlight, page: NDArray[np.int32]) -> None:
        s = self._slots
        grown = record.slots[record.grew]
        n_grow = len(grown)
        s.tables[grown, page[record.grew]] = record.alloc[:n_grow]
        s.num_pages[grown] += 1
        if len(record.cow):
            copied = record.slots[record.cow]
            s.tables[copied, record.cow_page] = record.alloc[n_grow:]
            self._supply.release_each(record.cow_src)  # several may leave one page
            self._cow_copies += len(record.cow)

    def _fill_items(
        self,
        items: DecodeItems,
        slots: NDArray[np.int32],
        pos: NDArray[np.int32],
        on_host: NDArray[np.bool_],
        lens: NDArray[np.int32],
    ) -> None:
        s, n = self._slots, len(slots)
        items.slot[:n] = slots
        items.serial[:n] = s.serial[slots]
        items.position[:n] = pos
        items.token[:n] = np.where(on_host, s.token[slots], 0)
        items.token_on_host[:n] = on_host
        items.feed_row[:n] = np.where(on_host, 0, s.last_row[slots])
        items.table_len[:n] = lens
        np.cumsum(lens, out=items.table_offset[:n])
        items.table_offset[:n] -= lens

    def commit_decode_round(self, round_id: int, outputs: DecodeOutputs) -> RoundCommit:
        """Record one token per item of the oldest round in flight, checked as a batch.

        ``outputs`` must hold exactly the round's rows in item order (slot and serial echoed,
        tokens in 0 .. 2**31-1); otherwise BackendMismatch and nothing changes (the round stays
        in flight). Items whose request finished or discarded since launch are dropped.
        """
        if not self._inflight:
            raise WrongState(f"commit of round {round_id}: no decode round is in flight")
        record = self._inflight[0]
        if round_id != record.round_id:
            raise WrongState(
                f"rounds commit in launch order: round {record.round_id} is the oldest in "
                f"flight, got {round_id}"
            )
        _check_outputs(record, outputs, self._slots.rids)
        s = self._slots
        live = s.serial[record.slots] == record.serials
        kept = record.slots[live]
        s.kv_len[kept] += 1
        s.pending[kept] -= 1
        s.token[kept] = outputs.token[live]
        s.has_token[kept] = True
        self._inflight.popleft()
        self._rounds_committed += 1
        done = len(kept)
        return RoundCommit(round_id, done, len(record.slots) - done)

    def abort_decode_round(self, round_id: int) -> None:
        """Undo the newest prepared round (its launch failed or was cancelled): its pages
        and copies are released and its steps are no longer pending."""
        if not self._inflight or self._inflight[-1].round_id != round_id:
            newest = self._inflight[-1].round_id if self._inflight else None
            raise WrongState(f"only the newest round in flight ({newest}) can be aborted")
        record = self._inflight.pop()
        s = self._slots
        live = s.serial[record.slots] == record.serials
        reverted = self._revert_copies(record)
        grown = record.slots[live & record.grew]
        s.num_pages[grown] -= 1
        s.tables[grown, s.num_pages[grown]] = 0
        kept = record.slots[live]
        s.pending[kept] -= 1
        s.last_row[kept] = record.prev_rows[live]
        self._supply.release(record.alloc[np.concatenate([live[record.grew], reverted])])

    def _revert_copies(self, record: _InFlight) -> NDArray[np.bool_]:
        # The copies were never launched, so a destination page holds garbage: point every
        # request that still has it (even one that discarded its steps since) back at the
        # shared source. Returns which copy destinations to release.
        s = self._slots
        copied = record.slots[record.cow]
        same = s.admission[copied] == record.admissions[record.cow]
        dst = record.alloc[len(record.alloc) - len(record.cow) :]
        revert: NDArray[np.bool_] = same & (s.tables[copied, record.cow_page] == dst)
        if revert.any():
            back = record.cow_src[revert]
            self._supply.acquire_each(back)
            s.tables[copied[revert], record.cow_page[revert]] = back
            self._cow_copies -= int(revert.sum())
        return revert

    def discard_pending(self, request_id: RequestId) -> int:
        """Drop a request's launched-but-uncommitted steps (e.g. it hit EOS at step N while
        N+1 was already launched): release the pages only they reserved; their outputs are
        ignored at commit. Returns how many steps were dropped. The request keeps its
        committed tokens and, with a new serial, may decode again or be finished."""
        slot = self._slots.lookup(request_id)
        s = self._slots
        dropped = int(s.pending[slot])
        if not dropped:
            return 0
        keep = -(-int(s.kv_len[slot]) // self.page_size)
        extra = s.tables[slot, keep : s.num_pages[slot]].copy()
        s.tables[slot, keep : s.num_pages[slot]] = 0
        s.num_pages[slot] = keep
        s.pending[slot] = 0
        s.new_serial(slot)
        self._supply.release(extra)
        return dropped

    def execute_decode_round(
        self,
        backend: DecodeBackend,
        item_scratch: DecodeItems,
        block_table_scratch: PageArray,
        output_scratch: DecodeOutputs,
    ) -> RoundCommit:
        """One synchronous ragged decode round: prepare, exactly one backend call, commit.

        The backend's outputs are checked as a complete batch before any state changes; on
        a mismatch (BackendMismatch) or a backend exception the round is aborted, so the
        scheduler is as before the call. With no DECODE request the backend is not called.
        """
        if self._inflight:
            raise WrongState(
                "pipelined rounds are in flight; commit them before a synchronous round"
            )
        decoding = int(np.count_nonzero(self._slots.state == _DECODE))
        if len(output_scratch) < decoding:
            raise InvalidInput(f"output scratch holds {len(output_scratch)} rows, need {decoding}")
        batch = self.prepare_decode_round(item_scratch, block_table_scratch)
        if batch.size == 0:
            self.abort_decode_round(batch.round_id)
            return RoundCommit(batch.round_id, 0, 0)
        try:
            written = backend.execute_ragged(batch, output_scratch)
            if written != batch.size:
                raise BackendMismatch(
                    f"round {batch.round_id}: backend wrote {written!r} outputs for "
                    f"{batch.size} items"
                )
            return self.commit_decode_round(batch.round_id, output_scratch.head(batch.size))
        except BaseException:
            self.abort_decode_round(batch.round_id)
            raise


def _gather_tables(
    tables: PageArray, slots: NDArray[np.int32], lens: NDArray[np.int32], out: PageArray
) -> None:
    # Short tables: row-gather the used columns and compress by a mask (three vectorised
    # passes). Long ones: one slice per request into np.concatenate (one pass over the data,
    # plus ~1 µs of Python per request), which wins past ~200k gathered cells.
    if not len(slots):
        return
    width = int(lens.max())
    total = int(lens.sum())
    if len(slots) * width <= _MASK_GATHER_CELLS:
        sub = tables[slots, :width]
        out[:total] = sub[np.arange(width, dtype=np.int32) < lens[:, None]]
    else:
        rows = zip(slots.tolist(), lens.tolist(), strict=True)
        np.concatenate([tables[slot, :n] for slot, n in rows], out=out[:total])


def _check_outputs(record: _InFlight, outputs: DecodeOutputs, rids: list[RequestId | None]) -> None:
    n = len(record.slots)
    if len(outputs) != n:
        raise BackendMismatch(
            f"round {record.round_id}: {len(outputs)} outputs for {n} items; the batch is "
            "rejected whole and stays in flight"
        )
    wrong = (outputs.slot != record.slots) | (outputs.serial != record.serials)
    if wrong.any():
        row = int(np.argmax(wrong))
        raise BackendMismatch(
            f"round {record.round_id}: output row {row} is (slot {outputs.slot[row]}, serial "
            f"{outputs.serial[row]}), expected (slot {record.slots[row]}, serial "
            f"{record.serials[row]}) of request {rids[int(record.slots[row])]!r}; outputs must "
            "follow item order"
        )
    bad = (outputs.token < 0) | (outputs.token > _TOKEN_MAX)
    if bad.any():
        row = int(np.argmax(bad))
        raise BackendMismatch(
            f"round {record.round_id}: output row {row} has token {outputs.token[row]}, "
            "outside 0 .. 2**31-1"
        )
