"""Request lifecycle and the small records the scheduler hands out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import TypeVar

from tspd_core.ids import RequestId
from tspd_core.sched.pool import PageArray

_T = TypeVar("_T")


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


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of admitting one request (or forking one)."""

    request_id: RequestId
    #: Stable slot index for the request's whole life (0 .. capacity-1).
    slot: int
    #: Identity of this admission in decode batches; a new admission of a reused slot differs.
    serial: int
    state: RequestState
    prompt_len: int
    #: Prompt tokens served by the prefix store: a multiple of page_size, < prompt_len.
    prefix_tokens: int
    #: The request's page table at admission (a copy): one page per ceil(prompt_len/page_size).
    pages: PageArray
    #: The pages not served by the prefix (``pages[prefix_tokens // page_size:]``): their
    #: content is undefined; a PD decode peer zeroes them before publishing its manifest.
    new_pages: PageArray


def _frozen_factory(cls: type[_T]) -> Callable[..., _T]:
    """A positional constructor of the frozen, slotted dataclass ``cls`` that sets the slots
    directly: the generated ``__init__`` calls ``object.__setattr__`` per field (~1.6 µs for
    an :class:`Admission`, a tenth of a short request's admission), this ~0.4 µs (one slot
    setter call per field, unrolled as the dataclass machinery does for ``__init__``). Same
    object, still frozen; the scheduler's hot paths use it."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    scope: dict[str, object] = {"new": object.__new__, "cls": cls}
    scope.update((f"set_{n}", getattr(cls, n).__set__) for n in names)
    body = "".join(f"    set_{n}(obj, {n})\n" for n in names)
    exec(f"def make({', '.join(names)}):\n    obj = new(cls)\n{body}    return obj\n", scope)
    make: Callable[..., _T] = scope["make"]  # type: ignore[assignment]
    return make


#: ``new_admission(request_id, slot, serial, state, prompt_len, prefix_tokens, pages,
#: new_pages)``: an :class:`Admission`, fast (see :func:`_frozen_factory`).
new_admission = _frozen_factory(Admission)


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
