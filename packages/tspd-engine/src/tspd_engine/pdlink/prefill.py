"""The P side of PD inside the engine loop: one :class:`PrefillLink` per rank.

Life of a PREFILL_ONLY request with a room (every rank does the same, in the same round)::

    submit ─► peer.register (room tracked) ─► admitted, prefilled (chunked) at once
    on_prefill_done ─► outbox.stage + hand_over(first token) ─► the worker holds the chunk
    poll: Bootstrapped (D's pages are ready) — the worker has written the KV meanwhile
    poll: Succeeded ─► loop.release_held (pages back)      poll: Failed ─► release / fail

So P's forward overlaps D's look-up and pre-allocation (``PdConfig.prefill_early``). With
``prefill_early=False``, or layerwise streaming, the request waits in the queue, blocked,
until Bootstrapped (``loop.unblock``): no pages or compute before D's pages are ready.

With layerwise streaming (``PdConfig.layerwise_interval`` > 0) each prefill chunk is armed
before its forward instead and goes out a few layers at a time while the forward runs
(:mod:`.layerwise`); the hand-over after the final chunk then only carries the first token::

    before_prefill(rows) ─► arm_layerwise(PD rows) ─ forward: counter.advance() per layer
    on_prefill_done ─► hand_over_remote_decode({rid: first token}) ─► Success to D

A client abort aborts the room (``TransferPeer.abort``: the D ranks get Failed pushed). A room
no request holds — one the node refused at its door or the engine refused at submit, or one a
router gave up before the node saw its request — is failed through ``on_abort_room``
(``PrefillPeer.abort_room``), so a D that pre-allocated it frees its pages at once.
Before the hand-over (or, layerwise, before the first armed chunk) the request's pages go
back at once (no write reads them); after it they stay held until the room's Failed event,
which the worker sends only once the writes in flight drained, so a write never reads a page
that another request already reuses.
"""

from __future__ import annotations

import collections.abc
import logging
import time
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from tspd_core import trace
from tspd_core.ids import RequestId, Room
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    Failed,
    FirstToken,
    PdError,
    PdEvent,
    PeerError,
    PrefillOutbox,
    PrefillPeer,
    PrefillPeerConfig,
    RemoteDecodeRow,
    Succeeded,
)
from tspd_core.sched import PageArray
from tspd_engine.frames import FinishReason, RequestMode
from tspd_engine.loop.core import EngineCore
from tspd_engine.loop.hooks import LoopControl, PrefillRow
from tspd_engine.loop.sequence import Sequence
from tspd_engine.model.tp import TpGroup
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.pdlink.layerwise import CounterStream
from tspd_engine.pdlink.peer import PeerTransfers, TransferHooks, half_refusal, peer_kwargs
from tspd_serving.errors import ConfigError

log = logging.getLogger(__name__)


class PrefillPhase(IntEnum):
    """How far a P request's KV has gone; ordered, and a record never moves back."""

    REGISTERED = 0  #: the peer tracks the room; the request waits (blocked) for D's pages
    ARMED = 1  #: layerwise: a chunk's forward was armed, so the worker reads its pages
    FINAL_ARMED = 2  #: layerwise: the final chunk was armed too
    HANDED = 3  #: the first token (and, not layerwise, the KV) went to the worker


@dataclass(slots=True)
class PrefillRequest:
    """The link's one record of a PD prefill, from its submit to its room's final event."""

    room: int
    prompt_len: int
    #: Queued blocked until Bootstrapped (else admitted at once: ``PdConfig.prefill_early``).
    blocked: bool = False
    phase: PrefillPhase = PrefillPhase.REGISTERED
    #: The room was aborted (by the client, or a refused arming or hand-over): only its final
    #: event is awaited, and nothing more of it is armed or handed over.
    aborted: bool = False
    handed_at: float | None = None

    def advance(self, phase: PrefillPhase) -> None:
        assert phase >= self.phase, f"room {self.room}: {self.phase.name} -> {phase.name}"
        self.phase = phase

    @property
    def pages_in_use(self) -> bool:
        """Whether a transfer may read the request's pages (they wait for the final event)."""
        return self.phase >= PrefillPhase.ARMED


class PrefillLink(TransferHooks[PrefillPeer]):
    """Joins one P rank's engine loop to its transfer peer (see the module docstring)."""

    def __init__(
        self,
        loop: LoopControl,
        peer: PrefillPeer,
        outbox: PrefillOutbox,
        tp: TpGroup,
        early: bool = True,
    ) -> None:
        self.loop = loop
        self.transfers = PeerTransfers(peer, tp)
        self.outbox = outbox
        #: Prefill before Bootstrapped (never while streaming layerwise: arming needs D).
        self.early = early and not outbox.streams_layerwise()
        self.requests: dict[str, PrefillRequest] = {}  # rid -> record, until the final event
        self._rooms: set[int] = set()  # the records' rooms
        #: Prefilled this round, handed over after it (rid, first token, pages, cached).
        self._done: list[tuple[str, int, PageArray, int]] = []

    @property
    def peer(self) -> PrefillPeer:
        return self.transfers.peer

    @classmethod
    def start(cls, core: EngineCore, cfg: PdConfig) -> PrefillLink:
        """Start this rank's peer (its worker registers the rank with the bootstrap server)."""
        kwargs = peer_kwargs(core.arena.contract, core.arena.tensor, core.tp, cfg)
        peer_cfg = PrefillPeerConfig(
            bootstrap_url=cfg.bootstrap, layerwise_interval=cfg.layerwise_interval, **kwargs
        )
        peer, outbox = PrefillPeer.start(peer_cfg)
        layers = core.model_cfg.num_hidden_layers
        if outbox.streams_layerwise() and outbox.producer_steps != layers:
            peer.shutdown()  # the model advances the counter once per layer: they must agree
            raise ConfigError(f"{outbox.producer_steps} producer steps for {layers} layers")
        return cls(core, peer, outbox, core.tp, cfg.prefill_early)

    # -- hooks ------------------------------------------------------------------------------

    def on_submit(self, seq: Sequence) -> str:
        problem = half_refusal(seq, RequestMode.PREFILL_ONLY, self._rooms)
        if problem or seq.mode != RequestMode.PREFILL_ONLY or seq.pd is None:
            return problem  # refused, or colocated: runs here as on any engine
        info = BootstrapInfo(seq.pd.bootstrap_host, seq.pd.bootstrap_port, Room(seq.pd.room))
        try:
            self.peer.register(RequestId(seq.rid), info)
        except PeerError as exc:
            self.transfers.broken = str(exc)
            return f"this node's PD transfer worker is down: {exc}"
        except PdError as exc:
            return f"the PD peer refused the request: {exc}"
        self.requests[seq.rid] = PrefillRequest(seq.pd.room, len(seq.prompt), not self.early)
        self._rooms.add(seq.pd.room)
        trace.mark(seq.rid, "p.registered")
        return ""

    def holds_prefill(self) -> bool:
        return not self.early

    def on_round(self, loop: LoopControl) -> None:
        for event in self.transfers.poll():
            self._on_event(event)

    def before_prefill(self, rows: collections.abc.Sequence[PrefillRow]) -> CounterStream | None:
        if not self.outbox.streams_layerwise():
            return None
        mine = [r for r in rows if (req := self.requests.get(r.rid)) and not req.aborted]
        # A room the replica is failing (agreed, no event yet) is left out on every rank.
        armable = [r for r in mine if self.peer.armable(RequestId(r.rid))]
        if not armable:
            return None  # nothing armed, nothing reserved: the forward runs as it would
        try:
            self.outbox.arm_layerwise(
                [_chunk(r.rid, r.pages, r.start, r.end, r.final) for r in armable]
            )
        except PeerError as exc:
            # Every room fails at the next poll; the steps were reserved, so count them.
            self.transfers.broken = str(exc)
            return CounterStream(self.outbox.step_counter)
        except PdError as exc:  # refused before anything was armed or reserved
            log.error("cannot arm a prefill forward's KV: %s", exc)
            for r in armable:
                self._abort(r.rid, f"layerwise arming refused: {exc}")
            return None
        for r in armable:
            phase = PrefillPhase.FINAL_ARMED if r.final else PrefillPhase.ARMED
            self.requests[r.rid].advance(phase)
        return CounterStream(self.outbox.step_counter)

    def on_prefill_done(self, rid: str, first_token: int, pages: PageArray) -> None:
        if rid in self.requests:  # (else a PREFILL_ONLY request without a room, by hand)
            self._done.append((rid, first_token, pages.copy(), self.loop.cached_tokens(rid)))

    def after_round(self) -> None:
        # The round's first tokens went out first: the worker's wake-up (it plans and writes
        # at once) would otherwise compete with their way to the client (docs/engine.md).
        done, self._done = self._done, []
        for rid, first_token, pages, cached in done:
            req = self.requests.get(rid)
            if req is not None and not req.aborted:  # an aborted one's pages went back
                self._hand_over(rid, req, first_token, pages, cached)

    def _hand_over(
        self, rid: str, req: PrefillRequest, first_token: int, pages: PageArray, cached: int
    ) -> None:
        token = {RequestId(rid): FirstToken(first_token, cached_tokens=cached)}
        layerwise = self.outbox.streams_layerwise()
        if layerwise and req.phase < PrefillPhase.FINAL_ARMED:
            # Its last chunk was left out (its room is failing): the Failed event frees it.
            self._abort(rid, "its final chunk was not streamed")
            return
        try:
            if not layerwise:
                self.outbox.stage_remote_decode([_chunk(rid, pages, 0, req.prompt_len, True)])
            self.outbox.hand_over_remote_decode(token)  # layerwise: only the token goes
        except PdError as exc:
            # Nothing was handed over: the room is aborted, the pages released on Failed.
            log.error("request %s: cannot hand its KV over: %s", rid, exc)
            self._abort(rid, f"hand-over refused: {exc}")
            return
        req.advance(PrefillPhase.HANDED)
        req.handed_at = time.monotonic()
        trace.mark(rid, "p.handed")

    def on_abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None:
            return False
        self._abort(rid, "aborted by the client")
        return req.pages_in_use  # a write may read the pages: they go on the final event

    def _abort(self, rid: str, reason: str) -> None:
        """Abort the room once (later reasons change nothing: it is failing already)."""
        req = self.requests[rid]
        if not req.aborted:
            req.aborted = True
            self.transfers.abort(rid, reason)

    def on_abort_room(self, room: int, reason: str) -> None:
        """Fail a room no request of this link holds (see ``PdHooks.on_abort_room``): its
        worker pushes Failed to every D rank that pre-allocated it, now or when a
        pre-allocation comes later (``PrefillPeer.abort_room``). A room one of the requests
        holds is left alone: whoever knows a room must not end the request that owns it
        (its own abort does, by rid). Every rank decides the same (the records are shared
        state), and nothing of the scheduler changes."""
        if room in self._rooms:
            log.info("room %d: not aborted, a request of this replica holds it", room)
            return
        try:
            self.peer.abort_room(Room(room), reason)
        except PeerError as exc:  # a dead worker: its rooms fail anyway
            self.transfers.broken = str(exc)

    def has_pending(self) -> bool:
        return self.peer.has_in_flight()

    def stats(self) -> dict[str, float]:
        return self.transfers.stats()

    def close(self) -> None:
        self.transfers.close()

    # -- events -----------------------------------------------------------------------------

    def _on_event(self, event: PdEvent) -> None:
        rid = str(event.rid)
        trace.mark(rid, "p.event", type(event).__name__)
        if isinstance(event, Bootstrapped):
            req = self.requests[rid]
            if req.blocked and not req.aborted:
                req.blocked = False
                self.loop.unblock(rid)
            return
        req = self.requests.pop(rid)
        self._rooms.discard(req.room)
        if isinstance(event, Succeeded):
            self.transfers.ok += 1
            self.transfers.seconds += (
                time.monotonic() - req.handed_at if req.handed_at is not None else 0.0
            )
        elif isinstance(event, Failed):
            self.transfers.failed += 1
            if req.phase < PrefillPhase.HANDED:
                self.loop.fail(rid, f"KV transfer failed: {event.reason}", FinishReason.TRANSFER)
        if self.loop.is_held(rid):
            self.loop.release_held(rid)


def _chunk(rid: str, pages: PageArray, start: int, end: int, final: bool) -> RemoteDecodeRow:
    return RemoteDecodeRow(RequestId(rid), pages.astype(np.int64), start, end, final)
