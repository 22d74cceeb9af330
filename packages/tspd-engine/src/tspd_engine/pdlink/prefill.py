"""The P side of PD inside the engine loop: one :class:`PrefillLink` per rank.

One PD prefill (PREFILL_ONLY with a room) has one record per process boundary, each holding
only what its owner acts on (docs/pd.md, "One request, its records")::

    engine process, engine thread   Sequence (loop/sequence.py): prompt, first token, what the
                                    client saw, blocked · the scheduler's slot: pages, state,
                                    prompt tokens prefilled
    engine process, the peer        Tracked (tspd_core.pd.peer.tracked), under the peer's
                                    lock: the room, its agreed state, aborted, how much the
                                    outbox handed over (HandOver), the usage for Success
    transfer worker process         PRoom (tspd_core.pd.prefill.state): D's destinations,
                                    held chunks, write jobs, the final chunk, Failed pushes

The link keeps no record of its own: it asks the peer (``tracks``, ``aborted``, ``handed``,
``room_request``) and the loop (``LoopControl``), and notes only when it handed a request over
(for ``pd_transfer_seconds_sum``). Life of such a request (every rank does the same, in the
same round)::

    submit ─► peer.register: Tracked (Bootstrapping, NOTHING handed) ─ TrackRoom ─► PRoom
          ─► admitted at once (a slot, prefix hit), prefilled in chunks
    on_prefill_done ─► the Sequence is held (answered: first token, LENGTH); its pages stay
    after_round ─► outbox.stage + hand_over(first token): Tracked DONE ─ SubmitChunk ─►
          PRoom: held until Bootstrapped, then planned and written
    poll: Bootstrapped (D's pages are ready; the worker wrote the KV meanwhile)
    poll: Succeeded ─► loop.release_held: the slot's pages go back, the Sequence goes;
          Tracked forgotten ─ ReleaseRoom ─► PRoom gone (a tombstone answers late frames)
    poll: Failed ─► loop.fail(TRANSFER) or, held, loop.release_held

So P's forward overlaps D's look-up and pre-allocation (``PdConfig.prefill_early``). With
``prefill_early=False`` the request waits in the queue, blocked, until Bootstrapped
(``loop.unblock``): no pages or compute before D's pages are ready.

With layerwise streaming (``PdConfig.layerwise_interval`` > 0) each prefill chunk is armed
before its forward instead and goes out a few layers at a time while the forward runs
(:mod:`.layerwise`); the hand-over after the final chunk then only carries the first token::

    before_prefill(rows) ─► arm_layerwise(PD rows): Tracked CHUNK / FINAL_CHUNK ─ ArmChunk
          ─► PRoom streams (held until Bootstrapped, early) ─ forward: counter.advance() per
          layer
    on_prefill_done ─► hand_over_remote_decode({rid: first token}): Tracked DONE ─
          BootstrapToken ─► PRoom: Success to D once the last interval is written

A client abort aborts the room (``TransferPeer.abort``: the D ranks get Failed pushed). A room
no request holds — one the node refused at its door or the engine refused at submit, or one a
router gave up before the node saw its request — is failed through ``on_abort_room``
(``PrefillPeer.abort_room``), so a D that pre-allocated it frees its pages at once.
While nothing of the request was handed to the worker (``HandOver.NOTHING``: before the
hand-over or, layerwise, the first armed chunk) its pages go back at once (no write reads
them); after that they stay held until the room's Failed event, which the worker sends only
once the writes in flight drained, so a write never reads a page that another request
already reuses.
"""

from __future__ import annotations

import collections.abc
import logging
import time

import numpy as np

from tspd_core import trace
from tspd_core.ids import RequestId, Room
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    Failed,
    FirstToken,
    HandOver,
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
        #: Prefill before Bootstrapped (layerwise too: the worker holds an armed chunk until
        #: D's pre-allocations arrive, then sends what the forward wrote meanwhile at once).
        self.early = early
        #: When each request's KV (layerwise: its first token) went to the worker, until its
        #: final event: the one fact of a request only the link knows (a metric).
        self._handed_at: dict[str, float] = {}
        #: Prefilled this round, handed over after it: (rid, first token, pages, prompt length).
        self._done: list[tuple[str, FirstToken, PageArray, int]] = []

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
        problem = half_refusal(seq, RequestMode.PREFILL_ONLY, self._room_in_use)
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
        trace.mark(seq.rid, "p.registered")
        return ""

    def _room_in_use(self, room: int) -> bool:
        return self.peer.room_request(Room(room)) is not None

    def holds_prefill(self) -> bool:
        return not self.early

    def on_round(self, loop: LoopControl) -> None:
        for event in self.transfers.poll():
            self._on_event(event)

    def before_prefill(self, rows: collections.abc.Sequence[PrefillRow]) -> CounterStream | None:
        if not self.outbox.streams_layerwise():
            return None
        # A room the replica is failing (agreed, no event yet) is left out on every rank, and
        # so is one this link aborted (the same on every rank too).
        armable = [r for r in rows if self._armable(RequestId(r.rid))]
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
        return CounterStream(self.outbox.step_counter)  # (the outbox noted what it armed)

    def _armable(self, rid: RequestId) -> bool:
        return self.peer.armable(rid, early=self.early) and not self.peer.aborted(rid)

    def on_prefill_done(self, rid: str, first_token: int, pages: PageArray) -> None:
        if self.peer.tracks(RequestId(rid)):  # (else a PREFILL_ONLY request without a room)
            first = FirstToken(first_token, cached_tokens=self.loop.cached_tokens(rid))
            self._done.append((rid, first, pages.copy(), self.loop.prompt_len(rid)))

    def after_round(self) -> None:
        # The round's first tokens went out first: the worker's wake-up (it plans and writes
        # at once) would otherwise compete with their way to the client (docs/engine.md).
        done, self._done = self._done, []
        for rid, first, pages, prompt_len in done:
            if not self.peer.aborted(RequestId(rid)):  # an aborted one's pages went back
                self._hand_over(rid, first, pages, prompt_len)

    def _hand_over(self, rid: str, first: FirstToken, pages: PageArray, prompt_len: int) -> None:
        layerwise = self.outbox.streams_layerwise()
        if layerwise and self.peer.handed(RequestId(rid)) < HandOver.FINAL_CHUNK:
            # Its last chunk was left out (its room is failing): the Failed event frees it.
            self._abort(rid, "its final chunk was not streamed")
            return
        try:
            if not layerwise:
                self.outbox.stage_remote_decode([_chunk(rid, pages, 0, prompt_len, True)])
            self.outbox.hand_over_remote_decode({RequestId(rid): first})  # layerwise: the token
        except PdError as exc:
            # Nothing was handed over: the room is aborted, the pages released on Failed.
            log.error("request %s: cannot hand its KV over: %s", rid, exc)
            self._abort(rid, f"hand-over refused: {exc}")
            return
        self._handed_at[rid] = time.monotonic()
        trace.mark(rid, "p.handed")

    def on_abort(self, rid: str) -> bool:
        if not self.peer.tracks(RequestId(rid)):
            return False
        self._abort(rid, "aborted by the client")
        # A write may read the pages once anything was handed over: they go on the final event.
        return self.peer.handed(RequestId(rid)) >= HandOver.CHUNK

    def _abort(self, rid: str, reason: str) -> None:
        """Abort the room once (later reasons change nothing: it is failing already)."""
        if not self.peer.aborted(RequestId(rid)):
            self.transfers.abort(rid, reason)

    def on_abort_room(self, room: int, reason: str) -> None:
        """Fail a room no request of this link holds (see ``PdHooks.on_abort_room``): its
        worker pushes Failed to every D rank that pre-allocated it, now or when a
        pre-allocation comes later (``PrefillPeer.abort_room``). A room one of the requests
        holds (the peer tracks it) is left alone: whoever knows a room must not end the
        request that owns it (its own abort does, by rid). Every rank decides the same (the
        peers track the same requests), and nothing of the scheduler changes."""
        if self._room_in_use(room):
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
            # Blocked until now (not early), unless aborted: then it left the queue already.
            if not self.early and not self.peer.aborted(event.rid):
                self.loop.unblock(rid)
            return
        # The final event: the peer forgot the request already.
        handed_at = self._handed_at.pop(rid, None)
        if isinstance(event, Succeeded):
            self.transfers.ok += 1
            if handed_at is not None:
                self.transfers.seconds += time.monotonic() - handed_at
        elif isinstance(event, Failed):
            self.transfers.failed += 1
            if not self.loop.is_held(rid):  # still queued or prefilling: it ends here
                self.loop.fail(rid, f"KV transfer failed: {event.reason}", FinishReason.TRANSFER)
        if self.loop.is_held(rid):  # answered already (prefilled, or aborted): pages back
            self.loop.release_held(rid)


def _chunk(rid: str, pages: PageArray, start: int, end: int, final: bool) -> RemoteDecodeRow:
    return RemoteDecodeRow(RequestId(rid), pages.astype(np.int64), start, end, final)
