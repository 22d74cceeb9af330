"""`TransferPeer`: the engine-side half of a rank's PD peer, shared by both roles.

The peer lives in the engine process and does no network I/O: it hands commands to its
transfer worker (:mod:`tspd_core.pd.peer.worker_handle`) and turns what the worker publishes
into typed events, once per scheduler round, through the replica agreement of
:mod:`tspd_core.pd.peer.agreement`.

Threading: ``register``, ``poll``, ``abort`` and ``has_in_flight`` belong to the scheduler
thread; the outboxes (forward thread) may run at the same time, and ``metrics`` / ``counters``
may be called from any thread (an HTTP handler). The tracked-request table is guarded by one
lock; the worker's notes are drained by one thread at a time (:mod:`tspd_core.pd.peer.link`), so no
update is lost whichever thread reads it. Nothing here waits for a transfer.

Life of a request in the peer::

    register ─► Bootstrapping ──(v=2)──► Bootstrapped ──(v=5)──► Succeeded / RemotePrefill
                     │                        │
                     └──────(v=0)─────────────┴──► Failing ──(every rank quiet)──► Failed
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Self

from tspd_core import trace
from tspd_core.ids import RequestId, Room
from tspd_core.pd.config import PeerConfig
from tspd_core.pd.errors import PeerError, UsageError
from tspd_core.pd.events import BootstrapInfo, Bootstrapped, Failed, PdEvent, Succeeded
from tspd_core.pd.metrics.peer import PeerMetrics
from tspd_core.pd.metrics.registry import MetricsSnapshot
from tspd_core.pd.peer.agreement import SOLO, Mesh, Verdict, decide, pack_rows, row
from tspd_core.pd.peer.link import WorkerLink
from tspd_core.pd.peer.tracked import FAILING, PHASES, Tracked
from tspd_core.pd.peer.worker_handle import WorkerHandle
from tspd_core.pd.status import FailureCause, TransferPoll
from tspd_core.pd.wire import ipc

log = logging.getLogger(__name__)

REPLICA_REASON = "failed on another rank of the replica"


class TransferPeer:
    """What both roles share: the request table, ``register``, ``poll`` and shutdown."""

    role = "peer"

    def __init__(self, config: PeerConfig, worker: WorkerHandle) -> None:
        self.config = config
        self._worker = worker
        self._lock = threading.Lock()
        self._tracked: dict[RequestId, Tracked] = {}
        self._rooms: dict[Room, RequestId] = {}
        self._dead: str | None = None
        self._shut = False
        self._asleep = False
        self._session: str | None = None  # a new Mooncake session after a D wake
        self._link = WorkerLink(worker, self._on_notes)
        self._metrics = PeerMetrics(self)
        # Releases of succeeded requests are held by the worker handle (defer) and ride with
        # the next command written (a registration, a hand-over), not written in the poll that
        # reports them: each write wakes the worker, which on a busy host preempts this thread
        # right there (~0.1-0.3 ms). They are pure cleanup (a failed request's release
        # triggers P's Failed push: sent at once). A poll writes them itself only when they
        # found no ride for a whole round (_release_due), and flush() when the engine idles.
        self._release_due = False

    # ---- identity -----------------------------------------------------------------------

    def port(self) -> int:
        """This rank's ZMQ PULL port (where peers push frames)."""
        return self._ready().port

    def session_id(self) -> str:
        """This rank's Mooncake session id, ``"<host>:<rpc_port>"`` (D: new after a wake)."""
        return self._session or self._ready().session_id

    def host(self) -> str:
        """The address this rank advertises to peers."""
        return self._ready().host

    # ---- the scheduler's API ------------------------------------------------------------

    def register(self, rid: RequestId, bootstrap: BootstrapInfo) -> None:
        """Track an admitted request before the scheduler can plan it (Bootstrapping).

        Raises :class:`UsageError` for a request or room already tracked or while the cache
        registration is released (sleep), and :class:`PeerError` after :meth:`shutdown`. A
        request registered while the worker is lost (:attr:`worker_lost`) is tracked all the
        same and fails at the next poll, so every rank of a replica keeps the same requests.
        """
        with self._lock:
            if self._shut:
                raise PeerError(f"{self.role} peer is shut down")
            if self._asleep:
                raise UsageError(
                    f"the {self.role} peer's cache is released (asleep): call "
                    "restore_registration() before registering requests"
                )
            if rid in self._tracked:
                raise UsageError(f"request {rid!r} is already registered")
            if bootstrap.room in self._rooms:
                other = self._rooms[bootstrap.room]
                raise UsageError(f"room {bootstrap.room} is already used by request {other!r}")
            t = self._tracked[rid] = Tracked(rid, bootstrap.room)
            self._rooms[bootstrap.room] = rid
            if self._dead is None:
                trace.mark_room(bootstrap.room, self.role + ".register", rid)
                try:
                    self._worker.send(ipc.TrackRoom(bootstrap.room, bootstrap.host, bootstrap.port))
                    return
                except PeerError as exc:
                    self._dead = str(exc)
            t.latest, t.cause = TransferPoll.FAILED, FailureCause.WORKER_LOST
            t.reason = f"transfer worker lost: {self._dead}"

    @property
    def worker_lost(self) -> str | None:
        """Why the transfer worker is gone (None while it serves, or after a clean shutdown)."""
        if self._shut:
            return None
        return self._dead or self._link.lost

    def poll(self, mesh: Mesh = SOLO, replica: int = 0) -> list[PdEvent]:
        """The requests whose state changed since the last poll, as events.

        Collective across the replica (every member calls it once per round, with the same
        requests registered in the same order). A request's final event (Succeeded,
        RemotePrefill or Failed) is returned once and the request is forgotten; the worker
        forgets its room too. Failed comes only once no rank of the replica can still write
        (D) or read (P) the request's pages, so the engine may free them on it.
        """
        started = time.perf_counter()
        if self._worker.holding():  # held since the last poll: one more round, then written
            if self._release_due:
                self._flush_releases()
            self._release_due = not self._release_due
        else:
            self._release_due = False
        self._absorb_worker()
        with self._lock:
            tracked = list(self._tracked.values())
            dead = self._dead is not None
            rows = [row(t.local, t.latest, dead or t.quiet_here, t.settled) for t in tracked]
        reduced = mesh.replica_group(replica).min_reduce(pack_rows(rows)).reshape(-1, 2)
        events: list[PdEvent] = []
        for t, (v, s) in zip(tracked, reduced.tolist(), strict=True):
            event = self._apply(t, decide(t.local, v, s))
            if event is not None:
                trace.mark_room(t.room, self.role + ".event", type(event).__name__)
                events.append(event)
        self._metrics.round(time.perf_counter() - started, events)
        return events

    def abort(self, rid: RequestId, reason: str) -> None:
        """Give up a tracked request (e.g. the client went away); ``poll`` reports it Failed.

        P: the room fails at once; the D ranks get the Failed push once no write of it runs on
        any P rank. D: the room fails at once, but its Failed event waits until P answers
        (Success or Failed) or the waiting timeout, when the manifest is out, so no late
        write lands in reused pages. One rank's abort fails the request on every rank of the
        replica (the agreement), in the same round. From the call on :meth:`aborted` says so
        (on this rank); a second abort sends its reason too, which changes nothing.
        """
        with self._lock:
            t = self._lookup(rid)
            t.aborted = True
            room = t.room
        self._worker.send(ipc.AbortRoom(room, reason))  # (after the releases held before it)

    def has_in_flight(self) -> bool:
        """Whether any tracked request's KV may still move (sleep must wait while it does)."""
        with self._lock:
            return bool(self._tracked)

    def tracked_count(self) -> int:
        with self._lock:
            return len(self._tracked)

    def counters(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The worker's cumulative counters (bytes, jobs, staged jobs, scatters, rooms ...).

        Waits for the worker's answer; any thread. :class:`PeerError` if it does not answer.
        """
        answer = self._link.call(lambda seq: ipc.StatsRequest(seq), "its counters", timeout_s)
        assert isinstance(answer, ipc.WorkerCounters), answer
        return dict(answer.values)

    def metrics(self, timeout_s: float = 5.0) -> MetricsSnapshot:
        """The worker's metrics merged with this peer's (agreement rounds, events); any thread.

        ``snapshot.render({"role": ..., "rank": ...})`` is Prometheus text for ``/metrics``.
        A dead or silent worker gives the peer's own metrics (``tspd_pd_worker_up`` 0).
        """
        own = self._metrics.snapshot()
        if self._dead is not None or self._link.lost is not None:
            return own
        try:
            answer = self._link.call(lambda seq: ipc.MetricsRequest(seq), "its metrics", timeout_s)
        except PeerError as exc:
            log.warning("%s peer: no worker metrics: %s", self.role, exc)
            return own
        assert isinstance(answer, ipc.WorkerMetrics), answer
        return MetricsSnapshot(answer.families).merge(own)

    def flush(self) -> None:
        """Hand the worker what waits for the next call (the releases of succeeded requests):
        for an engine about to idle, so its worker forgets those rooms and ticks slowly."""
        self._flush_releases()

    def batch(self) -> AbstractContextManager[None]:
        """Hold this thread's commands to the worker until the block ends, then write them
        at once: e.g. a D replica of one rank registering a request and publishing its
        manifest (one wake-up of the worker instead of two). Nothing reaches the worker
        before the block ends, so nothing that waits for the worker belongs inside it. The
        write at the end raises :class:`PeerError` if the worker is gone."""
        return self._worker.batch()

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the worker published something (or ``timeout_s``); for idle loops."""
        return self._worker.wait(timeout_s)

    def fileno(self) -> int:
        """A descriptor that turns readable when the worker published something, for engines
        that wait on several sources at once (``select``, ``multiprocessing.connection.wait``)."""
        return self._worker.fileno()

    def shutdown(self) -> None:
        """Stop the worker (sockets closed, memory unregistered); idempotent."""
        with self._lock:
            self._shut = True
            self._dead = self._dead or "shut down"
        self._worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # ---- what the outboxes and the metrics read (any thread) -----------------------------

    def live_room(self, rid: RequestId) -> Room:
        """The room of ``rid`` while the replica has not failed it (Bootstrapping or
        Bootstrapped: where D may stage its manifest, see ``DecodeOutbox``);
        :class:`UsageError` for a request not registered or failing."""
        with self._lock:
            t = self._lookup(rid)
            if t.local is TransferPoll.FAILED:
                raise UsageError(f"request {rid!r} is failing; wait for its Failed event")
            return t.room

    def tracks(self, rid: RequestId) -> bool:
        """Whether ``rid`` is still tracked (no final event returned for it yet)."""
        with self._lock:
            return rid in self._tracked

    def aborted(self, rid: RequestId) -> bool:
        """Whether :meth:`abort` was called for ``rid``: it then awaits only its final event,
        and nothing more of it should be armed, staged or handed over.
        :class:`UsageError` for a request not registered. Any thread."""
        with self._lock:
            return self._lookup(rid).aborted

    def room_request(self, room: Room) -> RequestId | None:
        """The tracked request that holds ``room`` (from ``register`` to its final event), or
        None. Any thread."""
        with self._lock:
            return self._rooms.get(room)

    def phase_counts(self) -> dict[str, int]:
        """Tracked requests by phase: ``bootstrapping``, ``bootstrapped``, ``failing``."""
        counts = dict.fromkeys(PHASES.values(), 0) | {FAILING: 0}
        with self._lock:
            for t in self._tracked.values():
                counts[PHASES.get(t.local, FAILING)] += 1
        return counts

    def worker_up(self) -> bool:
        """Whether the transfer worker serves (False once it is lost or shut down)."""
        return self._dead is None and self._link.lost is None

    def asleep(self) -> bool:
        """Whether the cache registration is released (between sleep and wake)."""
        return self._asleep

    # ---- sleep / wake (the outboxes' release_registration / restore_registration) --------

    def release_registration(self, timeout_s: float) -> None:
        """Sleep (see the outboxes' ``release_registration``): refused while any request is
        tracked; ``register`` is refused until :meth:`restore_registration`."""
        with self._lock:
            if self._asleep:
                raise UsageError(f"the {self.role} peer's cache registration is already released")
            busy = sorted(self._tracked)
            if busy:
                raise UsageError(
                    f"cannot release the cache registration: {len(busy)} tracked request(s) "
                    f"may still move KV ({', '.join(map(str, busy[:4]))}); wait for their events"
                )
            self._asleep = True  # no register() from here on
        try:
            self._flush_releases()  # the worker must forget them before it may sleep
            self._arena_call(lambda seq: ipc.ReleaseArena(seq), "release", timeout_s)
        except BaseException:
            with self._lock:
                self._asleep = False
            raise

    def restore_registration(self, timeout_s: float) -> None:
        """Wake (see the outboxes' ``restore_registration``)."""
        with self._lock:
            if not self._asleep:
                raise UsageError(f"the {self.role} peer's cache registration is not released")
        reply = self._arena_call(lambda seq: ipc.RestoreArena(seq), "restore", timeout_s)
        with self._lock:
            self._session = reply.session_id or None
            self._asleep = False

    def _arena_call(self, make: Callable[[int], ipc.Message], what: str, t: float) -> ipc.Reply:
        reply = self._link.call(make, f"the {what}", t)
        assert isinstance(reply, ipc.Reply), reply
        if not reply.ok:
            raise UsageError(f"the {self.role} worker refused the {what}: {reply.reason}")
        return reply

    # ---- internals ----------------------------------------------------------------------

    def _ready(self) -> ipc.WorkerReady:
        ready = self._worker.ready
        if ready is None:
            raise PeerError("the transfer worker never became ready")
        return ready

    def _lookup(self, rid: RequestId) -> Tracked:
        """The tracked request (caller holds the lock)."""
        t = self._tracked.get(rid)
        if t is None:
            raise UsageError(f"request {rid!r} is not registered with this peer")
        return t

    def _absorb_worker(self) -> None:
        self._link.pump()
        lost = self._link.lost
        if lost is not None or self._dead is not None:
            self._fail_all(self._dead or lost or "")

    def _on_notes(self, messages: list[ipc.Message]) -> None:
        with self._lock:
            for msg in messages:
                if isinstance(msg, ipc.RoomUpdate):
                    self._absorb(msg)
                elif isinstance(msg, ipc.WorkerFatal):
                    self._dead = msg.reason

    def _absorb(self, update: ipc.RoomUpdate) -> None:
        rid = self._rooms.get(update.room)
        t = self._tracked.get(rid) if rid is not None else None
        trace.mark_room(update.room, self.role + ".note", update.status.name)
        if t is not None:  # else released already: a late update of a forgotten room
            t.absorb(update)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            for t in self._tracked.values():
                t.worker_lost(reason)

    def _apply(self, t: Tracked, verdict: Verdict) -> PdEvent | None:
        if verdict is Verdict.BOOTSTRAPPED:
            t.local = TransferPoll.BOOTSTRAPPED
            return Bootstrapped(t.rid)
        if verdict is Verdict.FAILING:
            self._start_failing(t)
            return None
        if verdict is Verdict.NONE:
            return None
        failed = verdict is Verdict.FAILED
        self._forget(t, failed)
        if failed:
            return Failed(t.rid, t.reason or REPLICA_REASON, t.cause or FailureCause.REPLICA)
        return self._success_event(t)

    def _start_failing(self, t: Tracked) -> None:
        """The replica failed the request: make this rank's worker stop its transfer too."""
        t.local = TransferPoll.FAILED
        if t.latest.is_final or self._dead is not None:
            return  # the worker knows (Failed) or has nothing running (Success)
        try:
            self._worker.send(ipc.AbortRoom(t.room, REPLICA_REASON, FailureCause.REPLICA))
        except PeerError as exc:
            log.warning("could not stop room %d on this rank: %s", t.room, exc)

    def _success_event(self, t: Tracked) -> PdEvent:
        return Succeeded(t.rid)

    def _forget(self, t: Tracked, failed: bool) -> None:
        with self._lock:
            self._tracked.pop(t.rid, None)
            self._rooms.pop(t.room, None)
        if self._dead is not None:
            return
        if not failed:
            try:
                self._worker.defer(ipc.ReleaseRoom(t.room, "", False))
            except PeerError as exc:
                log.warning("could not release room %d: %s", t.room, exc)
            return
        try:
            self._worker.send(ipc.ReleaseRoom(t.room, t.reason or REPLICA_REASON, True))
        except PeerError as exc:
            log.warning("could not release room %d: %s", t.room, exc)

    def _flush_releases(self) -> None:
        """Write the held releases of succeeded requests now (any thread)."""
        try:
            self._worker.flush()
        except PeerError as exc:
            log.warning("could not hand the worker its held releases: %s", exc)
