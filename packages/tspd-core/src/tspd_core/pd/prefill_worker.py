"""The P rank's transfer worker: registrations, pre-allocations, writes, Success and aborts.

Life of a room on P (control thread; ``notify`` publishes to the engine-side peer)::

    TrackRoom ─┐                    ┌─ pre-allocations (any order, before or after TrackRoom)
               ▼                    ▼
          Bootstrapping ── fan-out reached, consistent ──► Bootstrapped (notify)
               │                                                │ SubmitChunk(s) → write jobs
               │                                                ▼
               │                           all jobs done + final chunk ──► Success: status
               │                                                │      frames to every real D
               └── bad/duplicate/excess pre-allocation, ────────┴──► Failed: abort pushes once
                   write failure, timeout, early release              the room's writes drained

A room is never reported Failed while its writes are still running: the engine frees P's
pages on that event, and D frees its pages on the abort push, so both wait for the drain.
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

import torch

from tspd_core.ids import Room
from tspd_core.layout import CacheContract, chunk_positions, encode_contract, parse_contract
from tspd_core.layout.copies import plan_copies
from tspd_core.layout.routes import RoutePlan, plan_routes
from tspd_core.pd import ipc
from tspd_core.pd.errors import FrameError, PdError, TransferError
from tspd_core.pd.prefill_state import (
    Destination,
    DSession,
    PRoom,
    check_complete,
    check_pre_allocation,
    source_manifest,
)
from tspd_core.pd.runtime import RoleWorker, WorkerSpec
from tspd_core.pd.staging import StagedJob, Stager, StagingLink
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.transfer import TransferPool, WriteJob
from tspd_core.pd.wire import (
    PreAllocation,
    Registration,
    ScatterRequest,
    StageOffer,
    StatusMessage,
    abort_message,
    decode_prefill_inbound,
    encode_scatter,
    encode_status,
)

log = logging.getLogger(__name__)

SWEEP_S = 0.5


class PrefillWorker(RoleWorker):
    """P's worker: owns the sessions, the rooms and the transfer pool (see module docstring)."""

    def __init__(self, spec: WorkerSpec, arena: torch.Tensor, notes: Connection) -> None:
        super().__init__(spec, arena, notes)
        self.contract: CacheContract = parse_contract(self.spec.contract.encode())
        self.p_rank = self.spec.tp_rank
        self.sessions: dict[str, DSession] = {}
        self.rejected: dict[str, tuple[str, int]] = {}  # session -> endpoint, for Failed replies
        self.failed_sessions: dict[str, float] = {}  # session -> when its write failed
        self.rooms: dict[Room, PRoom] = {}
        self.tombstones: dict[Room, float] = {}  # released rooms: late frames get Failed
        self._routes: dict[tuple[bytes, int], RoutePlan] = {}
        self._next_sweep = 0.0
        self.links: dict[str, StagingLink] = {}  # D session -> its staging grant
        t = self.tunables
        stager = Stager(self.engine, arena)
        max_run = t.max_run_bytes or 1 << 62
        self.pool = TransferPool(self.engine, t.queue_size, t.thread_pool_size, stager, max_run)
        self._register_with_bootstrap()

    def _register_with_bootstrap(self) -> None:
        from tspd_bootstrap.client import BootstrapClient

        spec = self.spec
        url = spec.bootstrap_url
        assert url is not None, "a prefill worker needs its bootstrap url"
        with BootstrapClient(url, timeout=5.0) as client:
            client.register_rank(
                engine_rank=spec.dp_rank * spec.tp_size + spec.tp_rank,
                world_size=spec.tp_size * spec.dp_size,
                dp_size=spec.dp_size,
                rank_ip=spec.host,
                rank_port=self.control.port,
                cache_layout=encode_contract(self.contract).decode(),
            )

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
        }

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
                self._reject(reg, "a different registration for an already registered session")
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
        self.sessions[reg.session_id] = DSession(reg, contract, route, dummy)
        self.rejected.pop(reg.session_id, None)
        self.failed_sessions.pop(reg.session_id, None)
        log.debug("registered D rank %d/%d (%s)", reg.tp_rank, reg.tp_size, reg.session_id)

    def _route(self, raw: bytes, contract: CacheContract, d_tp: int) -> RoutePlan:
        key = (raw, d_tp)
        if key not in self._routes:
            self._routes[key] = plan_routes(self.contract, self.spec.tp_size, contract, d_tp)
        return self._routes[key]

    def _reject(self, reg: Registration, why: str) -> None:
        log.warning("rejected registration of %s (D rank %d): %s", reg.session_id, reg.tp_rank, why)
        self.rejected[reg.session_id] = (reg.endpoint, reg.port)
        for room in list(self.rooms.values()):
            if reg.session_id in room.dests:
                self._fail(room, f"session {reg.session_id} was rejected: {why}")

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
            self._push_session(session, abort_message(pa.room, self.p_rank))
            return
        try:
            if pa.session_id in self.failed_sessions:
                raise FrameError(f"session {pa.session_id} failed a write recently")
            room.dests[pa.session_id] = check_pre_allocation(room, pa, session, self.p_rank)
            room.ready = check_complete(room, self.p_rank)
        except FrameError as exc:
            room.dests.setdefault(pa.session_id, Destination(session, None))
            self._fail(room, str(exc))
            return
        self._maybe_bootstrapped(room)

    def _maybe_bootstrapped(self, room: PRoom) -> None:
        if room.ready and room.tracked and room.status is TransferPoll.BOOTSTRAPPING:
            room.status = TransferPoll.BOOTSTRAPPED
            self._notify(room)

    # ---- commands from the engine -------------------------------------------------------

    def on_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.TrackRoom):
            room = self.rooms.setdefault(msg.room, PRoom(msg.room, time.monotonic()))
            room.tracked = True
            self.tombstones.pop(msg.room, None)
            if room.status is TransferPoll.FAILED:
                self._notify(room)
            self._maybe_bootstrapped(room)
        elif isinstance(msg, ipc.SubmitChunk):
            self._on_submit(msg)
        elif isinstance(msg, ipc.ReleaseRoom):
            self._on_release(msg)
        elif isinstance(msg, ipc.AbortRoom):
            target = self.rooms.get(msg.room)
            if target is not None and not target.status.is_final:
                self._fail(target, msg.reason or "aborted by the engine")
        else:
            raise FrameError(f"a prefill worker cannot handle {type(msg).__name__}")

    def _on_submit(self, chunk: ipc.SubmitChunk) -> None:
        room = self.rooms.get(chunk.room)
        if room is None or room.status is TransferPoll.FAILED:
            return  # released or failed meanwhile: the engine learns it from poll
        if room.status is not TransferPoll.BOOTSTRAPPED or room.final is not None:
            self._fail(room, f"chunk [{chunk.start}, {chunk.end}) submitted out of order")
            return
        try:
            jobs = self._plan_jobs(room, chunk)
        except (PdError, ValueError) as exc:
            self._fail(room, f"cannot plan chunk [{chunk.start}, {chunk.end}): {exc}")
            return
        room.chunks += 1
        if chunk.final:
            room.final = chunk
        queue = self.pool.queue_for(room.rpc_port_sum)
        for job in jobs:
            room.pending += 1
            self.pool.submit(queue, job)
        self._maybe_done(room)

    def _plan_jobs(self, room: PRoom, chunk: ipc.SubmitChunk) -> list[WriteJob]:
        jobs = []
        for sid, dest in room.dests.items():
            if dest.manifest is None:
                continue
            src = source_manifest(self.contract, chunk.block_ids, dest.manifest)
            positions = chunk_positions(
                self.contract, dest.manifest, chunk.start, chunk.end, first=room.chunks == 0
            )
            copies = plan_copies(
                dest.session.route,
                self.p_rank,
                dest.session.reg.tp_rank,
                src,
                dest.manifest,
                positions=positions,
            )
            if len(copies):
                reg = dest.session.reg
                job = WriteJob(
                    room.room,
                    sid,
                    copies.src,
                    copies.dst,
                    copies.length,
                    self.base_ptr,
                    reg.base_ptr,
                    self._job_done,
                    room.cancel,
                    self._staging(sid, reg, len(copies), copies.nbytes),
                )
                jobs.append(job)
        return jobs

    def _staging(self, sid: str, reg: Registration, runs: int, nbytes: int) -> StagedJob | None:
        """Stage when D granted slots and there are many runs, small on average."""
        link, t = self.links.get(sid), self.tunables
        if link is None or runs < t.stage_min_runs or nbytes >= runs * t.stage_below_bytes:
            return None

        def send(req: ScatterRequest) -> None:
            self.control.send(reg.endpoint, reg.port, encode_scatter(req))

        return StagedJob(link, send)

    def _job_done(self, job: WriteJob, error: TransferError | None) -> None:
        """On a transfer thread: hand the result to the control thread."""
        self.post(lambda: self._on_job_done(job, error))

    def _on_job_done(self, job: WriteJob, error: TransferError | None) -> None:
        room = self.rooms.get(job.room)
        if room is None:
            return
        room.pending -= 1
        if error is not None and room.status is not TransferPoll.FAILED:
            self.failed_sessions[job.session] = time.monotonic()
            self._fail(room, str(error))
        self._maybe_done(room)

    def _maybe_done(self, room: PRoom) -> None:
        if room.pending:
            return
        if room.status is TransferPoll.FAILED:
            self._finish_failed(room)
        elif room.final is not None and room.status is TransferPoll.BOOTSTRAPPED:
            room.status = TransferPoll.SUCCESS
            f = room.final
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
            self._notify(room)

    def _on_release(self, msg: ipc.ReleaseRoom) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            return
        if not room.status.is_final:
            self._fail(room, msg.reason or "released by the engine before it finished")
        if room.pending == 0:
            del self.rooms[msg.room]
        room.tracked = False
        self.tombstones[msg.room] = time.monotonic()

    # ---- failure ------------------------------------------------------------------------

    def _fail(self, room: PRoom, reason: str) -> None:
        if room.status is TransferPoll.FAILED:
            return
        log.warning("room %d: %s", room.room, reason)
        room.status, room.reason = TransferPoll.FAILED, reason
        room.cancel.set()
        if room.pending == 0:
            self._finish_failed(room)

    def _finish_failed(self, room: PRoom) -> None:
        """Once no write of the room runs: abort pushes to every real D, then tell the engine."""
        if not room.aborted:
            room.aborted = True
            abort = abort_message(room.room, self.p_rank)
            for dest in room.dests.values():
                if not dest.session.dummy:
                    self._push_session(dest.session, abort)
        self._notify(room)
        if not room.tracked and room.room in self.tombstones:
            self.rooms.pop(room.room, None)

    def _notify(self, room: PRoom) -> None:
        if room.tracked and room.notified is not room.status:
            room.notified = room.status
            self.notify(ipc.RoomUpdate(room.room, room.status, reason=room.reason))

    def _push_session(self, session: DSession, msg: StatusMessage) -> None:
        self._push((session.reg.endpoint, session.reg.port), msg)

    def _push(self, endpoint: tuple[str, int], msg: StatusMessage) -> None:
        try:
            self.control.send(endpoint[0], endpoint[1], encode_status(msg))
        except PdError as exc:
            log.error("room %d: cannot push status to %s:%d: %s", msg.room, *endpoint, exc)

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
                self._fail(room, f"still bootstrapping after {t.bootstrap_timeout_s:g} s")
            if not room.tracked and room.pending == 0:
                self.rooms.pop(room.room, None)  # the engine never asked for it
                self.tombstones[room.room] = now
        ttl = max(t.failed_session_ttl_s, t.bootstrap_timeout_s)
        for key, since in list(self.tombstones.items()):
            if now - since > ttl:
                del self.tombstones[key]
        for sid, since in list(self.failed_sessions.items()):
            if t.failed_session_ttl_s <= 0 or now - since > t.failed_session_ttl_s:
                del self.failed_sessions[sid]
