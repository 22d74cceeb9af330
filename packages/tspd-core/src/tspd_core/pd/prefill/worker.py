"""The P rank's transfer worker: registrations, pre-allocations, engine commands, sleep/wake.

Life of a room on P (control thread; ``notify`` publishes to the engine-side peer)::

    TrackRoom ─┐                    ┌─ pre-allocations (any order, before or after TrackRoom)
               ▼                    ▼
          Bootstrapping ── fan-out reached, consistent ──► Bootstrapped (notify)
               │                                                │ SubmitChunk(s) → write jobs
               │                                                ▼
               │                           all jobs done + final chunk ──► Success: status
               │                                                │      frames to every real D
               └── bad/duplicate/excess pre-allocation, ────────┴──► Failed (notify at once,
                   write failure, timeout, abort, release              quiet once drained);
                                                                       pushes: prefill_rooms

The room outcomes (writes, Success, Failed pushes, timeouts) live in
:mod:`tspd_core.pd.prefill.rooms`, layerwise streaming in :mod:`tspd_core.pd.prefill.layerwise`;
this half owns the D sessions and the commands.
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

import torch

from tspd_core.ids import Room
from tspd_core.layout import CacheContract, encode_contract, parse_contract
from tspd_core.layout.routes import RoutePlan, plan_routes
from tspd_core.pd.errors import FrameError
from tspd_core.pd.metrics.registry import Labels, labels
from tspd_core.pd.prefill.jobs import JobBuilder
from tspd_core.pd.prefill.layerwise import LayerwiseRooms
from tspd_core.pd.prefill.state import (
    Destination,
    DSession,
    PRoom,
    Tombstone,
    check_complete,
    check_pre_allocation,
)
from tspd_core.pd.status import FailureCause, TransferPoll
from tspd_core.pd.status import TransferPoll as S
from tspd_core.pd.transfer.pool import TransferPool
from tspd_core.pd.transfer.staging import Stager, StagingLink
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import (
    PreAllocation,
    Registration,
    StageOffer,
    abort_message,
    decode_prefill_inbound,
)
from tspd_core.pd.worker.transfer_worker import WorkerSpec

log = logging.getLogger(__name__)


class PrefillWorker(LayerwiseRooms):
    """P's worker: owns the sessions, the rooms and the transfer pool (see module docstring)."""

    def __init__(self, spec: WorkerSpec, arena: torch.Tensor, notes: Connection) -> None:
        super().__init__(spec, arena, notes)
        self.contract: CacheContract = parse_contract(self.spec.contract.encode())
        self.p_rank = self.spec.tp_rank
        self.sessions: dict[str, DSession] = {}
        self.rejected: dict[str, tuple[str, int]] = {}  # session -> endpoint, for Failed replies
        self.failed_sessions: dict[str, float] = {}  # session -> when its write failed
        self.rooms: dict[Room, PRoom] = {}
        self.tombstones: dict[Room, Tombstone] = {}  # released rooms: late frames get Failed
        self._routes: dict[tuple[bytes, int], RoutePlan] = {}
        self._next_sweep = 0.0
        self.asleep = False
        self.links: dict[str, StagingLink] = {}  # D session -> its staging grant
        t = self.tunables
        self.stager = stager = Stager(self.engine, arena, t.stage_direct_bytes)
        max_run = t.max_run_bytes or 1 << 62
        self.pool = TransferPool(
            self.engine,
            t.queue_size,
            t.thread_pool_size,
            stager,
            max_run,
            t.fault_write_probability,
            self.metrics.job_done,
            t.inline_bytes,
            fault_seed=t.fault_write_seed,
            fault_rank=self.spec.dp_rank * self.spec.tp_size + self.spec.tp_rank,
        )
        self.jobs = JobBuilder(
            self.contract, self.p_rank, self.base_ptr, t, self.links, self.control
        )
        self._watch()
        self._register_with_bootstrap()

    def _register_with_bootstrap(self) -> None:
        from tspd_bootstrap.client import BootstrapClient

        spec = self.spec
        url = spec.bootstrap_url
        assert url is not None, "a prefill worker needs its bootstrap url"
        # WIRE §3: P PUTs once with a 5 s timeout, no retry: a dead or silent server is
        # reported in 5 s (refused: at once), not after retries and backoff (~20 s); the
        # node starts its own server before its ranks, so there is no race to retry over.
        with BootstrapClient(url, timeout=5.0, retries=0) as client:
            client.register_rank(
                engine_rank=spec.dp_rank * spec.tp_size + spec.tp_rank,
                world_size=spec.tp_size * spec.dp_size,
                dp_size=spec.dp_size,
                rank_ip=spec.host,
                rank_port=self.control.port,
                cache_layout=encode_contract(self.contract).decode(),
            )

    def _watch(self) -> None:
        m = self.metrics
        m.watch("gauge", "rooms", "Rooms this rank knows, by state", self._room_states)
        m.watch("gauge", "transfer_queue_jobs", "Write jobs queued, by queue", self._queues)
        m.watch("gauge", "d_sessions", "Registered D sessions", lambda: {(): len(self.sessions)})
        m.watch(
            "gauge",
            "failed_sessions",
            "D sessions refused after a failed write",
            lambda: {(): len(self.failed_sessions)},
        )

    def _room_states(self) -> dict[Labels, float]:
        states = (S.FAILED, S.BOOTSTRAPPING, S.BOOTSTRAPPED, S.SUCCESS)
        out = {labels(state=s.name.lower()): 0.0 for s in states}
        for room in self.rooms.values():
            out[labels(state=room.status.name.lower())] += 1
        return out

    def _queues(self) -> dict[Labels, float]:
        return {labels(queue=i): float(n) for i, n in enumerate(self.pool.queue_lengths())}

    def close(self) -> None:
        self.pool.close()
        super().close()

    def counters(self) -> dict[str, float]:
        s = self.pool.stats
        return {
            "rooms": len(self.rooms),
            "sessions": len(self.sessions),
            "staging_grants": len(self.links),
            "jobs": s.jobs,
            "failed_jobs": s.failed_jobs,
            "staged_jobs": s.staged_jobs,
            "bytes": s.bytes,
            "descriptors": s.descriptors,
            "busy_s": s.busy_s,
            **self.stager.stats,
        }

    # ---- sleep / wake -------------------------------------------------------------------

    def release_arena(self) -> str:
        busy = sorted(r.room for r in self.rooms.values() if r.pending or self._may_send(r))
        if busy:
            return f"KV of rooms {busy[:4]} may still go out"
        self.engine.unregister(self.base_ptr)
        self.asleep = True
        return ""

    def restore_arena(self) -> str:
        if self.asleep:
            self.engine.register(self.base_ptr, self.arena_bytes)
            self.asleep = False
        return ""

    @staticmethod
    def _may_send(room: PRoom) -> bool:
        # A room no request claimed (pre-allocations only) never sends: it does not hold sleep.
        return room.tracked and not room.status.is_final

    # ---- frames from D ranks ------------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        msg = decode_prefill_inbound(frames)
        if isinstance(msg, Registration):
            self._on_registration(msg)
        elif isinstance(msg, PreAllocation):
            self._on_pre_allocation(msg)
        elif isinstance(msg, StageOffer):
            self._on_offer(msg)
        else:
            link = self.links.get(msg.session_id)
            if link is None or link.offer.grant != msg.grant:
                raise FrameError(f"scatter ack from {msg.session_id} for no grant of ours")
            link.complete(msg)

    def _on_offer(self, offer: StageOffer) -> None:
        if offer.session_id not in self.sessions:
            raise FrameError(f"stage offer from unregistered session {offer.session_id}")
        if offer.session_id not in self.links:
            self.links[offer.session_id] = StagingLink(offer, self.tunables.stage_timeout_s)
            log.debug("staging grant from %s: %s", offer.session_id, offer)

    def _on_registration(self, reg: Registration) -> None:
        known = self.sessions.get(reg.session_id)
        if known is not None:
            if known.reg != reg:
                # Neither version can be trusted any more (the arena or layout changed under
                # one session id): the session goes, its rooms fail, its later pre-allocations
                # get Failed, until it registers afresh.
                del self.sessions[reg.session_id]
                self.links.pop(reg.session_id, None)
                self._reject(reg, "a different registration for an already registered session")
            else:
                self.failed_sessions.pop(reg.session_id, None)  # acceptance clears the mark
            return
        try:
            contract = parse_contract(reg.contract)
            route = self._route(reg.contract, contract, reg.tp_size)
        except ValueError as exc:
            self._reject(reg, str(exc))
            return
        if self.p_rank in route.targets(reg.tp_rank):
            dummy = False
        elif reg.tp_rank == 0 and route.is_dummy(self.p_rank):
            dummy = True
        else:
            self._reject(reg, f"P rank {self.p_rank} sends nothing to D rank {reg.tp_rank}")
            return
        self._retire_replaced(reg)
        self.sessions[reg.session_id] = DSession(reg, contract, route, dummy)
        self.rejected.pop(reg.session_id, None)
        self.failed_sessions.pop(reg.session_id, None)
        log.debug("registered D rank %d/%d (%s)", reg.tp_rank, reg.tp_size, reg.session_id)

    def _retire_replaced(self, reg: Registration) -> None:
        """A D rank that woke up registers again under a fresh session from the same socket:
        its old session is gone (and any room still using it cannot complete)."""
        for sid, old in list(self.sessions.items()):
            if (old.reg.endpoint, old.reg.port) != (reg.endpoint, reg.port):
                continue
            del self.sessions[sid]
            self.links.pop(sid, None)
            self.failed_sessions.pop(sid, None)
            log.info("D session %s replaced by %s", sid, reg.session_id)
            for room in list(self.rooms.values()):
                if sid in room.dests:
                    why = f"D session {sid} was replaced by {reg.session_id}"
                    self._fail(room, why, FailureCause.REMOTE)

    def _route(self, raw: bytes, contract: CacheContract, d_tp: int) -> RoutePlan:
        key = (raw, d_tp)
        if key not in self._routes:
            self._routes[key] = plan_routes(self.contract, self.spec.tp_size, contract, d_tp)
        return self._routes[key]

    def _reject(self, reg: Registration, why: str) -> None:
        log.warning("rejected registration of %s (D rank %d): %s", reg.session_id, reg.tp_rank, why)
        self.metrics.message_rejected("peer")
        self.rejected[reg.session_id] = (reg.endpoint, reg.port)
        for room in list(self.rooms.values()):
            if reg.session_id in room.dests:
                why = f"session {reg.session_id} was rejected: {why}"
                self._fail(room, why, FailureCause.REJECTED)

    def _on_pre_allocation(self, pa: PreAllocation) -> None:
        session = self.sessions.get(pa.session_id)
        if session is None:
            endpoint = self.rejected.get(pa.session_id)
            if endpoint is not None:
                self._push(endpoint, abort_message(pa.room, self.p_rank))
            raise FrameError(f"room {pa.room}: pre-allocation from unregistered {pa.session_id}")
        if pa.room in self.tombstones:
            self._push_session(session, abort_message(pa.room, self.p_rank))
            raise FrameError(f"room {pa.room}: pre-allocation for a released room")
        room = self.rooms.setdefault(pa.room, PRoom(pa.room, time.monotonic()))
        if room.status is TransferPoll.FAILED:
            if not room.exposed or room.released:
                self._push_session(session, abort_message(pa.room, self.p_rank))
                room.pushed.add(pa.session_id)
            room.dests.setdefault(pa.session_id, Destination(session, None))  # else: at release
            return
        if pa.session_id in self.failed_sessions:
            room.dests.setdefault(pa.session_id, Destination(session, None))
            why = f"room {pa.room}: session {pa.session_id} failed a write recently"
            self._fail(room, why, FailureCause.WRITE)
            return
        try:
            room.dests[pa.session_id] = check_pre_allocation(room, pa, session, self.p_rank)
            room.ready = check_complete(room, self.p_rank)
        except FrameError as exc:
            room.dests.setdefault(pa.session_id, Destination(session, None))
            self._fail(room, str(exc), FailureCause.REJECTED)
            return
        self._maybe_bootstrapped(room)

    def _maybe_bootstrapped(self, room: PRoom) -> None:
        if room.ready and room.tracked and room.status is TransferPoll.BOOTSTRAPPING:
            room.status = TransferPoll.BOOTSTRAPPED
            self._notify(room)

    # ---- commands from the engine -------------------------------------------------------

    def on_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.TrackRoom):
            self._on_track(msg)
        elif isinstance(msg, ipc.SubmitChunk):
            self._on_submit(msg)
        elif isinstance(msg, ipc.ArmChunk):
            self._on_arm(msg)
        elif isinstance(msg, ipc.BootstrapToken):
            self._on_token(msg)
        elif isinstance(msg, ipc.ReleaseRoom):
            self._on_release(msg)
        elif isinstance(msg, ipc.AbortRoom):
            target = self.rooms.get(msg.room)
            if target is not None and not target.status.is_final:
                self._fail(target, msg.reason or "aborted by the engine", msg.cause)
        else:
            raise FrameError(f"a prefill worker cannot handle {type(msg).__name__}")

    def _on_track(self, msg: ipc.TrackRoom) -> None:
        now = time.monotonic()
        stone = self.tombstones.pop(msg.room, None)
        room = self.rooms.setdefault(msg.room, PRoom(msg.room, now))
        room.tracked, room.tracked_at = True, now
        if stone is not None and stone.abort_reason is not None:
            self._fail(room, stone.abort_reason, FailureCause.ABORT)  # aborted before it came
        elif room.status is TransferPoll.FAILED:
            self._notify(room)
        self._maybe_bootstrapped(room)
