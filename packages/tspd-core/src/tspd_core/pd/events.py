"""What the engine tells a peer about a request, and what ``poll`` tells the engine back.

Events are values: ``poll`` returns each one exactly once, in request-insertion order, and a
request is forgotten by the peer as soon as its final event (``Succeeded``, ``RemotePrefill``
or ``Failed``) was returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tspd_core.ids import MAX_ROOM, RequestId, Room
from tspd_core.pd.errors import UsageError


@dataclass(frozen=True, slots=True)
class BootstrapInfo:
    """Where a request's P instance is found: its bootstrap server and the request's room."""

    host: str
    port: int
    room: Room

    def __post_init__(self) -> None:
        if not self.host or not 1 <= self.port <= 65535:
            raise UsageError(f"bootstrap address {self.host!r}:{self.port} is not host:port")
        if not 0 <= self.room <= MAX_ROOM:
            raise UsageError(f"room {self.room} is outside 0..2**63-1")

    @property
    def address(self) -> str:
        """``host:port`` of the bootstrap server (the key D caches P's parallel info under)."""
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Bootstrapped:
    """P: every planned pre-allocation arrived, the scheduler may plan the prefill.
    D: the P ranks are known and registered with; the scheduler may allocate pages."""

    rid: RequestId


@dataclass(frozen=True, slots=True)
class Succeeded:
    """P: every write of the request completed on every destination; its pages may be freed."""

    rid: RequestId


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """D: the whole prompt's KV landed; decoding starts from ``first_token``."""

    rid: RequestId
    first_token: int  #: the token P sampled after the prompt, -1 if no P rank sent one
    spec_ids: tuple[int, ...] = ()  #: speculative candidates from P's draft round
    cached_tokens: int = 0  #: P's prefix-cache hit, max over the P ranks
    logprob: float | None = None  #: logprob of ``first_token`` if P sent one


@dataclass(frozen=True, slots=True)
class Failed:
    """The request's transfer failed on some rank of the replica; ``reason`` says why.

    It comes only once no write of the request can still touch its pages on any rank of the
    replica, so the engine may free them on it. ``cause`` (a
    :class:`~tspd_core.pd.status.FailureCause` value, for metrics) does not take part in
    equality: two Failed events with the same request and reason are the same event.
    """

    rid: RequestId
    reason: str
    cause: str = field(default="", compare=False)


PdEvent = Bootstrapped | Succeeded | RemotePrefill | Failed
