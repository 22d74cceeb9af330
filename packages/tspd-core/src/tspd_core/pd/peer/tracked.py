"""One admitted request as the engine-side peer sees it, and how its worker's news folds in.

The peer keeps one :class:`Tracked` per registered request under its lock, from ``register``
to the final event ``poll`` returns: what the engine acted on (``local``, the replica's agreed
phase; ``aborted``), what this rank's worker published (``latest``, with the reason, quiet and
settled flags the replica agreement reads) and, on P, how much of the request its outbox gave
the worker (``handed``) and the usage it reports with Success. It is the engine process's one
record of a request's transfer: an engine asks the peer (``tracks``, ``aborted``,
``PrefillPeer.handed``, ``room_request``) rather than keeping a copy (docs/pd.md, "One request,
its records").
"""

from __future__ import annotations

from dataclasses import dataclass

from tspd_core.ids import RequestId, Room
from tspd_core.pd.status import FailureCause, HandOver, TransferPoll, advance
from tspd_core.pd.wire import ipc

#: The metrics' name of each phase a tracked request is in (any other local state: failing).
PHASES = {TransferPoll.BOOTSTRAPPING: "bootstrapping", TransferPoll.BOOTSTRAPPED: "bootstrapped"}
FAILING = "failing"


@dataclass(slots=True)
class Tracked:
    """One admitted request, as the engine-side peer sees it."""

    rid: RequestId
    room: Room
    #: What the engine acted on: Bootstrapping, Bootstrapped, or Failed (the failing phase).
    local: TransferPoll = TransferPoll.BOOTSTRAPPING
    latest: TransferPoll = TransferPoll.BOOTSTRAPPING  #: what the worker published
    success: ipc.RoomUpdate | None = None  #: the worker's Success, with D's first token
    reason: str = ""  #: why it failed, once it did
    cause: str = ""
    quiet: bool = False  #: the worker: no write of the room touches this rank any more
    settled: bool = False  #: D's worker: a P rank pushed Failed (every P rank drained)
    #: The engine gave the request up (``abort``): it awaits only its final event.
    aborted: bool = False
    usage: tuple[int, float | None] | None = None  #: P: record_usage (cached, logprob)
    #: P: the outbox took ``usage`` for the final hand-over: ``record_usage`` is refused.
    usage_taken: bool = False
    #: P: how much of the request the outbox gave the worker (``PrefillPeer.handed``).
    handed: HandOver = HandOver.NOTHING

    @property
    def quiet_here(self) -> bool:
        """No write of the room touches this rank any more: the worker said so, or it
        reported Success (all of its writes of the room are done)."""
        return self.quiet or self.latest is TransferPoll.SUCCESS

    def absorb(self, update: ipc.RoomUpdate) -> None:
        """Fold the worker's update in (wire.md §1's rule: forward only, Failed sticky; the
        first failure's reason and cause stay)."""
        before = self.latest
        self.latest = advance(self.latest, update.status)
        if self.latest is TransferPoll.FAILED:
            if before is not TransferPoll.FAILED:
                self.reason = update.reason or "failed"
                self.cause = update.cause
            self.quiet |= update.quiet
        self.settled |= update.settled  # D: even after a local Success (for the other ranks)
        if update.status is TransferPoll.SUCCESS and self.success is None:
            self.success = update

    def worker_lost(self, reason: str) -> None:
        """The worker died: it writes nothing more, so the room is quiet; a Success stays."""
        if not self.latest.is_final:
            self.latest = TransferPoll.FAILED
            self.reason = f"transfer worker lost: {reason}"
            self.cause = FailureCause.WORKER_LOST
