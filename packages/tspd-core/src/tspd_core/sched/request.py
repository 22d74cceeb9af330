"""Request lifecycle and the small records the scheduler hands out."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from tspd_core.ids import RequestId
from tspd_core.sched.pool import PAGE_DTYPE, PageArray


class RequestState(IntEnum):
    """Where a request is in its life; ordered, so "prompt KV complete" is one comparison.

    ``FREE`` only ever describes an empty slot; a live request is never ``FREE``::

        admit(remote_kv=True) ──> AWAITING_KV ──seed_decode_token──┐
        admit() ──> PREFILL ──mark_prefill_complete──> PREFILLED ──┴─seed──> DECODE
                                                         (P in PD: stays until finish)
        any state ──finish──> slot FREE (pages released; cancellation is the same call)
    """

    FREE = 0
    #: Pages allocated; the prompt's KV (beyond the local prefix hit) arrives from a peer.
    AWAITING_KV = 1
    #: The prompt's KV (beyond the prefix hit) is being computed locally, maybe in chunks.
    PREFILL = 2
    #: All prompt KV is present; waiting for the token the first decode step consumes.
    PREFILLED = 3
    #: Runnable for decode: its next input token is known (on the host or in flight).
    DECODE = 4


class Admission:
    """The outcome of admitting one request (or forking one): a read-only record (its fields
    are properties without setters).

    A short request's pages come from the scheduler as a list and become the int32 array of
    :attr:`pages` the first time it is read (~0.5 µs, once), which a caller that never reads
    them, such as the simulator, never pays."""

    __slots__ = ("_first_new", "_pages", "_prefix_tokens", "_prompt_len", "_request_id",
                 "_serial", "_slot", "_state")  # fmt: skip

    def __init__(
        self,
        request_id: RequestId,
        slot: int,
        serial: int,
        state: RequestState,
        prompt_len: int,
        prefix_tokens: int,
        pages: PageArray | list[int],
        first_new: int,
    ) -> None:
        # Plain slot stores (~0.2 µs), not a frozen dataclass's object.__setattr__ per field
        # (~0.6 µs): a record is built on every admission.
        self._request_id = request_id
        self._slot = slot
        self._serial = serial
        self._state = state
        self._prompt_len = prompt_len
        self._prefix_tokens = prefix_tokens
        self._pages = pages
        self._first_new = first_new

    @property
    def request_id(self) -> RequestId:
        return self._request_id

    @property
    def slot(self) -> int:
        """Stable slot index for the request's whole life (0 .. capacity-1)."""
        return self._slot

    @property
    def serial(self) -> int:
        """Identity of this admission in decode batches; a new admission of a reused slot
        differs."""
        return self._serial

    @property
    def state(self) -> RequestState:
        return self._state

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def prefix_tokens(self) -> int:
        """Prompt tokens served by the prefix store: a multiple of page_size, < prompt_len."""
        return self._prefix_tokens

    @property
    def pages(self) -> PageArray:
        """The request's page table at admission (a copy): one page per
        ceil(prompt_len/page_size)."""
        pages = self._pages
        if isinstance(pages, list):
            pages = self._pages = np.array(pages, dtype=PAGE_DTYPE)
        return pages

    @property
    def new_pages(self) -> PageArray:
        """The pages not served by the prefix (a view of :attr:`pages` past the hit): their
        content is undefined; a PD decode peer zeroes them before publishing its manifest."""
        return self.pages[self._first_new :]

    def __repr__(self) -> str:
        return (
            f"Admission(request_id={self._request_id!r}, slot={self._slot}, "
            f"serial={self._serial}, state={self._state!r}, prompt_len={self._prompt_len}, "
            f"prefix_tokens={self._prefix_tokens}, pages={[int(p) for p in self._pages]}, "
            f"new_pages_from={self._first_new})"
        )


@dataclass(frozen=True, slots=True)
class CopyOnWrite:
    """Copy physical page ``src`` to ``dst`` before writing logical page ``logical_page``."""

    logical_page: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class RequestView:
    """A snapshot of one request's bookkeeping (not updated afterwards)."""

    request_id: RequestId
    slot: int
    serial: int
    state: RequestState
    prompt_len: int
    prefix_tokens: int
    #: Tokens whose KV is written and committed (prefill progress, then prompt + decoded).
    num_tokens: int
    #: Decode steps launched but not yet committed (pipelined rounds).
    pending: int
    #: Pages in the request's page table (including pages reserved for pending steps).
    num_pages: int
    #: The next decode input token when known on the host, else None.
    next_token: int | None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters since construction plus current occupancy (all O(1) to read)."""

    active: int
    free_pages: int
    cached_pages: int
    evictable_pages: int
    admissions: int
    prompt_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    decode_rounds: int
    evictions: int
