"""P's room outcomes inside the transfer worker: writes, Success, failure, aborts, timeouts.

:class:`PrefillRooms` is the half of the P worker that moves a room to its end; the other
half (:mod:`tspd_core.pd.prefill.worker`) takes registrations, pre-allocations and commands.
Everything runs on the control thread; transfer threads only ``post`` their results.

When the Failed push goes to D (every real D session that pre-allocated the room) — the rule
that lets D free its pages on it::

    room failed before this rank told its engine Bootstrapped  -> at once, once its writes
        (none can run anywhere: the replica never agreed on Bootstrapped)      drained
    otherwise (other P ranks may be writing the room)          -> on the engine's
        ReleaseRoom(failed): the replica agreed, every rank drained             release

So a tspd P pushes Failed only once no rank of its replica writes the room any more.
"""

from __future__ import annotations

import logging
import time

from tspd_core.ids import Room
from tspd_core.layout import CacheContract
from tspd_core.pd.errors import PdError, TransferError
from tspd_core.pd.prefill.jobs import JobBuilder
from tspd_core.pd.prefill.state import DSession, PRoom, Tombstone
from tspd_core.pd.status import FailureCause, TransferPoll
from tspd_core.pd.transfer.pool import TransferPool, WriteJob
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import (
    StatusMessage,
    abort_message,
    encode_status,
)
from tspd_core.pd.worker.transfer_worker import RoleWorker

log = logging.getLogger(__name__)

SWEEP_S = 0.5


class PrefillRooms(RoleWorker):
    """Room outcomes of the P worker (see the module docstring); state set by the subclass."""

    p_rank: int
    contract: CacheContract
    rooms: dict[Room, PRoom]
    tombstones: dict[Room, Tombstone]
    failed_sessions: dict[str, float]
    jobs: JobBuilder
    pool: TransferPool
    asleep: bool
    _next_sweep: float

    # ---- writes -------------------------------------------------------------------------

    def _admit(self, chunk: ipc.SubmitChunk | ipc.ArmChunk) -> PRoom | None:
        """The room a chunk may be sent for, or None (the room is failed here, if it was not)."""
        room = self.rooms.get(chunk.room)
        if room is None or room.status is TransferPoll.FAILED:
            return None  # released or failed meanwhile: the engine learns it from poll
        if room.status is not TransferPoll.BOOTSTRAPPED or room.final is not None:
            why = f"chunk [{chunk.start}, {chunk.end}) submitted out of order"
            self._fail(room, why, FailureCause.BAD_FRAME)
            return None
        if self.asleep:
            self._fail(room, "the cache registration is released (asleep)", FailureCause.ABORT)
            return None
        failed = sorted(set(room.dests) & set(self.failed_sessions))
        if failed:
            why = f"session {failed[0]} failed a write recently (failed-session TTL)"
            self._fail(room, why, FailureCause.WRITE)
            return None
        return room

    def _on_submit(self, chunk: ipc.SubmitChunk) -> None:
        room = self._admit(chunk)
        if room is None:
            return
        try:
            jobs = self.jobs.jobs(room, chunk, self._job_done)
        except (PdError, ValueError) as exc:
            why = f"cannot plan chunk [{chunk.start}, {chunk.end}): {exc}"
            self._fail(room, why, FailureCause.BAD_FRAME)
            return
        room.chunks += 1
        if chunk.final:
            room.final = chunk
        self._queue(room, jobs)
        self._maybe_done(room)

    def _queue(self, room: PRoom, jobs: list[WriteJob]) -> None:
        """Hand a room's jobs to its transfer queue (WIRE §8); each counts as pending."""
        queue = self.pool.queue_for(room.rpc_port_sum)
        for job in jobs:
            room.pending += 1
            self.pool.submit(queue, job)

    def _job_done(self, job: WriteJob, error: TransferError | None) -> None:
        """On a transfer thread: hand the result to the control thread."""
        self.post(lambda: self._on_job_done(job, error))

    def _on_job_done(self, job: WriteJob, error: TransferError | None) -> None:
        room = self.rooms.get(job.room)
        if room is None:
            return
        room.pending -= 1
        if error is not None and room.status is not TransferPoll.FAILED:
            if self.tunables.failed_session_ttl_s > 0:
                self.failed_sessions[job.session] = time.monotonic()
            self._fail(room, str(error), FailureCause.WRITE)
        self._maybe_done(room)

    def _maybe_done(self, room: PRoom) -> None:
        if room.pending:
            return
        if room.status is TransferPoll.FAILED:
            self._finish_failed(room)
        elif (
            room.final is not None
            and room.status is TransferPoll.BOOTSTRAPPED
            and not room.awaiting_token
        ):
            self._succeed(room, room.final)

    def _succeed(self, room: PRoom, f: ipc.SubmitChunk) -> None:
        room.status = TransferPoll.SUCCESS
        ok = StatusMessage(
            room.room,
            TransferPoll.SUCCESS,
            self.p_rank,
            f.token,
            f.spec_ids,
            f.cached_tokens,
            f.logprob,
        )
        for dest in room.dests.values():
            if not dest.session.dummy:
                self._push_session(dest.session, ok)
        self.metrics.room_succeeded(time.monotonic() - (room.tracked_at or room.created))
        self._notify(room)

    def _on_release(self, msg: ipc.ReleaseRoom) -> None:
        now = time.monotonic()
        room = self.rooms.get(msg.room)
        self.tombstones[msg.room] = Tombstone(now, msg.reason if msg.failed else None)
        if room is None:
            return  # never seen here (abort_room ahead of the room): later frames get Failed
        if msg.failed:
            room.released = True
            if not room.status.is_final:
                self._fail(room, msg.reason or "released by the engine", FailureCause.ABORT)
            elif room.pending == 0:
                self._push_failed(room)  # even after a local Success: the replica failed it
        elif not room.status.is_final:
            self._fail(room, "released by the engine before it finished", FailureCause.ABORT)
        room.tracked = False
        if room.pending == 0:
            del self.rooms[msg.room]

    # ---- failure ------------------------------------------------------------------------

    def _fail(self, room: PRoom, reason: str, cause: str) -> None:
        if room.status is TransferPoll.FAILED:
            return
        log.warning("room %d: %s", room.room, reason)
        room.status, room.reason, room.cause = TransferPoll.FAILED, reason, cause
        room.cancel.set()
        self.metrics.room_failed(cause)
        self._notify(room)  # at once, so the other ranks stop too; quiet once drained
        if room.pending == 0:
            self._finish_failed(room)

    def _finish_failed(self, room: PRoom) -> None:
        """No write of the room runs on this rank any more."""
        self._notify(room)
        if not room.exposed or room.released:
            self._push_failed(room)
        if not room.tracked and room.room in self.tombstones:
            self.rooms.pop(room.room, None)

    def _push_failed(self, room: PRoom) -> None:
        """The abort push to every real D session of the room that did not get it yet."""
        abort = abort_message(room.room, self.p_rank)
        for sid, dest in room.dests.items():
            if not dest.session.dummy and sid not in room.pushed:
                room.pushed.add(sid)
                self._push_session(dest.session, abort)

    def _notify(self, room: PRoom) -> None:
        if not room.tracked:
            return
        failed = room.status is TransferPoll.FAILED
        state = (room.status, failed and room.pending == 0)
        if room.notified == state:
            return
        room.notified = state
        room.exposed |= room.status in (TransferPoll.BOOTSTRAPPED, TransferPoll.SUCCESS)
        self.notify(
            ipc.RoomUpdate(
                room.room, room.status, reason=room.reason, quiet=state[1], cause=room.cause
            )
        )

    def _push_session(self, session: DSession, msg: StatusMessage) -> None:
        self._push((session.reg.endpoint, session.reg.port), msg)

    def _push(self, endpoint: tuple[str, int], msg: StatusMessage) -> None:
        try:
            self.control.send(endpoint[0], endpoint[1], encode_status(msg))
        except PdError as exc:
            log.error("room %d: cannot push status to %s:%d: %s", msg.room, *endpoint, exc)
            return
        self.metrics.pushed(msg.status.name.lower())

    # ---- timeouts -----------------------------------------------------------------------

    def on_tick(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        t = self.tunables
        for room in list(self.rooms.values()):
            if now - room.created <= t.bootstrap_timeout_s:
                continue
            if room.status is TransferPoll.BOOTSTRAPPING:
                why = f"still bootstrapping after {t.bootstrap_timeout_s:g} s"
                self._fail(room, why, FailureCause.TIMEOUT)
            if not room.tracked and room.pending == 0:
                self.rooms.pop(room.room, None)  # the engine never asked for it
                self.tombstones[room.room] = Tombstone(now)
        ttl = max(t.failed_session_ttl_s, t.bootstrap_timeout_s)
        for key, stone in list(self.tombstones.items()):
            if now - stone.since > ttl:
                del self.tombstones[key]
        for sid, since in list(self.failed_sessions.items()):
            if t.failed_session_ttl_s <= 0 or now - since > t.failed_session_ttl_s:
                del self.failed_sessions[sid]
