"""Every room a P rank knows, from its first sign to its end: Bootstrapped, Success, Failed.

Life of a room on P (control thread; :meth:`PrefillRooms.notify` publishes to the engine)::

    TrackRoom ─┐                    ┌─ pre-allocations (any order, before or after TrackRoom)
               ▼                    ▼
          Bootstrapping ── fan-out reached, consistent ──► Bootstrapped (notify)
               │                                                │ chunks → write jobs (queue)
               │                                                ▼
               │                           all jobs done + final chunk ──► Success: status
               │                             (+ its first token, layerwise) frames to every real D
               └── bad/duplicate/excess pre-allocation, ────────┴──► Failed (notify at once,
                   write failure, timeout, abort, release              quiet once drained)

When the Failed push goes to D (every real D session that pre-allocated the room) — the rule
that lets D free its pages on it::

    room failed before this rank told its engine Bootstrapped  -> at once, once its writes
        (none can run anywhere: the replica never agreed on Bootstrapped)      drained
    otherwise (other P ranks may be writing the room)          -> on the engine's
        ReleaseRoom(failed): the replica agreed, every rank drained             release

So a tspd P pushes Failed only once no rank of its replica writes the room any more.
Everything here runs on the control thread; transfer threads only post their results
(:meth:`PrefillRooms.job_done`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tspd_core import trace
from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError, PdError, TransferError
from tspd_core.pd.prefill.state import (
    Destination,
    DSession,
    PRoom,
    Tombstone,
    check_complete,
    check_pre_allocation,
)
from tspd_core.pd.status import FailureCause, TransferPoll, alone
from tspd_core.pd.transfer.pool import TransferPool, WriteJob
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import PreAllocation, StatusMessage, abort_message, encode_status
from tspd_core.pd.worker.transfer_worker import TransferWorker

log = logging.getLogger(__name__)

SWEEP_S = 0.5


class PrefillRooms:
    """The rooms, their tombstones and the sessions refused after a failed write, and every
    rule that moves a room (see the module docstring). Control thread only."""

    def __init__(self, worker: TransferWorker, p_rank: int, pool: TransferPool) -> None:
        self.worker = worker
        self.p_rank = p_rank
        self.pool = pool
        self.rooms: dict[Room, PRoom] = {}
        self.tombstones: dict[Room, Tombstone] = {}  # released rooms: late frames get Failed
        self.failed_sessions: dict[str, float] = {}  # session -> when its write failed
        self.asleep = False  #: the arena is unregistered: no chunk may go out
        #: Called, in this order, with each room that just failed (see :meth:`fail`).
        self.on_failed: list[Callable[[PRoom], None]] = []
        #: Called with each room that just turned Bootstrapped (after the engine was told).
        self.on_bootstrapped: list[Callable[[PRoom], None]] = []
        self._next_sweep = 0.0

    # ---- a room's start: the engine's request and D's pre-allocations --------------------

    def track(self, msg: ipc.TrackRoom) -> None:
        """The engine registered the room's request."""
        now = time.monotonic()
        stone = self.tombstones.pop(msg.room, None)
        room = self.rooms.setdefault(msg.room, PRoom(msg.room, now))
        room.tracked_at = now
        if stone is not None and stone.abort_reason is not None:
            self.fail(room, stone.abort_reason, FailureCause.ABORT)  # aborted before it came
        elif room.status is TransferPoll.FAILED:
            self.notify(room)
        self._maybe_bootstrapped(room)

    def pre_allocated(self, pa: PreAllocation, session: DSession) -> None:
        """A registered D session pre-allocated a room (wire.md §2.2's checks)."""
        if pa.room in self.tombstones:
            self.push_session(session, abort_message(pa.room, self.p_rank))
            raise FrameError(f"room {pa.room}: pre-allocation for a released room")
        room = self.rooms.setdefault(pa.room, PRoom(pa.room, time.monotonic()))
        if room.status is TransferPoll.FAILED:
            if not room.exposed or room.released:
                self.push_session(session, abort_message(pa.room, self.p_rank))
                room.pushed.add(pa.session_id)
            room.dests.setdefault(pa.session_id, Destination(session, None))  # else: at release
            return
        if pa.session_id in self.failed_sessions:
            room.dests.setdefault(pa.session_id, Destination(session, None))
            why = f"room {pa.room}: session {pa.session_id} failed a write recently"
            self.fail(room, why, FailureCause.WRITE)
            return
        try:
            room.dests[pa.session_id] = check_pre_allocation(room, pa, session, self.p_rank)
            room.ready = check_complete(room, self.p_rank)
        except FrameError as exc:
            room.dests.setdefault(pa.session_id, Destination(session, None))
            self.fail(room, str(exc), FailureCause.REJECTED)
            return
        self._maybe_bootstrapped(room)

    def _maybe_bootstrapped(self, room: PRoom) -> None:
        if room.ready and room.tracked and room.status is TransferPoll.BOOTSTRAPPING:
            room.status = TransferPoll.BOOTSTRAPPED
            if not room.held:
                self.notify(room)
            # Held chunks go out before the engine hears: its wake-up would preempt us
            # before the write on a busy host, and it has nothing to do for them.
            for hook in self.on_bootstrapped:
                hook(room)
            self.notify(room)  # no-op if a Success or Failed was told meanwhile

    # ---- writes -------------------------------------------------------------------------

    def admit(self, chunk: ipc.SubmitChunk | ipc.ArmChunk) -> PRoom | None:
        """The room a chunk may be sent for, or None: failed here (if it was not), or — a
        chunk of a room still Bootstrapping, plain or armed — held until it is
        (:attr:`PRoom.held`)."""
        room = self.rooms.get(chunk.room)
        if room is None or room.status is TransferPoll.FAILED:
            return None  # released or failed meanwhile: the engine learns it from poll
        if isinstance(chunk, ipc.SubmitChunk) and chunk.final and room.final_in is None:
            room.final_in = time.monotonic()  # the forward is done: the hand-over starts
        if (
            room.status is TransferPoll.BOOTSTRAPPING
            and room.tracked
            and (not room.held or not room.held[-1].final)
        ):
            # The forward ran (plain) or is about to run (armed) before D's pre-allocations
            # arrived: an armed chunk is planned once they did, its passed intervals together.
            room.held.append(chunk)
            # It goes out without the replica's agreement on Bootstrapped, so other ranks of
            # the replica may write too: a Failed push waits for the replica's release.
            room.exposed = True
            return None
        if room.status is not TransferPoll.BOOTSTRAPPED or room.final is not None:
            why = f"chunk [{chunk.start}, {chunk.end}) submitted out of order"
            self.fail(room, why, FailureCause.BAD_FRAME)
            return None
        if self.asleep:
            self.fail(room, "the cache registration is released (asleep)", FailureCause.ABORT)
            return None
        failed = sorted(set(room.dests) & set(self.failed_sessions))
        if failed:
            why = f"session {failed[0]} failed a write recently (failed-session TTL)"
            self.fail(room, why, FailureCause.WRITE)
            return None
        return room

    def queue(self, room: PRoom, jobs: list[WriteJob]) -> None:
        """Hand a room's jobs to its transfer queue (wire.md §8); each counts as pending. A
        small job may start on this (the control) thread only while no other room is live
        (:func:`alone`): with others in flight the thread stays free for their frames (waiting
        up to 2 ms on each room's write cost `bench -- load` 7-11 % of its requests)."""
        queue = self.pool.queue_for(room.rpc_port_sum)
        inline = alone(self.rooms, room)
        for job in jobs:
            room.pending += 1
            self.pool.submit(queue, job, inline)

    def job_done(self, job: WriteJob, error: TransferError | None) -> None:
        """On a transfer thread: hand the result to the control thread."""
        self.worker.post(lambda: self.on_job_done(job, error))

    def on_job_done(self, job: WriteJob, error: TransferError | None) -> None:
        """A job of the room finished (control thread); a failed write fails the room and
        refuses its session for ``FAILED_SESSION_TTL``."""
        room = self.rooms.get(job.room)
        trace.mark_room(job.room, "pw.job_done")
        if room is None:
            return
        room.pending -= 1
        if error is not None and room.status is not TransferPoll.FAILED:
            if self.worker.tunables.failed_session_ttl_s > 0:
                self.failed_sessions[job.session] = time.monotonic()
            self.fail(room, str(error), FailureCause.WRITE)
        self.maybe_done(room)

    def first_token(self, msg: ipc.BootstrapToken) -> None:
        """Layerwise: the first token of a room whose final chunk was armed (and streamed).

        If that chunk is still held (the room is Bootstrapping), the token waits with it
        (:attr:`PRoom.held_token`): the forward is done, so once the room is Bootstrapped the
        chunk is armed with every interval passed (one write) and the token applied."""
        room = self.rooms.get(msg.room)
        if room is None or room.status is TransferPoll.FAILED:
            return  # released or failed meanwhile
        held = room.held[-1] if room.held else None
        if isinstance(held, ipc.ArmChunk) and held.final and room.held_token is None:
            room.final_in = time.monotonic()  # the forward is done with its token
            room.held_token = msg
            return
        f = room.final
        if not isinstance(f, ipc.ArmChunk):
            why = "a first token came for a room whose final chunk was not armed"
            if f is None:
                self.fail(room, why, FailureCause.BAD_FRAME)
            raise FrameError(f"room {msg.room}: {why}")
        if room.final_in is None:  # (else: it came while the chunk was held)
            room.final_in = time.monotonic()  # layerwise: the forward is done with its token
        room.final = ipc.SubmitChunk(
            f.room,
            f.start,
            f.end,
            True,
            f.block_ids,
            msg.token,
            msg.spec_ids,
            msg.cached_tokens,
            msg.logprob,
        )
        self.maybe_done(room)

    # ---- the end of a room --------------------------------------------------------------

    def maybe_done(self, room: PRoom) -> None:
        """Once no job of the room runs: a failed room finishes failing; one whose final
        chunk (with its first token) was handed over succeeds."""
        if room.pending:
            return
        if room.status is TransferPoll.FAILED:
            self._finish_failed(room)
        elif isinstance(room.final, ipc.SubmitChunk) and room.status is TransferPoll.BOOTSTRAPPED:
            self._succeed(room, room.final)  # (an armed final chunk: its token is due)

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
        trace.mark_room(room.room, "pw.success_send")
        for dest in room.dests.values():
            if not dest.session.dummy:
                self.push_session(dest.session, ok)
        now = time.monotonic()
        since = room.created if room.tracked_at is None else room.tracked_at
        self.worker.metrics.room_succeeded(now - since)
        if room.final_in is not None:
            self.worker.metrics.handed_over(now - room.final_in)
        self.notify(room)

    def release(self, msg: ipc.ReleaseRoom) -> None:
        """The engine forgot the room (after its final event, or ``abort_room`` ahead of it).

        In this order: the tombstone first (a later frame of the room gets Failed); then a
        failed release fails the room, or pushes Failed now if it had succeeded here (the
        replica failed it); then the room is untracked and, once drained, forgotten.
        """
        now = time.monotonic()
        room = self.rooms.get(msg.room)
        self.tombstones[msg.room] = Tombstone(now, msg.reason if msg.failed else None)
        if room is None:
            return  # never seen here (abort_room ahead of the room): later frames get Failed
        if msg.failed:
            room.released = True
            if not room.status.is_final:
                self.fail(room, msg.reason or "released by the engine", FailureCause.ABORT)
            elif room.pending == 0:
                self._push_failed(room)  # even after a local Success: the replica failed it
        elif not room.status.is_final:
            self.fail(room, "released by the engine before it finished", FailureCause.ABORT)
        room.tracked_at = None
        if room.pending == 0:
            # (Failing a room no request tracked, D's pre-allocation only, forgot it already.)
            self.rooms.pop(msg.room, None)

    def abort(self, msg: ipc.AbortRoom) -> None:
        """The engine (or the replica) gave the room up."""
        room = self.rooms.get(msg.room)
        if room is not None and not room.status.is_final:
            self.fail(room, msg.reason or "aborted by the engine", msg.cause)

    def fail_session(self, session_id: str, reason: str, cause: str) -> None:
        """Fail every room one of whose destinations is ``session_id``."""
        for room in list(self.rooms.values()):
            if session_id in room.dests:
                self.fail(room, reason, cause)

    def clear_failed_session(self, session_id: str) -> None:
        """``session_id`` may be written again (it registered afresh, or it is gone)."""
        self.failed_sessions.pop(session_id, None)

    # ---- failure ------------------------------------------------------------------------

    def fail(self, room: PRoom, reason: str, cause: str) -> None:
        """Fail ``room`` on this rank (once). The steps run in this order, each for a reason:

        1. the room turns Failed and its writes are cancelled — first, so nothing that drains
           it later (a job finishing, a stream ending) can complete it as a Success;
        2. the engine hears at once, so the other ranks of the replica stop too (not quiet
           yet unless nothing runs);
        3. a room with nothing running finishes failing now: quiet, and the Failed push per
           the rule in the module docstring;
        4. each :attr:`on_failed` hook runs, in order (layerwise: the room's streams that
           wait for the step counter end; the last one to drain it finishes it through
           :meth:`maybe_done`).
        """
        if room.status is TransferPoll.FAILED:
            return
        log.warning("room %d: %s", room.room, reason)
        room.status, room.reason, room.cause = TransferPoll.FAILED, reason, cause
        room.held.clear()  # never planned: nothing of them was read
        room.held_token = None
        room.cancel.set()
        self.worker.metrics.room_failed(cause)
        self.notify(room)
        if room.pending == 0:
            self._finish_failed(room)
        for hook in self.on_failed:
            hook(room)

    def _finish_failed(self, room: PRoom) -> None:
        """No write of the room runs on this rank any more."""
        self.notify(room)
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
                self.push_session(dest.session, abort)

    # ---- telling the engine and the D ranks ---------------------------------------------

    def notify(self, room: PRoom) -> None:
        """Tell the engine the room's (state, quiet) if it changed; a room the engine does
        not track is not told."""
        if not room.tracked:
            return
        failed = room.status is TransferPoll.FAILED
        state = (room.status, failed and room.pending == 0)
        if room.notified == state:
            return
        room.notified = state
        room.exposed |= room.status in (TransferPoll.BOOTSTRAPPED, TransferPoll.SUCCESS)
        self.worker.notify(
            ipc.RoomUpdate(
                room.room, room.status, reason=room.reason, quiet=state[1], cause=room.cause
            )
        )

    def push_session(self, session: DSession, msg: StatusMessage) -> None:
        self.push((session.reg.endpoint, session.reg.port), msg)

    def push(self, endpoint: tuple[str, int], msg: StatusMessage) -> None:
        """A status frame to a D rank (logged, not raised, when it cannot go)."""
        try:
            self.worker.control.send(endpoint[0], endpoint[1], encode_status(msg))
        except PdError as exc:
            log.error("room %d: cannot push status to %s:%d: %s", msg.room, *endpoint, exc)
            return
        self.worker.metrics.pushed(msg.status.name.lower())

    # ---- timeouts -----------------------------------------------------------------------

    def sweep(self, now: float) -> None:
        """Every ``SWEEP_S``: rooms still bootstrapping after ``BOOTSTRAP_TIMEOUT`` fail,
        rooms the engine never asked for go, old tombstones and failed-session marks expire."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        t = self.worker.tunables
        for room in list(self.rooms.values()):
            if now - room.created <= t.bootstrap_timeout_s:
                continue
            if room.status is TransferPoll.BOOTSTRAPPING:
                why = f"still bootstrapping after {t.bootstrap_timeout_s:g} s"
                self.fail(room, why, FailureCause.TIMEOUT)
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

    # ---- what sleep and the gauges read -------------------------------------------------

    def may_send(self) -> list[Room]:
        """Rooms whose KV may still go out (they hold sleep off): a job runs, or the engine
        tracks the room and it has not ended. A room no request claimed (pre-allocations
        only) never sends."""
        return sorted(
            r.room
            for r in self.rooms.values()
            if r.pending or (r.tracked and not r.status.is_final)
        )
