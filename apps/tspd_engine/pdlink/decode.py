"""The D side of PD inside the engine loop: one :class:`DecodeLink` per rank.

Life of a REMOTE_DECODE request with a room (every rank does the same, in the same round)::

    submit (room reserved) ─► admitted with remote KV (D's prefix hit, pages allocated)
      ─► peer.register (looks P up through its bootstrap server, registers with P ranks)
    poll: Bootstrapped ─► outbox.stage (zeroes the new pages) ─► hand over: manifest to P
    poll: RemotePrefill(first token) ─► core.start_remote_decode ─► decode rounds
    poll: Failed ─► core.fail(TRANSFER): pages released, the client gets the reason

Once a request is registered, a P rank may write into its pages until the room ends, so a
client abort (``TransferPeer.abort``) answers the client at once but keeps the pages
(``PdHooks.on_abort``) until the room's final event: at once for a room whose manifest is not
out yet, else when P answers (or, P being dead, after D's waiting timeout).
"""

from __future__ import annotations

import logging
import time

from tspd_core.ids import RequestId, Room
from tspd_core.layout import build_manifest
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    DecodePeer,
    DecodePeerConfig,
    Failed,
    PdError,
    PdEvent,
    PeerError,
    RemotePrefill,
    RemotePrefillRow,
)
from tspd_core.sched.request import Admission
from tspd_engine.core import EngineCore
from tspd_engine.frames import FinishReason, RequestMode
from tspd_engine.hooks import PdHooks
from tspd_engine.pdlink.common import distinct_shards, page_bytes, peer_kwargs, replica_mesh
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.sequence import Sequence

log = logging.getLogger(__name__)


class DecodeLink(PdHooks):
    """Joins one D rank's engine core to its transfer peer (see the module docstring)."""

    def __init__(self, core: EngineCore, peer: DecodePeer, outbox: DecodeOutbox) -> None:
        self.core = core
        self.peer = peer
        self.outbox = outbox
        self.mesh = replica_mesh(core.tp)
        contract = core.arena.contract
        self.contract = contract
        self.replica_page_bytes = page_bytes(contract) * distinct_shards(contract)
        self.rooms: dict[str, int] = {}  # reserved at submit: rid -> room
        self.admitted: dict[str, Admission] = {}  # registered with the peer
        self.dropped: set[str] = set()  # aborted by the client while registered
        self.staged: set[str] = set()  # manifest staged, its pages being zeroed
        self.published: set[str] = set()  # manifest handed to the worker: P may write
        self.broken = ""  # why the transfer worker is unusable ("" while it works)
        self._registered_at: dict[str, float] = {}
        self.ok = 0
        self.failed = 0
        self.kv_pages = 0
        self.kv_seconds = 0.0

    @classmethod
    def start(cls, core: EngineCore, cfg: PdConfig) -> DecodeLink:
        """Start this rank's peer (its transfer worker registers the arena with Mooncake)."""
        kwargs = peer_kwargs(core.arena.contract, core.arena.tensor, core.tp, cfg)
        peer, outbox = DecodePeer.start(DecodePeerConfig(**kwargs))
        return cls(core, peer, outbox)

    # -- hooks ------------------------------------------------------------------------------

    def on_submit(self, seq: Sequence) -> str:
        if seq.mode == RequestMode.PREFILL_ONLY:
            return "this is a decode node: it does not take PREFILL_ONLY requests"
        if seq.mode != RequestMode.REMOTE_DECODE:
            return ""
        if seq.pd is None:
            return "a REMOTE_DECODE request needs its room and bootstrap address (pd)"
        if seq.pd.room in self.rooms.values():
            return f"room {seq.pd.room} is already in use on this node"
        self.rooms[seq.rid] = seq.pd.room
        return ""

    def on_remote_admitted(self, rid: str, admission: Admission) -> None:
        if rid not in self.rooms:
            return  # a REMOTE_DECODE request without a room (driven by hand)
        pd = self.core.running[rid].pd
        assert pd is not None
        try:
            info = BootstrapInfo(pd.bootstrap_host, pd.bootstrap_port, Room(pd.room))
            self.peer.register(RequestId(rid), info)
        except PdError as exc:
            if isinstance(exc, PeerError):
                self.broken = str(exc)
            del self.rooms[rid]
            self.core.fail(rid, f"KV transfer failed: {exc}", FinishReason.TRANSFER)
            return
        self.admitted[rid] = admission
        self._registered_at[rid] = time.monotonic()

    def on_round(self, core: EngineCore) -> None:
        for event in self.peer.poll(self.mesh):
            self._on_event(event)
        if self.outbox.remote_prefill_pending():
            # On CUDA a manifest waits for its zeroing kernels; on CPU it goes at once.
            self.outbox.hand_over_remote_prefill()
        if self.staged and not self.outbox.remote_prefill_pending():
            self.published |= self.staged
            self.staged.clear()

    def on_abort(self, rid: str) -> bool:
        if rid not in self.admitted:
            self.rooms.pop(rid, None)  # still queued: nothing was asked of any peer
            return False
        if rid not in self.dropped:
            self.dropped.add(rid)
            try:
                self.peer.abort(RequestId(rid), "aborted by the client")
            except PeerError as exc:
                self.broken = str(exc)  # a dead worker fails every room at the next poll
        return True  # registered: P may write into its pages until the room ends

    def has_pending(self) -> bool:
        return self.peer.has_in_flight() or self.outbox.remote_prefill_pending()

    def stats(self) -> dict[str, float]:
        return {
            "pd_peer_ok": float(not self.broken and self.peer.worker_lost is None),
            "pd_rooms_tracked": float(self.peer.tracked_count()),
            "pd_rooms_published": float(len(self.published)),
            "pd_transfers_ok": float(self.ok),
            "pd_transfers_failed": float(self.failed),
            "pd_kv_pages_in": float(self.kv_pages),
            "pd_kv_bytes_in": float(self.kv_pages * self.replica_page_bytes),
            "pd_transfer_seconds_sum": self.kv_seconds,
        }

    def close(self) -> None:
        self.peer.shutdown()

    # -- events -----------------------------------------------------------------------------

    def _on_event(self, event: PdEvent) -> None:
        rid = str(event.rid)
        if isinstance(event, Bootstrapped):
            if rid not in self.dropped:
                self._publish(rid)
            return
        adm = self.admitted.pop(rid)
        self.rooms.pop(rid, None)
        self.staged.discard(rid)
        self.published.discard(rid)
        started = self._registered_at.pop(rid)
        if rid in self.dropped:
            self.dropped.discard(rid)
            self.core.release_held(rid)
        elif isinstance(event, RemotePrefill):
            self._start(rid, event, adm, started)
        elif isinstance(event, Failed):
            self.failed += 1
            self.core.fail(rid, f"KV transfer failed: {event.reason}", FinishReason.TRANSFER)

    def _publish(self, rid: str) -> None:
        """Zero the request's new pages and publish its destination manifest."""
        adm = self.admitted[rid]
        tables = dict.fromkeys(self.contract.group_ids(), adm.pages)
        manifest = build_manifest(self.contract, tables, adm.prefix_tokens, adm.prompt_len)
        self.outbox.stage_remote_prefill([RemotePrefillRow(RequestId(rid), manifest)])
        self.staged.add(rid)

    def _start(self, rid: str, event: RemotePrefill, adm: Admission, started: float) -> None:
        token = event.first_token
        if not 0 <= token < self.core.model_cfg.vocab_size:
            self.failed += 1
            why = f"KV transfer failed: P sent first token {token}, outside the vocabulary"
            self.core.fail(rid, why, FinishReason.TRANSFER)
            return
        self.ok += 1
        self.kv_pages += len(adm.new_pages)
        self.kv_seconds += time.monotonic() - started
        self.core.start_remote_decode(rid, token)
