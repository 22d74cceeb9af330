"""The P side of PD inside the engine loop: one :class:`PrefillLink` per rank.

Life of a PREFILL_ONLY request with a room (every rank does the same, in the same round)::

    submit ─► peer.register (room tracked; request queued but blocked)
    poll: Bootstrapped (D's pages are ready) ─► core.unblock ─► admitted, prefilled (chunked)
    on_prefill_done ─► outbox.stage + hand_over(first token) ─► the worker writes the KV
    poll: Succeeded ─► core.release_held (pages back)      poll: Failed ─► release / fail

A client abort before the hand-over aborts the room (the worker pushes Failed to D at once);
after it, the transfer is left to finish and the pages are released by its final event, so a
write never reads a page that another request already reuses.
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
    PrefillOutbox,
    PrefillPeer,
    PrefillPeerConfig,
    RemoteDecodeRow,
    Succeeded,
    ipc,
)
from tspd_core.sched import PageArray
from tspd_engine.core import EngineCore
from tspd_engine.frames import FinishReason, RequestMode
from tspd_engine.hooks import PdHooks
from tspd_engine.pdlink.common import peer_kwargs, replica_mesh
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.sequence import Sequence

log = logging.getLogger(__name__)


class EnginePrefillPeer(PrefillPeer):
    """A :class:`PrefillPeer` that can also give up a room before any of its KV was handed
    over (a client abort). The worker then fails the room at once — no write reads its pages —
    pushes Failed to the D ranks, and ``poll`` reports Failed on every rank."""

    def abort(self, rid: RequestId, reason: str) -> None:
        with self._lock:
            room = self._lookup(rid).room
        self._worker.send(ipc.ReleaseRoom(room, reason))


class PrefillLink(PdHooks):
    """Joins one P rank's engine core to its transfer peer (see the module docstring)."""

    def __init__(self, core: EngineCore, peer: EnginePrefillPeer, outbox: PrefillOutbox) -> None:
        self.core = core
        self.peer = peer
        self.outbox = outbox
        self.mesh = replica_mesh(core.tp)
        self.rooms: dict[str, int] = {}  # tracked by the peer: rid -> room
        self.handed: set[str] = set()  # KV handed to the worker: pages wait for the verdict
        self.dropped: set[str] = set()  # aborted by the client before the hand-over
        self.ok = 0
        self.failed = 0
        self.kv_seconds = 0.0  # hand-over -> Succeeded, summed
        self._handed_at: dict[str, float] = {}

    @classmethod
    def start(cls, core: EngineCore, cfg: PdConfig) -> PrefillLink:
        """Start this rank's peer (its worker registers the rank with the bootstrap server)."""
        kwargs = peer_kwargs(core.arena.contract, core.arena.tensor, core.tp, cfg)
        peer_cfg = PrefillPeerConfig(bootstrap_url=cfg.bootstrap, **kwargs)
        peer, outbox = EnginePrefillPeer.start(peer_cfg)
        assert isinstance(peer, EnginePrefillPeer)
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
            self.peer.abort(RequestId(rid), f"hand-over refused: {exc}")
            return
        self.handed.add(rid)
        self._handed_at[rid] = time.monotonic()

    def on_abort(self, rid: str) -> bool:
        if rid not in self.rooms:
            return False
        if rid in self.handed:
            return True  # a write may read the pages: they go back on the final event
        if rid not in self.dropped:
            self.dropped.add(rid)
            self.peer.abort(RequestId(rid), "aborted by the client")
        return False

    def has_pending(self) -> bool:
        return self.peer.has_in_flight()

    def stats(self) -> dict[str, float]:
        values = {
            "pd_rooms_tracked": float(self.peer.tracked_count()),
            "pd_transfers_ok": float(self.ok),
            "pd_transfers_failed": float(self.failed),
            "pd_transfer_seconds_sum": self.kv_seconds,
        }
        try:
            counters = self.peer.counters(timeout_s=2.0)
        except PdError as exc:
            log.warning("transfer worker counters unavailable: %s", exc)
            return values | {"pd_worker_alive": 0.0}
        worker = {f"pd_worker_{k}": v for k, v in counters.items()}
        return values | {"pd_worker_alive": 1.0} | worker

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
