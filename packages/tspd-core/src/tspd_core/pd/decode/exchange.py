"""What the D worker says to P ranks and hears from them: registrations, staging grants,
pre-allocations, status frames (Success / Failed) and scatters — and how a room fails.

:class:`DecodeTalk` is the P-facing half of the D worker (:mod:`tspd_core.pd.decode.worker`
owns the rooms' life, the heartbeat and the engine's commands). Control thread only.

Completion is exact (WIRE §2.3): Success must come from exactly the P ranks the route says
serve this D rank; a Success before the manifest or from any other rank fails the room. Every
answer (Success or Failed) is remembered even after the room failed, because a failed room
stays "loud" (P may still write into its pages) until each expected rank answered, a P rank
pushed Failed (a tspd P does so only once its whole replica drained the room), or a timeout
or the heartbeat gave up.
"""

from __future__ import annotations

import logging
import time

from tspd_core.ids import Rank, Room
from tspd_core.pd.decode.state import DRoom, Lookup
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.status import FailureCause, TransferPoll, advance
from tspd_core.pd.transfer.staging import StagingArea
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import (
    PreAllocation,
    Registration,
    ScatterAck,
    ScatterRequest,
    StatusMessage,
    decode_decode_inbound,
    encode_pre_allocation,
    encode_registration,
    encode_scattered,
    encode_stage_offer,
)
from tspd_core.pd.worker.transfer_worker import RoleWorker

log = logging.getLogger(__name__)


class DecodeTalk(RoleWorker):
    """The D worker's exchanges with P ranks (see the module docstring)."""

    rooms: dict[Room, DRoom]
    registered: set[tuple[str, int, tuple[int, ...]]]
    granted: set[tuple[str, int, int]]
    staging: StagingArea | None
    contract_bytes: bytes

    # ---- to P ---------------------------------------------------------------------------

    def _register(self, address: str, found: Lookup) -> None:
        """Register with each contacted P rank once per (address, DP group, contact set)."""
        key = (address, found.dp_group, tuple(sorted(found.endpoints)))
        if key in self.registered:
            return
        reg = Registration(
            endpoint=self.spec.host,
            port=self.control.port,
            session_id=self.engine.session_id,
            base_ptr=self.base_ptr,
            contract=self.contract_bytes,
            tp_size=self.spec.tp_size,
            tp_rank=self.spec.tp_rank,
        )
        frames = encode_registration(reg)
        for p_rank, (ip, port) in sorted(found.endpoints.items()):
            try:
                self.control.send(ip, port, frames)
            except PdError as exc:
                raise PdError(f"cannot register with P rank {p_rank}: {exc}") from exc
        self.registered.add(key)

    def _offer_staging(self, address: str, found: Lookup, targets: frozenset[int]) -> None:
        """Grant staging slots to each P rank that sends us data (once per P rank)."""
        if self.staging is None:
            return
        for p_rank in sorted(targets):
            key = (address, found.dp_group, p_rank)
            if key in self.granted:
                continue
            self.granted.add(key)
            endpoint = found.endpoints[Rank(p_rank)]
            offer = self.staging.grant(
                self.engine.session_id, endpoint, self.tunables.staging_slots_per_rank
            )
            if offer is None:
                log.info("no staging slots left for P rank %d at %s", p_rank, address)
                continue
            try:
                self.control.send(*endpoint, encode_stage_offer(offer))
            except PdError as exc:
                log.warning("could not offer staging to P rank %d: %s", p_rank, exc)

    def _publish(self, msg: ipc.PublishManifest) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.status is TransferPoll.FAILED:
            return
        if room.status is not TransferPoll.BOOTSTRAPPED or room.lookup is None:
            why = "manifest handed over before the room was bootstrapped"
            self._fail_room(msg.room, why, FailureCause.BAD_FRAME)
            return
        session = self.engine.session_id
        for p_rank, (ip, port) in sorted(room.lookup.endpoints.items()):
            body = msg.manifest.encode() if p_rank in room.targets else b""
            frames = encode_pre_allocation(PreAllocation(msg.room, session, body))
            try:
                self.control.send(ip, port, frames)
            except PdError as exc:
                # Ranks before this one may have it: from here on, count the room as published.
                room.published = time.monotonic()
                self._fail_room(msg.room, f"cannot reach P rank {p_rank}: {exc}", "lookup")
                return
        room.status = TransferPoll.WAITING_FOR_INPUT
        room.published = time.monotonic()
        self.notify(ipc.RoomUpdate(msg.room, room.status))

    # ---- from P -------------------------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        inbound = decode_decode_inbound(frames)
        if isinstance(inbound, ScatterRequest):
            self._on_scatter(inbound)
            return
        status = inbound
        # Our staging offers promise P ranks that a status frame counts only once the
        # scatters requested before it are done (P does not wait for their acks).
        if self.staging is None or not self.staging.after_scatters(
            lambda: self.post(lambda: self._on_status(status))
        ):
            self._on_status(status)

    def _on_status(self, msg: StatusMessage) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            log.warning("ignored status %s for unknown room %d", msg.status.name, msg.room)
            return
        if msg.status in (TransferPoll.SUCCESS, TransferPoll.FAILED):
            room.answered.add(msg.sender_rank)
        if room.status is TransferPoll.SUCCESS:
            if msg.status is TransferPoll.FAILED and not room.settled:
                # Our KV is whole, but P's replica failed the room after all: other D ranks
                # of ours may still wait for a P rank that will never answer.
                room.settled = True
                self.send_engine(ipc.RoomUpdate(room.room, room.status, settled=True))
            return
        if msg.status is TransferPoll.FAILED:
            room.settled = True
            why = f"P rank {msg.sender_rank} aborted the transfer"
            self._fail_room(msg.room, room.reason or why, room.cause or FailureCause.REMOTE)
        elif room.status is TransferPoll.FAILED:
            self._fail_room(msg.room, room.reason, room.cause)  # an answer: maybe quiet now
        elif msg.status is TransferPoll.SUCCESS:
            self._on_success(room, msg)
        else:
            log.warning("room %d: unexpected status %s from P", msg.room, msg.status.name)
            room.status = advance(room.status, msg.status)

    def _on_success(self, room: DRoom, msg: StatusMessage) -> None:
        if room.status is not TransferPoll.WAITING_FOR_INPUT:
            # No manifest went out yet, so no P rank can have written our pages.
            why = f"Success from P rank {msg.sender_rank} before the manifest"
            self._fail_room(room.room, why, FailureCause.BAD_FRAME)
            return
        if msg.sender_rank not in room.targets:
            why = f"Success from P rank {msg.sender_rank}, expected {sorted(room.targets)}"
            self._fail_room(room.room, why, FailureCause.BAD_FRAME)
            return
        room.arrived.add(msg.sender_rank)
        if room.token == -1 and msg.bootstrap_token != -1:
            room.token = msg.bootstrap_token
        if not room.spec_ids and msg.spec_ids:
            room.spec_ids = msg.spec_ids
        room.cached_tokens = max(room.cached_tokens, msg.cached_tokens)
        if room.logprob is None:
            room.logprob = msg.bootstrap_logprob
        if room.arrived == set(room.targets):
            room.status = TransferPoll.SUCCESS
            self.metrics.room_succeeded(time.monotonic() - room.created)
            self.notify(
                ipc.RoomUpdate(
                    room.room,
                    room.status,
                    room.token,
                    room.spec_ids,
                    room.cached_tokens,
                    room.logprob,
                )
            )

    def _on_scatter(self, req: ScatterRequest) -> None:
        room = self.rooms.get(req.room)
        if self.staging is None:
            raise FrameError("scatter request, but staging is off on this rank")
        if room is None or room.status is not TransferPoll.WAITING_FOR_INPUT:
            log.warning("refused scatter for room %d: not waiting for input", req.room)
            self.staging.submit(req, self._send_ack, refuse=True)
            return
        self.staging.submit(req, self._send_ack)

    def _send_ack(self, req: ScatterRequest, endpoint: tuple[str, int] | None, ok: bool) -> None:
        """On the scatter thread: tell the P rank its slot is free again (and fail the room
        here if its piece could not be scattered: P may have sent Success already)."""
        if not ok:
            self.post(lambda: self._scatter_failed(req.room))
        if endpoint is None:
            return
        ack = ScatterAck(self.engine.session_id, req.grant, req.slot, req.seq, ok)
        try:
            self.control.send(*endpoint, encode_scattered(ack))
        except PdError as exc:
            log.warning("could not acknowledge a scatter to %s:%d: %s", *endpoint, exc)

    def _scatter_failed(self, room_id: Room) -> None:
        room = self.rooms.get(room_id)
        if room is not None and room.status is TransferPoll.WAITING_FOR_INPUT:
            why = "a staged piece could not be scattered into the arena (see the log)"
            self._fail_room(room_id, why, FailureCause.WRITE)

    # ---- failure ------------------------------------------------------------------------

    def _fail_room(self, room_id: Room, reason: str, cause: str, gave_up: bool = False) -> None:
        """Fail a room (once), or tell the engine it went quiet; idempotent."""
        room = self.rooms.get(room_id)
        if room is None or room.status is TransferPoll.SUCCESS:
            return
        room.gave_up |= gave_up
        if room.status is not TransferPoll.FAILED:
            room.status, room.reason, room.cause = TransferPoll.FAILED, reason, cause
            self.metrics.room_failed(cause)
        state = (room.quiet, room.settled)
        if room.notified == state:
            return
        first = room.notified is None
        room.notified = state
        update = ipc.RoomUpdate(
            room_id,
            TransferPoll.FAILED,
            reason=room.reason,
            quiet=state[0],
            settled=state[1],
            cause=room.cause,
        )
        if first:
            self.notify(update)  # logs the failure once
        else:
            self.send_engine(update)
