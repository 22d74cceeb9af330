"""Callbacks through which other components (the PD peers) join the engine loop.

Every rank runs the same rounds in the same order, so a hook registered on every rank is
called on every rank at the same point of the same round: that is where a PD peer's ``poll``
(whose MIN all-reduce needs all ranks of the replica) belongs. Whatever a hook decides must
therefore depend only on state every rank shares (intake, agreed events), never on local
timing, or the ranks' schedulers diverge.

A hook sees the loop only through :class:`LoopControl`: the verdicts it may hand down and the
facts about a request it may ask for (the core implements it; this module, like the loop's
other parts, never imports the core).
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tspd_core.sched import PageArray
from tspd_core.sched.request import Admission
from tspd_engine.frames import FinishReason

if TYPE_CHECKING:
    from tspd_engine.loop.sequence import Sequence


class LoopControl(Protocol):
    """What a hook may ask of the engine loop (:class:`~tspd_engine.loop.core.EngineCore`
    implements it). Call it on the engine thread only, from a hook's callbacks."""

    def unblock(self, rid: str) -> None:
        """Let a blocked PD prefill be admitted (its room is Bootstrapped)."""
        ...

    def start_remote_decode(self, rid: str, first_token: int) -> None:
        """A REMOTE_DECODE request's prompt KV has arrived with ``first_token``: decode."""
        ...

    def release_held(self, rid: str) -> None:
        """Free the pages of a held request (its transfer can no longer touch them)."""
        ...

    def fail(self, rid: str, error: str, reason: FinishReason = FinishReason.ERROR) -> None:
        """End a request with ``error`` (e.g. TRANSFER when its KV transfer failed)."""
        ...

    def is_held(self, rid: str) -> bool:
        """Whether ``rid`` was answered but its pages are held (see ``PdHooks.on_abort``)."""
        ...

    def cached_tokens(self, rid: str) -> int:
        """Prompt tokens of a tracked request that its admission found in the prefix cache."""
        ...

    def prompt_len(self, rid: str) -> int:
        """The prompt length of a tracked request (what a PD prefill hands over)."""
        ...


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """One request's chunk in the next prefill forward: prompt tokens ``[start, end)``, the
    last chunk when ``final``; ``pages`` is its page table (covers ``end``)."""

    rid: str
    start: int
    end: int
    final: bool
    pages: PageArray


class LayerStream(Protocol):
    """A hook's view of one prefill forward, layer by layer (see :meth:`PdHooks.before_prefill`).

    ``after_layer(i)`` runs on the forward's thread right after layer ``i`` wrote its KV;
    ``close()`` runs once the forward ended — normally or by an exception — so a hook that
    counts layers can make up for the ones that never ran.
    """

    def after_layer(self, layer: int) -> None: ...

    def close(self) -> None: ...


class PdHooks:
    """No-op base; override what you need. Called on the engine thread, never concurrently.

    Ordering: ``on_submit`` when a request is about to be queued; ``on_round`` first in every
    round (before admission); ``on_remote_admitted`` right after the scheduler admits a
    REMOTE_DECODE request; ``before_prefill`` right before each prefill forward (its stream's
    ``after_layer`` during it, ``close`` after it); ``on_prefill_done`` right after a
    PREFILL_ONLY request's prompt KV is complete and its first token is known;
    ``after_round`` once the round's outputs went out; ``on_abort`` when a client aborts a
    request; ``on_abort_room`` when a room no request serves is given up (an intake event,
    or a PD prefill the engine refused).
    """

    def on_submit(self, seq: Sequence) -> str:
        """A request is about to join the queue: return ``""`` to accept it, or why it is
        refused (it then comes back at once as an ERROR output and is never queued)."""
        return ""

    def on_round(self, loop: LoopControl) -> None:
        """Start of every round: poll transfers, then call ``loop.start_remote_decode`` /
        ``loop.release_held`` / ``loop.unblock`` / ``loop.fail`` for the rooms that moved."""

    def on_remote_admitted(self, rid: str, admission: Admission) -> None:
        """A decode-side request holds its pages (``admission.pages``); the pages past its
        prefix hit (``admission.new_pages``) must be zeroed before KV is requested."""

    def before_prefill(self, rows: collections.abc.Sequence[PrefillRow]) -> LayerStream | None:
        """The next prefill forward will compute ``rows`` (every rank: the same rows in the
        same order). Return a :class:`LayerStream` to follow its layers (a PD prefill peer
        that streams KV layerwise arms its rows here), or None (the default: the forward
        runs without a per-layer callback, at no cost)."""
        return None

    def on_prefill_done(self, rid: str, first_token: int, pages: PageArray) -> None:
        """A prefill-side request is done; ``pages`` (its page table) stay held until
        ``loop.release_held(rid)``."""

    def after_round(self) -> None:
        """The round's outputs went out (rank 0 sent them; every rank calls this at the same
        point): what the hook deferred to keep it off their way goes now (a PD prefill
        peer hands its requests' KV to its transfer worker here, so that the worker's wake-up
        does not compete with the first tokens' way to the client)."""

    def on_abort(self, rid: str) -> bool:
        """A client aborts ``rid``. Return True when its pages may still be read or written
        by a transfer: the engine then answers the client at once but keeps the pages until
        the hook calls ``loop.release_held(rid)``. Unknown ids must return False."""
        return False

    def on_abort_room(self, room: int, reason: str) -> None:
        """Fail PD room ``room`` towards the other half: no request here serves it (the
        request that carried it was refused, or never came). A room one of the hook's
        requests holds must be left alone (``on_abort`` of that request ends it); an unknown
        room must be harmless. The default does nothing (only a prefill peer acts)."""

    def has_pending(self) -> bool:
        """Whether the hook still tracks work (rounds must keep running to poll it)."""
        return False

    def holds_prefill(self) -> bool:
        """Whether a PD prefill (PREFILL_ONLY with a room) waits in the queue, blocked, until
        the hook calls ``loop.unblock`` (its room is Bootstrapped); else it is admitted and
        prefilled at once."""
        return False

    def on_idle(self) -> None:
        """The loop is about to wait with nothing tracked: hand over anything deferred (a PD
        peer's releases of succeeded rooms ride with its next call, and there is none)."""

    def has_news(self) -> bool:
        """Whether the last round brought the hook events that may have follow-ups in the
        next round (a PD peer gives one event per request per round): the loop then runs
        the next round without waiting."""
        return False

    def wake_fds(self) -> list[int]:
        """Descriptors that turn readable when the hook has news (a PD peer's worker
        notes): the loop's wait for intake ends on them, and the next round (``on_round``)
        must drain them."""
        return []

    def stats(self) -> dict[str, float]:
        """Counters merged into ``EngineCore.stats()`` (prefix them with the hook's name)."""
        return {}

    def close(self) -> None:
        """The engine stops: release what the hook owns (peer workers, sockets)."""
