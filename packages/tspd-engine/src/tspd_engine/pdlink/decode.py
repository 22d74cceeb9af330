"""The D side of PD inside the engine loop: one :class:`DecodeLink` per rank.

Life of a REMOTE_DECODE request with a room (every rank does the same, in the same round)::

    submit (room reserved) ─► admitted with remote KV (D's prefix hit, pages allocated)
      ─► peer.register (looks P up through its bootstrap server, registers with P ranks)
    poll: Bootstrapped ─► outbox.stage (zeroes the new pages) ─► hand over: manifest to P
    poll: RemotePrefill(first token) ─► loop.start_remote_decode ─► decode rounds
    poll: Failed ─► loop.fail(TRANSFER): pages released, the client gets the reason

A replica of one rank stages and hands its manifest over right after ``register`` instead:
the worker sends it the moment its look-up finishes, so D's engine round (a whole decode
step on a busy node) is not on the critical path to P's prefill. With several ranks every
rank's look-up must succeed first (the Bootstrapped event), or a rank whose look-up failed
would leave P waiting for its pre-allocation, and the others' pages held, until P's
bootstrap timeout.

Once a request is registered, a P rank may write into its pages until the room ends, so a
client abort (``TransferPeer.abort``) answers the client at once but keeps the pages
(``PdHooks.on_abort``) until the room's final event: at once for a room whose manifest is not
out yet, else when P answers (or, P being dead, after D's waiting timeout).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from enum import IntEnum

from tspd_core import trace
from tspd_core.ids import RequestId, Room
from tspd_core.layout import CacheContract, build_manifest
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
from tspd_engine.frames import FinishReason, PdTarget, RequestMode
from tspd_engine.loop.core import EngineCore
from tspd_engine.loop.hooks import LoopControl
from tspd_engine.loop.sequence import Sequence
from tspd_engine.model.tp import TpGroup
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.pdlink.contract import distinct_shards, page_bytes
from tspd_engine.pdlink.peer import PeerTransfers, TransferHooks, half_refusal, peer_kwargs

log = logging.getLogger(__name__)


class DecodePhase(IntEnum):
    """How far a D request's room has gone; ordered, and a record never moves back."""

    RESERVED = 0  #: the room is reserved (request queued): nothing asked of any peer yet
    REGISTERED = 1  #: admitted and registered with the peer: P is being looked up
    STAGED = 2  #: Bootstrapped: the manifest is staged while its new pages are zeroed
    PUBLISHED = 3  #: the manifest went to P: P may write into the pages until the room ends


@dataclass(slots=True)
class DecodeRequest:
    """The link's one record of a PD decode, from its submit to its room's final event."""

    target: PdTarget
    phase: DecodePhase = DecodePhase.RESERVED
    #: The client aborted the room: its pages stay held until the final event.
    aborted: bool = False
    admission: Admission | None = None
    registered_at: float = 0.0

    def advance(self, phase: DecodePhase) -> None:
        assert phase >= self.phase, f"room {self.target.room}: {self.phase.name} -> {phase.name}"
        self.phase = phase


class DecodeLink(TransferHooks[DecodePeer]):
    """Joins one D rank's engine loop to its transfer peer (see the module docstring)."""

    def __init__(
        self,
        loop: LoopControl,
        peer: DecodePeer,
        outbox: DecodeOutbox,
        tp: TpGroup,
        contract: CacheContract,
        vocab_size: int,
    ) -> None:
        self.loop = loop
        self.transfers = PeerTransfers(peer, tp)
        self.outbox = outbox
        self.contract = contract
        self.vocab_size = vocab_size
        self.replica_page_bytes = page_bytes(contract) * distinct_shards(contract)
        self.requests: dict[str, DecodeRequest] = {}  # rid -> record, until the final event
        self.kv_pages = 0

    @property
    def peer(self) -> DecodePeer:
        return self.transfers.peer

    @classmethod
    def start(cls, core: EngineCore, cfg: PdConfig) -> DecodeLink:
        """Start this rank's peer (its transfer worker registers the arena with Mooncake)."""
        contract = core.arena.contract
        kwargs = peer_kwargs(contract, core.arena.tensor, core.tp, cfg)
        peer, outbox = DecodePeer.start(DecodePeerConfig(**kwargs))
        return cls(core, peer, outbox, core.tp, contract, core.model_cfg.vocab_size)

    # -- hooks ------------------------------------------------------------------------------

    def on_submit(self, seq: Sequence) -> str:
        problem = half_refusal(seq, RequestMode.REMOTE_DECODE, self._room_in_use)
        if not problem and seq.mode == RequestMode.REMOTE_DECODE and seq.pd is not None:
            self.requests[seq.rid] = DecodeRequest(seq.pd)
        return problem

    def _room_in_use(self, room: int) -> bool:
        return any(r.target.room == room for r in self.requests.values())

    def on_remote_admitted(self, rid: str, admission: Admission) -> None:
        req = self.requests.get(rid)
        if req is None:
            return  # a REMOTE_DECODE request without a room (driven by hand)
        # A replica of one rank publishes with the registration, in the same write to the
        # worker (one wake-up); the worker holds the manifest until its look-up finished.
        held = self.peer.batch() if self.transfers.solo else contextlib.nullcontext()
        try:
            with held:
                self._register(rid, req, admission)
        except PeerError as exc:  # the held write at the block's end: the worker is gone
            self.transfers.broken = str(exc)  # (the next poll fails the request)

    def _register(self, rid: str, req: DecodeRequest, admission: Admission) -> None:
        pd = req.target
        try:
            info = BootstrapInfo(pd.bootstrap_host, pd.bootstrap_port, Room(pd.room))
            self.peer.register(RequestId(rid), info)
        except PdError as exc:
            if isinstance(exc, PeerError):
                self.transfers.broken = str(exc)
            del self.requests[rid]
            self.loop.fail(rid, f"KV transfer failed: {exc}", FinishReason.TRANSFER)
            return
        req.advance(DecodePhase.REGISTERED)
        req.admission, req.registered_at = admission, time.monotonic()
        trace.mark(rid, "d.registered")
        if self.transfers.solo:
            try:
                self._publish(rid)
                self._hand_over()
            except PeerError as exc:  # the worker is gone: the next poll fails the request
                self.transfers.broken = str(exc)

    def on_round(self, loop: LoopControl) -> None:
        for event in self.transfers.poll():
            self._on_event(event)
        self._hand_over()

    def _hand_over(self) -> None:
        if self.outbox.remote_prefill_pending():
            # On CUDA a manifest waits for its zeroing kernels; on CPU it goes at once.
            self.outbox.hand_over_remote_prefill()
        if not self.outbox.remote_prefill_pending():
            for req in self.requests.values():
                if req.phase == DecodePhase.STAGED:
                    req.advance(DecodePhase.PUBLISHED)

    def on_abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.phase < DecodePhase.REGISTERED:
            self.requests.pop(rid, None)  # still queued: nothing was asked of any peer
            return False
        if not req.aborted:
            req.aborted = True
            self.transfers.abort(rid, "aborted by the client")
        return True  # registered: P may write into its pages until the room ends

    def has_pending(self) -> bool:
        return self.peer.has_in_flight() or self.outbox.remote_prefill_pending()

    def stats(self) -> dict[str, float]:
        published = sum(r.phase == DecodePhase.PUBLISHED for r in self.requests.values())
        return self.transfers.stats() | {
            "pd_rooms_published": float(published),
            "pd_kv_pages_in": float(self.kv_pages),
            "pd_kv_bytes_in": float(self.kv_pages * self.replica_page_bytes),
        }

    def close(self) -> None:
        self.transfers.close()

    # -- events -----------------------------------------------------------------------------

    def _on_event(self, event: PdEvent) -> None:
        rid = str(event.rid)
        trace.mark(rid, "d.event", type(event).__name__)
        if isinstance(event, Bootstrapped):
            req = self.requests[rid]
            if not req.aborted and req.phase < DecodePhase.STAGED:
                self._publish(rid)
            return
        req = self.requests.pop(rid)
        if req.aborted:
            self.loop.release_held(rid)
        elif isinstance(event, RemotePrefill):
            self._start(rid, event, req)
        elif isinstance(event, Failed):
            self.transfers.failed += 1
            self.loop.fail(rid, f"KV transfer failed: {event.reason}", FinishReason.TRANSFER)

    def _publish(self, rid: str) -> None:
        """Zero the request's new pages and publish its destination manifest."""
        req = self.requests[rid]
        adm = req.admission
        assert adm is not None, f"request {rid!r}: Bootstrapped before it was registered"
        tables = dict.fromkeys(self.contract.group_ids(), adm.pages)
        manifest = build_manifest(self.contract, tables, adm.prefix_tokens, adm.prompt_len)
        self.outbox.stage_remote_prefill([RemotePrefillRow(RequestId(rid), manifest)])
        req.advance(DecodePhase.STAGED)

    def _start(self, rid: str, event: RemotePrefill, req: DecodeRequest) -> None:
        token = event.first_token
        if not 0 <= token < self.vocab_size:
            self.transfers.failed += 1
            why = f"KV transfer failed: P sent first token {token}, outside the vocabulary"
            self.loop.fail(rid, why, FinishReason.TRANSFER)
            return
        assert req.admission is not None
        self.transfers.ok += 1
        self.kv_pages += len(req.admission.new_pages)
        self.transfers.seconds += time.monotonic() - req.registered_at
        self.loop.start_remote_decode(rid, token)
