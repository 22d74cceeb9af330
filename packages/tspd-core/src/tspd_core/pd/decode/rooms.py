"""Every room a D rank tracks, and how each one ends: P's answers, Success, Failed, quiet.

Completion is exact (wire.md §2.3): Success must come from exactly the P ranks the route says
serve this D rank; a Success before the manifest or from any other rank fails the room. Every
answer (Success or Failed) is remembered even after the room failed, because a failed room
stays "loud" (P may still write into its pages) until each expected rank answered, a P rank
pushed Failed (a tspd P does so only once its whole replica drained the room), or a timeout
or the heartbeat gave up (:attr:`DRoom.quiet`). D never sends aborts (wire.md §2.4).

Control thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tspd_core.ids import Room
from tspd_core.pd.decode.state import DRoom
from tspd_core.pd.metrics.registry import Labels, labels
from tspd_core.pd.status import FailureCause, TransferPoll, advance
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import StatusMessage
from tspd_core.pd.worker.transfer_worker import TransferWorker

log = logging.getLogger(__name__)


class DecodeRooms:
    """The rooms of this D rank and every rule that moves one (see the module docstring)."""

    def __init__(self, worker: TransferWorker) -> None:
        self.worker = worker
        self.rooms: dict[Room, DRoom] = {}
        #: Called once per room, in list order, as it turns Failed (before the engine hears).
        self.on_failed: list[Callable[[DRoom], None]] = []

    def get(self, room: Room) -> DRoom | None:
        return self.rooms.get(room)

    def track(self, room: Room, address: str) -> DRoom:
        """The engine registered the room's request (its P instance is at ``address``)."""
        record = self.rooms[room] = DRoom(room, address, time.monotonic())
        return record

    def forget(self, room: Room) -> None:
        """The engine released the room after its final event."""
        self.rooms.pop(room, None)

    def update(self, room: DRoom, status: TransferPoll) -> None:
        """The room moved on (Bootstrapped, WaitingForInput): tell the engine."""
        room.status = status
        self.worker.notify(ipc.RoomUpdate(room.room, status))

    # ---- P's answers --------------------------------------------------------------------

    def on_status(self, msg: StatusMessage) -> None:
        """A P rank's status frame for a room (after the scatters it requested before it)."""
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
                self.worker.send_engine(ipc.RoomUpdate(room.room, room.status, settled=True))
            return
        if msg.status is TransferPoll.FAILED:
            room.settled = True
            why = f"P rank {msg.sender_rank} aborted the transfer"
            self.fail(msg.room, room.reason or why, room.cause or FailureCause.REMOTE)
        elif room.status is TransferPoll.FAILED:
            self.fail(msg.room, room.reason, room.cause)  # an answer: maybe quiet now
        elif msg.status is TransferPoll.SUCCESS:
            self._on_success(room, msg)
        else:
            log.warning("room %d: unexpected status %s from P", msg.room, msg.status.name)
            room.status = advance(room.status, msg.status)

    def _on_success(self, room: DRoom, msg: StatusMessage) -> None:
        if room.status is not TransferPoll.WAITING_FOR_INPUT:
            # No manifest went out yet, so no P rank can have written our pages.
            why = f"Success from P rank {msg.sender_rank} before the manifest"
            self.fail(room.room, why, FailureCause.BAD_FRAME)
            return
        if msg.sender_rank not in room.targets:
            why = f"Success from P rank {msg.sender_rank}, expected {sorted(room.targets)}"
            self.fail(room.room, why, FailureCause.BAD_FRAME)
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
            self.worker.metrics.room_succeeded(time.monotonic() - room.created)
            self.worker.notify(
                ipc.RoomUpdate(
                    room.room,
                    room.status,
                    room.token,
                    room.spec_ids,
                    room.cached_tokens,
                    room.logprob,
                )
            )

    # ---- failure ------------------------------------------------------------------------

    def fail(self, room_id: Room, reason: str, cause: str, gave_up: bool = False) -> None:
        """Fail a room (once), or tell the engine it went quiet; idempotent.

        In this order: ``gave_up`` is recorded (a timeout or the heartbeat ended the wait for
        P's answers, so the room is quiet); the room turns Failed with its first reason and
        cause; then the engine hears (quiet, settled) if that changed — the first time
        through ``notify`` (which logs the failure), afterwards as a plain update.
        """
        room = self.rooms.get(room_id)
        if room is None or room.status is TransferPoll.SUCCESS:
            return
        room.gave_up |= gave_up
        if room.status is not TransferPoll.FAILED:
            room.status, room.reason, room.cause = TransferPoll.FAILED, reason, cause
            self.worker.metrics.room_failed(cause)
            for hook in self.on_failed:
                hook(room)
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
            self.worker.notify(update)  # logs the failure once
        else:
            self.worker.send_engine(update)

    def fail_address(self, address: str, reason: str) -> None:
        """The P instance at ``address`` is presumed dead: it writes nothing more, so its
        rooms that are not Success fail and are quiet at once."""
        for room in list(self.rooms.values()):
            if room.address == address and room.status is not TransferPoll.SUCCESS:
                self.fail(room.room, reason, FailureCause.HEARTBEAT, gave_up=True)

    def sweep(self, now: float, limit: float) -> None:
        """``WAITING_TIMEOUT``: a room whose manifest went out ``limit`` seconds ago without
        every Success fails (and gives up waiting); a failed one still loud gives up too."""
        for room in list(self.rooms.values()):
            if not room.published or now - room.published <= limit:
                continue
            if room.status is TransferPoll.WAITING_FOR_INPUT:
                missing = sorted(room.targets - room.arrived)
                why = f"no Success from P ranks {missing} in {limit:g} s"
                self.fail(room.room, why, FailureCause.TIMEOUT, gave_up=True)
            elif room.status is TransferPoll.FAILED and not room.quiet:
                log.warning("room %d: P never answered its abort in %g s", room.room, limit)
                self.fail(room.room, room.reason, room.cause, gave_up=True)

    def states(self) -> dict[Labels, float]:
        """The ``rooms{state}`` gauge."""
        out = {labels(state=s.name.lower()): 0.0 for s in TransferPoll if s != 4}
        for room in self.rooms.values():
            out[labels(state=room.status.name.lower())] += 1
        return out
