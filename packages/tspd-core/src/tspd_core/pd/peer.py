"""`TransferPeer`: the engine-side half of a rank's PD peer, shared by both roles.

The peer lives in the engine process and does no network I/O: it hands commands to its
transfer worker (:mod:`tspd_core.pd.worker`) and turns what the worker publishes into typed
events, once per scheduler round, through the replica agreement of
:mod:`tspd_core.pd.agreement`.

Threading: ``register``, ``poll`` and ``has_in_flight`` belong to the scheduler thread; the
outboxes (forward thread) may run at the same time — the tracked-request table is guarded by
one lock, and commands to the worker are FIFO. Nothing here waits for a transfer.

Life of a request in the peer::

    register ─► Bootstrapping ──(v=2)──► Bootstrapped ──(v=5)──► Succeeded / RemotePrefill
                     │                        │
                     └─────────(v=0)──────────┴──────────► Failed
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from tspd_core.ids import RequestId, Room
from tspd_core.pd import ipc
from tspd_core.pd.agreement import SOLO, Mesh, Verdict, decide, pack
from tspd_core.pd.config import PeerConfig
from tspd_core.pd.errors import PeerError, UsageError
from tspd_core.pd.events import (
    BootstrapInfo,
    Bootstrapped,
    Failed,
    PdEvent,
    RemotePrefill,
    Succeeded,
)
from tspd_core.pd.status import TransferPoll, advance
from tspd_core.pd.worker import WorkerHandle

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    """One admitted request, as the engine-side peer sees it."""

    rid: RequestId
    room: Room
    local: TransferPoll = TransferPoll.BOOTSTRAPPING  #: what the engine acted on
    latest: TransferPoll = TransferPoll.BOOTSTRAPPING  #: what the worker published
    success: ipc.RoomUpdate | None = None  #: the worker's Success, with D's first token
    reason: str = ""  #: why it failed, once it did
    staged: bool = field(default=False)  #: an outbox holds work for it


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
        self._held: list[ipc.Message] = []  # drained while waiting for counters

    # ---- identity -----------------------------------------------------------------------

    def port(self) -> int:
        """This rank's ZMQ PULL port (where peers push frames)."""
        return self._ready().port

    def session_id(self) -> str:
        """This rank's Mooncake session id, ``"<host>:<rpc_port>"``."""
        return self._ready().session_id

    def host(self) -> str:
        """The address this rank advertises to peers."""
        return self._ready().host

    # ---- the scheduler's API ------------------------------------------------------------

    def register(self, rid: RequestId, bootstrap: BootstrapInfo) -> None:
        """Track an admitted request before the scheduler can plan it (Bootstrapping).

        Raises :class:`UsageError` for a request or room already tracked, and
        :class:`PeerError` when the worker is gone.
        """
        with self._lock:
            if self._dead is not None:
                raise PeerError(f"{self.role} peer is down: {self._dead}")
            if rid in self._tracked:
                raise UsageError(f"request {rid!r} is already registered")
            if bootstrap.room in self._rooms:
                other = self._rooms[bootstrap.room]
                raise UsageError(f"room {bootstrap.room} is already used by request {other!r}")
            self._tracked[rid] = Tracked(rid, bootstrap.room)
            self._rooms[bootstrap.room] = rid
            self._worker.send(ipc.TrackRoom(bootstrap.room, bootstrap.host, bootstrap.port))

    def poll(self, mesh: Mesh = SOLO, replica: int = 0) -> list[PdEvent]:
        """The requests whose state changed since the last poll, as events.

        Collective across the replica (every member calls it once per round). A request's
        final event (Succeeded, RemotePrefill or Failed) is returned once and the request is
        forgotten; the worker forgets its room too.
        """
        self._absorb_worker()
        with self._lock:
            tracked = list(self._tracked.values())
        reduced = mesh.replica_group(replica).min_reduce(pack([t.latest for t in tracked]))
        events: list[PdEvent] = []
        for t, v in zip(tracked, reduced.tolist(), strict=True):
            event = self._apply(t, decide(t.local, v))
            if event is not None:
                events.append(event)
        return events

    def abort(self, rid: RequestId, reason: str) -> None:
        """Give up a tracked request (e.g. the client went away); ``poll`` reports it Failed.

        P: the room fails at once if none of its KV was handed over, else once the writes in
        flight drained; the D ranks get the abort push. D: a room whose manifest is not out yet
        fails at once; after that D keeps its pages until P answers (Success or Failed) or the
        waiting timeout, so no late write lands in reused pages. Every rank of a replica should
        abort the same request (the agreement then fails it everywhere in the same round).
        """
        with self._lock:
            room = self._lookup(rid).room
        self._worker.send(ipc.AbortRoom(room, reason))

    def has_in_flight(self) -> bool:
        """Whether any tracked request's KV may still move (sleep must wait while it does)."""
        with self._lock:
            return bool(self._tracked)

    def tracked_count(self) -> int:
        with self._lock:
            return len(self._tracked)

    def counters(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The worker's cumulative counters (bytes, jobs, staged jobs, scatters, rooms ...).

        Waits for the worker's answer; call it from the thread that polls. Room updates that
        arrive meanwhile are kept for the next :meth:`poll`.
        """
        self._worker.send(ipc.StatsRequest())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._worker.wait(0.05)
            for msg in self._worker.drain():
                if isinstance(msg, ipc.WorkerCounters):
                    return dict(msg.values)
                self._held.append(msg)
        raise PeerError(f"the {self.role} worker did not report its counters in {timeout_s:g} s")

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
        messages, self._held = self._held, []
        lost = None
        try:
            messages += self._worker.drain()
        except PeerError as exc:
            lost = str(exc)
        with self._lock:
            for msg in messages:
                if isinstance(msg, ipc.RoomUpdate):
                    self._absorb(msg)
                elif isinstance(msg, ipc.WorkerFatal):
                    self._dead = msg.reason
        if lost is not None or self._dead is not None:
            self._fail_all(self._dead or lost or "")

    def _absorb(self, update: ipc.RoomUpdate) -> None:
        rid = self._rooms.get(update.room)
        t = self._tracked.get(rid) if rid is not None else None
        if t is None:
            return  # released already: a late update of a forgotten room
        before = t.latest
        t.latest = advance(t.latest, update.status)
        if t.latest is TransferPoll.FAILED and before is not TransferPoll.FAILED:
            t.reason = update.reason or "failed"
        if update.status is TransferPoll.SUCCESS and t.success is None:
            t.success = update

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            for t in self._tracked.values():
                if t.latest is not TransferPoll.FAILED:
                    t.latest, t.reason = TransferPoll.FAILED, f"transfer worker lost: {reason}"

    def _apply(self, t: Tracked, verdict: Verdict) -> PdEvent | None:
        if verdict is Verdict.BOOTSTRAPPED:
            t.local = TransferPoll.BOOTSTRAPPED
            return Bootstrapped(t.rid)
        if verdict is Verdict.NONE:
            return None
        self._forget(t)
        if verdict is Verdict.FAILED:
            return Failed(t.rid, t.reason or "failed on another rank of the replica")
        return self._success_event(t)

    def _success_event(self, t: Tracked) -> PdEvent:
        return Succeeded(t.rid)

    def _forget(self, t: Tracked) -> None:
        with self._lock:
            self._tracked.pop(t.rid, None)
            self._rooms.pop(t.room, None)
        if self._dead is None:
            try:
                self._worker.send(ipc.ReleaseRoom(t.room))
            except PeerError as exc:
                log.warning("could not release room %d: %s", t.room, exc)


def remote_prefill_event(t: Tracked) -> RemotePrefill:
    """D's final event, carrying what the P ranks sent with their Success."""
    s = t.success
    if s is None:
        return RemotePrefill(t.rid, -1)
    return RemotePrefill(t.rid, s.token, s.spec_ids, s.cached_tokens, s.logprob)
