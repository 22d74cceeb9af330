"""Room states with their wire integers (wire.md §1) and the one rule that updates them; how
much of a P request its worker holds (:class:`HandOver`).

A room's state only moves forward; ``FAILED`` is sticky. Both the transfer worker (when a
status frame arrives) and the engine-side peer (when the worker publishes a change) apply the
same rule, :func:`advance`, so the two never disagree on ordering.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum, StrEnum
from typing import Protocol, TypeVar

from tspd_core.ids import Room


class TransferPoll(IntEnum):
    """The state of one room on one rank; the values are the wire integers of wire.md §1.

    The numeric order is the order of progress, except ``FAILED`` (0), which wins over every
    other value. That makes a MIN all-reduce over the ranks of a replica yield the least
    advanced state any member holds, with a failure anywhere failing the room everywhere.
    """

    FAILED = 0
    #: P: the room is tracked; D: the room is tracked and the P ranks are being looked up.
    BOOTSTRAPPING = 1
    #: P: all planned pre-allocations arrived; D: route fetched and registrations sent.
    BOOTSTRAPPED = 2
    #: D only: the destination manifest is published to the P ranks.
    WAITING_FOR_INPUT = 3
    #: Defined by the wire, never set (a D logs it as unexpected).
    TRANSFERRING = 4
    #: P: every write of the room completed; D: Success arrived from every expected P rank.
    SUCCESS = 5

    @property
    def is_final(self) -> bool:
        """Whether no further update can change this state (Success or Failed)."""
        return self in (TransferPoll.SUCCESS, TransferPoll.FAILED)


class _Stateful(Protocol):
    @property
    def status(self) -> TransferPoll: ...


S = TypeVar("S", bound=_Stateful)


def alone(rooms: Mapping[Room, S], room: S) -> bool:
    """Whether ``room`` is the only one of a worker's ``rooms`` that has not ended (P and D
    run small jobs and scatters on their control thread only then)."""
    return not any(r is not room and not r.status.is_final for r in rooms.values())


def advance(stored: TransferPoll | None, incoming: TransferPoll) -> TransferPoll:
    """Apply one update to a room's state (wire.md §1).

    The first update stores ``incoming``; afterwards Failed on either side gives Failed (sticky)
    and anything else gives the more advanced of the two, so late or duplicated updates can
    never move a room backwards.
    """
    if stored is None:
        return incoming
    if stored is TransferPoll.FAILED or incoming is TransferPoll.FAILED:
        return TransferPoll.FAILED
    return stored if stored >= incoming else incoming


class FailureCause(StrEnum):
    """Why a room failed, for operators (metric labels, ``Failed.cause``)."""

    TIMEOUT = "timeout"  #: P bootstrap timeout, D waiting timeout
    HEARTBEAT = "heartbeat"  #: D: the P instance's bootstrap server stopped answering
    WRITE = "write"  #: P: a Mooncake write failed (or its session failed one recently)
    ABORT = "abort"  #: the engine gave the request up (abort, abort_room)
    REJECTED = "rejected"  #: P refused a registration or pre-allocation of the room
    BAD_FRAME = "bad_frame"  #: a malformed or out-of-order message concerned the room
    REMOTE = "remote"  #: D: a P rank pushed Failed
    LOOKUP = "lookup"  #: D: the bootstrap server could not say where the P ranks are
    WORKER_LOST = "worker_lost"  #: the rank's transfer worker process died
    REPLICA = "replica"  #: another rank of the replica failed the room


class HandOver(IntEnum):
    """How much of a P request's KV its outbox gave the worker; ordered, and it never moves
    back (``PrefillPeer.handed``). Engine-side only: the worker learns it from the chunks."""

    #: Nothing: the worker reads none of the request's pages.
    NOTHING = 0
    #: A chunk (armed, or handed over): the worker may read the pages until the room ends.
    CHUNK = 1
    #: Layerwise: the final chunk is armed; its first token is still to be handed over.
    FINAL_CHUNK = 2
    #: The final chunk and the first token: nothing more of the request goes to the worker.
    DONE = 3
