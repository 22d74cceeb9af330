"""Per-slot request state as a struct of numpy arrays (so rounds can be vectorised).

Slot ``s`` of every array describes the request in that slot; a free slot has state ``FREE``
and an all-zero page-table row. The logical page table of every slot is allocated once, at
construction (``capacity x logical_pages`` int32); page id 0 marks an unused entry.

The tests' oracle: the numpy model the native slots (``tspd_core.sched._slots``) must match.
"""

from __future__ import annotations

import heapq

import numpy as np

from tspd_core.ids import RequestId
from tspd_core.sched.errors import CapacityFull, DuplicateRequest, InvalidInput, UnknownRequest
from tspd_core.sched.keys import KeyArray
from tspd_core.sched.pool import PAGE_DTYPE
from tspd_core.sched.request import RequestState

_FREE = int(RequestState.FREE)


class SlotTable:
    """The state arrays of one scheduler's slots; owned and mutated by that scheduler only."""

    def __init__(self, capacity: int, logical_pages: int) -> None:
        if not isinstance(capacity, int) or not 1 <= capacity <= 1 << 20:
            raise InvalidInput(f"capacity must be an int in 1 .. 2**20, got {capacity!r}")
        if not isinstance(logical_pages, int) or not 1 <= logical_pages <= 1 << 24:
            raise InvalidInput(f"logical_pages must be an int in 1 .. 2**24, got {logical_pages!r}")
        self.capacity = capacity
        self.logical_pages = logical_pages
        self.state = np.zeros(capacity, dtype=np.int8)
        self.serial = np.zeros(capacity, dtype=np.int64)
        #: The serial given at admission; unlike ``serial`` it survives discard_pending.
        self.admission = np.zeros(capacity, dtype=np.int64)
        self.prompt_len = np.zeros(capacity, dtype=np.int32)
        self.prefix_tokens = np.zeros(capacity, dtype=np.int32)
        #: Tokens whose KV is written and committed.
        self.kv_len = np.zeros(capacity, dtype=np.int32)
        #: Decode steps launched and not yet committed.
        self.pending = np.zeros(capacity, dtype=np.int32)
        self.num_pages = np.zeros(capacity, dtype=np.int32)
        self.tables = np.zeros((capacity, logical_pages), dtype=PAGE_DTYPE)
        #: Last token known on the host (the next input when no step is pending).
        self.token = np.zeros(capacity, dtype=np.int32)
        self.has_token = np.zeros(capacity, dtype=bool)
        #: Row of the request in the newest prepared round (where its in-flight token is).
        self.last_row = np.zeros(capacity, dtype=np.int32)
        self.rids: list[RequestId | None] = [None] * capacity
        #: The page keys a request's completion offers the prefix store, or None.
        self.keys: list[KeyArray | None] = [None] * capacity
        self.index: dict[RequestId, int] = {}
        #: Free slots, a min-heap: the lowest free slot goes first.
        self.free_heap = list(range(capacity))
        self._serials = 0

    def active(self) -> int:
        return len(self.index)

    def lookup(self, request_id: RequestId) -> int:
        """The slot of an active request; :class:`UnknownRequest` otherwise."""
        slot = self.index.get(request_id)
        if slot is None:
            raise UnknownRequest(
                f"request {request_id!r} is not active (never admitted or already finished)"
            )
        return slot

    def check_new(self, request_id: RequestId) -> None:
        """Raise if ``request_id`` is active or no slot is free (checks only)."""
        if request_id in self.index:
            raise DuplicateRequest(
                f"request {request_id!r} is already active in slot {self.index[request_id]}; "
                "finish it first or use a fresh id"
            )
        if not self.free_heap:
            raise CapacityFull(
                f"all {self.capacity} request slots are taken; finish a request before "
                f"admitting {request_id!r}"
            )

    @property
    def serials_issued(self) -> int:
        """The newest serial handed out (the last :meth:`take`'s)."""
        return self._serials

    def has_free_slot(self) -> bool:
        return bool(self.free_heap)

    def take(self, request_id: RequestId) -> int:
        """Claim the lowest free slot for ``request_id`` with a fresh serial (after check_new)."""
        slot = heapq.heappop(self.free_heap)
        self._serials += 1
        self.serial[slot] = self.admission[slot] = self._serials
        self.rids[slot] = request_id
        self.index[request_id] = slot
        return slot

    def new_serial(self, slot: int) -> None:
        """Give the slot a fresh serial, so outputs of steps launched before no longer match."""
        self._serials += 1
        self.serial[slot] = self._serials

    def clear(self, slot: int) -> None:
        """Return the slot to the free heap (its pages must already be released)."""
        rid = self.rids[slot]
        if rid is not None:
            del self.index[rid]
        self.rids[slot] = None
        self.keys[slot] = None
        self.tables[slot, : self.num_pages[slot]] = 0
        # Serials start at 1: steps launched before never match again. has_token: False.
        for column in (
            self.prompt_len,
            self.prefix_tokens,
            self.kv_len,
            self.pending,
            self.num_pages,
            self.serial,
            self.admission,
            self.token,
            self.has_token,
        ):
            column[slot] = 0
        self.state[slot] = _FREE
        heapq.heappush(self.free_heap, slot)
