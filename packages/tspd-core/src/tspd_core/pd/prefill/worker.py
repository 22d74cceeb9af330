"""P's half of the transfer worker: its parts, wired together, and what reaches them.

A P rank's worker is a :class:`~tspd_core.pd.worker.transfer_worker.TransferWorker` holding a
:class:`PrefillWorker`, which is made of::

    RankRegistration ─ this rank's bootstrap entry and its lease   (prefill/registration.py)
    SealCheck ──────── D's cluster credential seals (if on)       (prefill/seals.py)
    DSessions ──────── registrations, routes, staging grants      (prefill/sessions.py)
    PrefillRooms ───── every room from its first sign to its end  (prefill/rooms.py)
    JobBuilder ─────── a chunk's routes become write jobs         (prefill/jobs.py)
    TransferPool ───── the transfer queues and threads            (transfer/pool.py)
    LayerwiseStreams ─ armed chunks, an interval at a time        (prefill/layerwise.py)

and dispatches to them — D's frames: registration → sessions, pre-allocation → rooms, stage
offer / scattered → sessions (with the credential on, a registration or stage offer goes
through the seal check first); the engine's commands: TrackRoom → rooms, SubmitChunk → the plain
path below, ArmChunk / BootstrapToken → streams / rooms, ReleaseRoom / AbortRoom → rooms.

    SubmitChunk ─► rooms.admit ─► jobs.jobs (one per D destination) ─► rooms.queue ─► pool
                                           job done (posted) ─► rooms.on_job_done ─► maybe_done
                                                   └─ all done + final chunk ─► Success to D

A chunk handed over while its room is still Bootstrapping (the engine prefilled before D's
pre-allocations arrived) is held and goes the same way the moment the room is Bootstrapped; so
is an armed one (layerwise), whose intervals the forward already passed then go out together.

A room's failure runs the rooms' ordered steps, then the hooks in ``rooms.on_failed`` in list
order — here the layerwise streams' :meth:`~LayerwiseStreams.end_waiting`. Control thread only.
"""

from __future__ import annotations

from functools import partial

from tspd_bootstrap.auth import AUTH_EXTENSION
from tspd_bootstrap.model import LEASE_EXTENSION
from tspd_core import trace
from tspd_core.layout import CacheContract, encode_contract, parse_contract
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.metrics.registry import Labels, labels
from tspd_core.pd.prefill.jobs import JobBuilder
from tspd_core.pd.prefill.layerwise import LayerwiseStreams
from tspd_core.pd.prefill.registration import RankRegistration, RankSpec
from tspd_core.pd.prefill.rooms import PrefillRooms
from tspd_core.pd.prefill.seals import SealCheck
from tspd_core.pd.prefill.sessions import DSessions
from tspd_core.pd.prefill.state import PRoom
from tspd_core.pd.status import FailureCause
from tspd_core.pd.status import TransferPoll as S
from tspd_core.pd.transfer.pool import TransferPool
from tspd_core.pd.transfer.staging import Stager
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import (
    STAGE_EXTENSION,
    PreAllocation,
    Registration,
    StageOffer,
    abort_message,
    decode_p_inbound,
)
from tspd_core.pd.worker.spec import WorkerSpec
from tspd_core.pd.worker.transfer_worker import TransferWorker, serve_transfer_worker


class PrefillWorker:
    """P's half of the transfer worker (see the module docstring)."""

    def __init__(self, worker: TransferWorker) -> None:
        spec, t = worker.spec, worker.tunables
        self.worker = worker
        self.contract: CacheContract = parse_contract(spec.contract.encode())
        self.p_rank = spec.tp_rank
        self.stager = Stager(
            worker.engine, worker.arena, t.stage_direct_bytes, t.inline_staged_bytes
        )
        self.pool = TransferPool(
            worker.engine,
            t.queue_size,
            t.thread_pool_size,
            self.stager,
            t.max_run_bytes or 1 << 62,
            t.fault_write_probability,
            worker.metrics.job_done,
            t.inline_bytes,
            fault_seed=t.fault_write_seed,
            fault_rank=spec.dp_rank * spec.tp_size + spec.tp_rank,
        )
        self.rooms = PrefillRooms(worker, self.p_rank, self.pool)
        self.sessions = DSessions(
            self.contract, spec.tp_size, self.p_rank, self.rooms, worker.metrics, t.stage_timeout_s
        )
        self.jobs = JobBuilder(
            self.contract, self.p_rank, worker.base_ptr, t, self.sessions.links, worker.control
        )
        self.streams = LayerwiseStreams(worker, spec.layerwise, self.rooms, self.jobs)
        self.rooms.on_failed.append(self.streams.end_waiting)
        self.rooms.on_bootstrapped.append(self._submit_held)
        self.seals = (
            SealCheck(spec.credential, worker.metrics) if spec.credential is not None else None
        )
        self._watch()
        self.registration = self._register_with_bootstrap(spec)

    def _register_with_bootstrap(self, spec: WorkerSpec) -> RankRegistration:
        url = spec.bootstrap_url
        assert url is not None, "a prefill worker needs its bootstrap url"
        # We take D's ordered staging offers, renew our lease, and (with the credential)
        # take only sealed registrations: tspd D peers see it in their look-up.
        extensions: tuple[str, ...] = (STAGE_EXTENSION, LEASE_EXTENSION)
        if spec.credential is not None:
            extensions += (AUTH_EXTENSION,)
        entry = RankSpec(
            engine_rank=spec.dp_rank * spec.tp_size + spec.tp_rank,
            world_size=spec.tp_size * spec.dp_size,
            dp_size=spec.dp_size,
            rank_ip=spec.host,
            rank_port=self.worker.control.port,
            cache_layout=encode_contract(self.contract).decode(),
            extensions=extensions,
        )
        registration = RankRegistration(url, entry, spec.credential)
        try:
            registration.register()
        except BaseException:
            registration.close()
            raise
        registration.start_renewing()
        return registration

    def close(self) -> None:
        self.registration.close()
        self.pool.close()
        self.streams.close()

    # ---- frames from D ranks ------------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        msg = decode_p_inbound(frames)
        if self.seals is not None and isinstance(msg, Registration | StageOffer):
            self.seals.check(msg, frames)  # raises: dropped before any session is looked at
        if isinstance(msg, Registration):
            self.sessions.register(msg)
        elif isinstance(msg, PreAllocation):
            self._on_pre_allocation(msg)
        elif isinstance(msg, StageOffer):
            link = self.sessions.offer(msg)
            session = self.sessions.get(msg.session_id)
            if link is not None and session is not None:  # off the control thread
                self.pool.warm(session.reg.rpc_port, msg.session_id, link)
            if link is not None:  # this thread's buffer for inline staged jobs (once)
                self.stager.warm_inline()
        else:
            self.sessions.scattered(msg)

    def _on_pre_allocation(self, pa: PreAllocation) -> None:
        trace.mark_room(pa.room, "pw.prealloc")
        session = self.sessions.get(pa.session_id)
        if session is None:
            endpoint = self.sessions.rejected_endpoint(pa.session_id)
            if endpoint is not None:
                self.rooms.push(endpoint, abort_message(pa.room, self.p_rank))
            raise FrameError(f"room {pa.room}: pre-allocation from unregistered {pa.session_id}")
        self.rooms.pre_allocated(pa, session)

    # ---- commands from the engine -------------------------------------------------------

    def on_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.TrackRoom):
            self.rooms.track(msg)
        elif isinstance(msg, ipc.SubmitChunk):
            self._submit(msg)
        elif isinstance(msg, ipc.ArmChunk):
            self.streams.arm(msg)
        elif isinstance(msg, ipc.BootstrapToken):
            self.rooms.first_token(msg)
        elif isinstance(msg, ipc.ReleaseRoom):
            self.rooms.release(msg)
        elif isinstance(msg, ipc.AbortRoom):
            self.rooms.abort(msg)
        else:
            raise FrameError(f"a prefill worker cannot handle {type(msg).__name__}")

    def _submit(self, chunk: ipc.SubmitChunk) -> None:
        """The plain path: the forward that wrote the chunk is done; its KV goes out now."""
        room = self.rooms.admit(chunk)
        if room is None:
            return
        try:
            jobs = self.jobs.jobs(room, chunk, self.rooms.job_done)
        except (PdError, ValueError) as exc:
            why = f"cannot plan chunk [{chunk.start}, {chunk.end}): {exc}"
            self.rooms.fail(room, why, FailureCause.BAD_FRAME)
            return
        room.chunks += 1
        if chunk.final:
            room.final = chunk
        trace.mark_room(room.room, "pw.planned", str(len(jobs)))
        self.rooms.queue(room, jobs)
        self.rooms.maybe_done(room)
        self.worker.run_posted()  # a job that landed inline: its Success goes now

    def _submit_held(self, room: PRoom) -> None:
        """The room turned Bootstrapped: its chunks handed over early go out now, in order."""
        held, room.held = room.held, []
        token, room.held_token = room.held_token, None
        for chunk in held:
            if isinstance(chunk, ipc.ArmChunk):
                self.streams.arm(chunk)  # intervals the counter passed go out at once
            else:
                self._submit(chunk)
        if token is not None:
            self.rooms.first_token(token)  # the armed final chunk's, come while it was held

    def on_tick(self, now: float) -> None:
        self.rooms.sweep(now)

    def idle(self) -> bool:
        return not self.rooms.rooms

    # ---- sleep / wake, counters, gauges -------------------------------------------------

    def release_arena(self) -> str:
        busy = self.rooms.may_send()
        if busy:
            return f"KV of rooms {busy[:4]} may still go out"
        self.worker.engine.unregister(self.worker.base_ptr)
        self.rooms.asleep = True
        return ""

    def restore_arena(self) -> str:
        if self.rooms.asleep:
            self.worker.engine.register(self.worker.base_ptr, self.worker.arena_bytes)
            self.rooms.asleep = False
        return ""

    def counters(self) -> dict[str, float]:
        s = self.pool.stats
        return {
            "rooms": len(self.rooms.rooms),
            "sessions": len(self.sessions.sessions),
            "staging_grants": len(self.sessions.links),
            "jobs": s.jobs,
            "failed_jobs": s.failed_jobs,
            "staged_jobs": s.staged_jobs,
            "inline_jobs": s.inline_jobs,
            "bytes": s.bytes,
            "descriptors": s.descriptors,
            "busy_s": s.busy_s,
            **self.stager.stats,
        }

    def _wire_descriptors(self) -> dict[Labels, float]:
        staged = self.stager.stats["staged_wire_descriptors"]
        return {(): float(self.pool.stats.wire_descriptors + staged)}

    def _watch(self) -> None:
        m, sessions, rooms = self.worker.metrics, self.sessions, self.rooms
        m.watch("gauge", "rooms", "Rooms this rank knows, by state", self._room_states)
        m.watch("gauge", "transfer_queue_jobs", "Write jobs queued, by queue", self._queues)
        m.watch(
            "counter",
            "transfer_wire_descriptors_total",
            "Descriptors handed to the transfer engine (after staging and cutting long runs)",
            self._wire_descriptors,
        )
        m.watch(
            "gauge", "d_sessions", "Registered D sessions", lambda: {(): len(sessions.sessions)}
        )
        m.watch(
            "gauge",
            "failed_sessions",
            "D sessions refused after a failed write",
            lambda: {(): len(rooms.failed_sessions)},
        )

    def _room_states(self) -> dict[Labels, float]:
        states = (S.FAILED, S.BOOTSTRAPPING, S.BOOTSTRAPPED, S.SUCCESS)
        out = {labels(state=s.name.lower()): 0.0 for s in states}
        for room in self.rooms.rooms.values():
            out[labels(state=room.status.name.lower())] += 1
        return out

    def _queues(self) -> dict[Labels, float]:
        return {labels(queue=i): float(n) for i, n in enumerate(self.pool.queue_lengths())}


#: The entry point of a P rank's transfer worker process (what its peer spawns).
main = partial(serve_transfer_worker, role=PrefillWorker)
