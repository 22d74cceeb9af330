"""D's room record inside the transfer worker, and the rule for when a failed room is quiet.

Room records belong to the control thread alone (no locks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tspd_core.ids import Room
from tspd_core.pd.decode.directory import Lookup
from tspd_core.pd.status import TransferPoll


@dataclass(slots=True)
class DRoom:
    """One room on this D rank."""

    room: Room
    address: str
    created: float
    status: TransferPoll = TransferPoll.BOOTSTRAPPING
    lookup: Lookup | None = None
    targets: frozenset[int] = frozenset()  #: P ranks whose Success completes the room
    arrived: set[int] = field(default_factory=set)
    token: int = -1
    spec_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    logprob: float | None = None
    published: float = 0.0  #: when the manifest went out (WaitingForInput); 0 = never
    #: A manifest handed over before the look-up finished: it goes out once Bootstrapped.
    manifest: str | None = None
    reason: str = ""
    cause: str = ""  #: a FailureCause value, once Failed
    answered: set[int] = field(default_factory=set)  #: P ranks that sent Success or Failed
    settled: bool = False  #: a P rank pushed Failed: no P rank writes the room any more
    gave_up: bool = False  #: a timeout or the heartbeat ended the wait for P's answers
    notified: tuple[bool, bool] | None = None  #: Failed: (quiet, settled) last told the engine

    @property
    def quiet(self) -> bool:
        """No P write of this room can still land in this rank's pages."""
        if self.status is TransferPoll.SUCCESS or not self.published:
            return True
        return self.settled or self.gave_up or self.answered >= self.targets
