"""The P side of PD inside the engine loop: one :class:`PrefillLink` per rank.

Life of a PREFILL_ONLY request with a room (every rank does the same, in the same round)::

    submit ─► peer.register (room tracked; request queued but blocked)
    poll: Bootstrapped (D's pages are ready) ─► core.unblock ─► admitted, prefilled (chunked)
    on_prefill_done ─► outbox.stage + hand_over(first token) ─► the worker writes the KV
    poll: Succeeded ─► core.release_held (pages back)      poll: Failed ─► release / fail

With layerwise streaming (``PdConfig.layerwise_interval`` > 0) each prefill chunk is armed
before its forward instead and goes out a few layers at a time while the forward runs
(:mod:`.layerwise`); the hand-over after the final chunk then only carries the first token::

    before_prefill(rows) ─► arm_layerwise(PD rows) ─ forward: counter.advance() per layer
    on_prefill_done ─► hand_over_remote_decode({rid: first token}) ─► Success to D

A client abort aborts the room (``TransferPeer.abort``: the D ranks get Failed pushed).
Before the hand-over (or, layerwise, before the first armed chunk) the request's pages go
back at once (no write reads them); after it they stay held until the room's Failed event,
which the worker sends only once the writes in flight drained, so a write never reads a page
that another request already reuses.
"""

from __future__ import annotations

import collections.abc
import logging
import time

import numpy as np

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
from tspd_engine.core import EngineCore
from tspd_engine.errors import ConfigError
from tspd_engine.frames import FinishReason, RequestMode
from tspd_engine.hooks import PdHooks, PrefillRow
from tspd_engine.pdlink.common import peer_kwargs, replica_mesh
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.pdlink.layerwise import CounterStream
from tspd_engine.sequence import Sequence

log = logging.getLogger(__name__)


class PrefillLink(PdHooks):
    """Joins one P rank's engine core to its transfer peer (see the module docstring)."""

    def __init__(self, core: EngineCore, peer: PrefillPeer, outbox: PrefillOutbox) -> None:
        self.core = core
        self.peer = peer
        self.outbox = outbox
        self.mesh = replica_mesh(core.tp)
        self.rooms: dict[str, int] = {}  # tracked by the peer: rid -> room
        self.handed: set[str] = set()  # KV handed to the worker: pages wait for the verdict
        self.streaming: set[str] = set()  # layerwise: a chunk was armed (the worker reads pages)
        self.streamed_final: set[str] = set()  # layerwise: the final chunk was armed
        self.dropped: set[str] = set()  # room aborted (by the client, or refused arming)
        self.broken = ""  # why the transfer worker is unusable ("" while it works)
        self.ok = 0
        self.failed = 0
        self.kv_seconds = 0.0  # hand-over -> Succeeded, summed
        self._handed_at: dict[str, float] = {}

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
        return cls(core, peer, outbox)

    # -- hooks ------------------------------------------------------------------------------

    def on_submit(self, seq: Sequence) -> str:
        if seq.mode == RequestMode.REMOTE_DECODE:
            return "this is a prefill node: it does not take REMOTE_DECODE requests"
        if seq.mode != RequestMode.PREFILL_ONLY:
            return ""  # colocated requests run here as on any engine
        if seq.pd is None:
            return "a PREFILL_ONLY request needs its room and bootstrap address (pd)"
        if seq.pd.room in self.rooms.values():
            return f"room {seq.pd.room} is already in use on this node"
        info = BootstrapInfo(seq.pd.bootstrap_host, seq.pd.bootstrap_port, Room(seq.pd.room))
        try:
            self.peer.register(RequestId(seq.rid), info)
        except PeerError as exc:
            self.broken = str(exc)
            return f"this node's PD transfer worker is down: {exc}"
        except PdError as exc:
            return f"the PD peer refused the request: {exc}"
        self.rooms[seq.rid] = seq.pd.room
        return ""

    def on_round(self, core: EngineCore) -> None:
        for event in self.peer.poll(self.mesh):
            self._on_event(event)

    def before_prefill(self, rows: collections.abc.Sequence[PrefillRow]) -> CounterStream | None:
        if not self.outbox.streams_layerwise():
            return None
        mine = [r for r in rows if r.rid in self.rooms and r.rid not in self.dropped]
        # A room the replica is failing (agreed, no event yet) is left out on every rank.
        pd = [r for r in mine if self.peer.armable(RequestId(r.rid))]
        if not pd:
            return None  # nothing armed, nothing reserved: the forward runs as it would
        chunks = [RemoteDecodeRow(RequestId(r.rid), r.pages.astype(np.int64), r.start, r.end,
                                  r.final) for r in pd]  # fmt: skip
        try:
            self.outbox.arm_layerwise(chunks)
        except PeerError as exc:
            self.broken = str(exc)  # every room fails at the next poll; the steps were reserved
            return CounterStream(self.outbox.step_counter)
        except PdError as exc:  # refused before anything was armed or reserved
            log.error("cannot arm a prefill forward's KV: %s", exc)
            for r in pd:
                self.dropped.add(r.rid)
                self._abort(r.rid, f"layerwise arming refused: {exc}")
            return None
        self.streaming.update(r.rid for r in pd)
        self.streamed_final.update(r.rid for r in pd if r.final)
        return CounterStream(self.outbox.step_counter)

    def on_prefill_done(self, rid: str, first_token: int, pages: PageArray) -> None:
        if rid not in self.rooms:
            return  # a PREFILL_ONLY request without a room (driven by hand)
        seq = self.core.held[rid]
        token = {RequestId(rid): FirstToken(first_token, cached_tokens=seq.cached)}
        if self.outbox.streams_layerwise() and rid not in self.streamed_final:
            # Its last chunk was left out (its room is failing): the Failed event frees it.
            if rid not in self.dropped:
                self._abort(rid, "its final chunk was not streamed")
            return
        try:
            if not self.outbox.streams_layerwise():
                n = len(seq.prompt)
                self.outbox.stage_remote_decode(
                    [RemoteDecodeRow(RequestId(rid), pages.astype(np.int64), 0, n, True)]
                )
            self.outbox.hand_over_remote_decode(token)  # layerwise: only the token goes
        except PdError as exc:
            # Nothing was handed over: the room is aborted, the pages released on Failed.
            log.error("request %s: cannot hand its KV over: %s", rid, exc)
            self._abort(rid, f"hand-over refused: {exc}")
            return
        self.handed.add(rid)
        self._handed_at[rid] = time.monotonic()

    def on_abort(self, rid: str) -> bool:
        if rid not in self.rooms:
            return False
        if rid not in self.dropped:
            self.dropped.add(rid)
            self._abort(rid, "aborted by the client")
        # A write may read the pages: they go on the final event.
        return rid in self.handed or rid in self.streaming

    def _abort(self, rid: str, reason: str) -> None:
        try:
            self.peer.abort(RequestId(rid), reason)
        except PeerError as exc:
            self.broken = str(exc)  # a dead worker fails every room at the next poll

    def has_pending(self) -> bool:
        return self.peer.has_in_flight()

    def stats(self) -> dict[str, float]:
        # Engine-side counts only: health checks ask for these every second, and the worker's
        # own counters (TransferPeer.counters) would cost a round trip to it on this thread.
        return {
            "pd_peer_ok": float(not self.broken and self.peer.worker_lost is None),
            "pd_rooms_tracked": float(self.peer.tracked_count()),
            "pd_transfers_ok": float(self.ok),
            "pd_transfers_failed": float(self.failed),
            "pd_transfer_seconds_sum": self.kv_seconds,
        }

    def close(self) -> None:
        self.peer.shutdown()

    # -- events -----------------------------------------------------------------------------

    def _on_event(self, event: PdEvent) -> None:
        rid = str(event.rid)
        if isinstance(event, Bootstrapped):
            if rid not in self.dropped:
                self.core.unblock(rid)
            return
        self.rooms.pop(rid, None)
        self.dropped.discard(rid)
        handed = rid in self.handed
        self.handed.discard(rid)
        self.streaming.discard(rid)
        self.streamed_final.discard(rid)
        started = self._handed_at.pop(rid, None)
        if isinstance(event, Succeeded):
            self.ok += 1
            self.kv_seconds += time.monotonic() - started if started is not None else 0.0
        elif isinstance(event, Failed):
            self.failed += 1
            if not handed:
                why = f"KV transfer failed: {event.reason}"
                self.core.fail(rid, why, FinishReason.TRANSFER)
        if rid in self.core.held:
            self.core.release_held(rid)
