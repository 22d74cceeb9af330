"""The P side of PD inside the engine loop: one :class:`PrefillLink` per rank.

Life of a PREFILL_ONLY request with a room (every rank does the same, in the same round)::

    submit ─► peer.register (room tracked; request queued but blocked)
    poll: Bootstrapped (D's pages are ready) ─► core.unblock ─► admitted, prefilled (chunked)
    on_prefill_done ─► outbox.stage + hand_over(first token) ─► the worker writes the KV
    poll: Succeeded ─► core.release_held (pages back)      poll: Failed ─► release / fail

A client abort aborts the room (``TransferPeer.abort``: the D ranks get Failed pushed).
Before the hand-over the request's pages go back at once (no write reads them); after it they
stay held until the room's Failed event, which the worker sends only once the writes in flight
drained, so a write never reads a page that another request already reuses.
"""

from __future__ import annotations

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
from tspd_engine.frames import FinishReason, RequestMode
from tspd_engine.hooks import PdHooks
from tspd_engine.pdlink.common import peer_kwargs, replica_mesh
from tspd_engine.pdlink.config import PdConfig
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
        self.dropped: set[str] = set()  # aborted by the client
        self.broken = ""  # why the transfer worker is unusable ("" while it works)
        self.ok = 0
        self.failed = 0
        self.kv_seconds = 0.0  # hand-over -> Succeeded, summed
        self._handed_at: dict[str, float] = {}

    @classmethod
    def start(cls, core: EngineCore, cfg: PdConfig) -> PrefillLink:
        """Start this rank's peer (its worker registers the rank with the bootstrap server)."""
        kwargs = peer_kwargs(core.arena.contract, core.arena.tensor, core.tp, cfg)
        peer_cfg = PrefillPeerConfig(bootstrap_url=cfg.bootstrap, **kwargs)
        peer, outbox = PrefillPeer.start(peer_cfg)
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

    def on_prefill_done(self, rid: str, first_token: int, pages: PageArray) -> None:
        if rid not in self.rooms:
            return  # a PREFILL_ONLY request without a room (driven by hand)
        seq = self.core.held[rid]
        row = RemoteDecodeRow(RequestId(rid), pages.astype(np.int64), 0, len(seq.prompt), True)
        token = FirstToken(first_token, cached_tokens=seq.cached)
        try:
            self.outbox.stage_remote_decode([row])
            self.outbox.hand_over_remote_decode({RequestId(rid): token})
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
        return rid in self.handed  # a write may read the pages: they go on the final event

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
