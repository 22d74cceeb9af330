"""D's half of the transfer worker: its parts, wired together, and what reaches them.

A D rank's worker is a :class:`~tspd_core.pd.worker.transfer_worker.TransferWorker` holding a
:class:`DecodeWorker`, which is made of::

    PrefillDirectory ─ where a room's P ranks are (bootstrap look-ups)  (decode/directory.py)
    DecodeRooms ────── every room and how it ends (P's answers)         (decode/rooms.py)
    PrefillExchange ── registrations, grants, manifests, scatter acks   (decode/exchange.py)
    StagingArea ────── D's staging slots and the scatter thread         (transfer/scatter.py)
    Heartbeat ──────── GET /health on the bootstrap servers it uses     (decode/heartbeat.py)

Life of a room on D (control thread; the rooms tell the engine-side peer)::

    TrackRoom ──► Bootstrapping ── look-up (cached: inline; else a helper thread, HTTP)
                      │                 │ registration to each contacted P rank, once per
                      │                 ▼ (address, DP group, contact set); staging grants
                      │            Bootstrapped (notify) ── engine zeroes the pages ──┐
                      │                 (or: the manifest came early, held: at once)  ▼
                      │        PublishManifest ─► pre-allocations ─► WaitingForInput (notify)
                      │                                                   │ Success from P ranks
                      │                                                   ▼ (exact target set)
                      │                                          Success (notify, first token)
                      └── look-up failed / P aborted / bad Success / waiting timeout /
                          heartbeat / engine abort ─► Failed (notify; "quiet" once no P write
                          can land any more: see DRoom.quiet)

A P rank's status frame counts only after the scatters that rank requested before it (D's
staging offers are ordered): :meth:`DecodeWorker.on_peer` defers it behind them. The heartbeat
declares a P instance dead when its bootstrap server stops answering: its cached routes and
registrations go, its unfinished rooms fail. A room that fails for any other reason drops the
cached addresses of the P ranks it contacted and the registration with them
(:meth:`DecodeWorker._look_up_again`): the next room of that DP group asks the bootstrap server
again, so a P rank that moved — or a wrong address an operator removed — costs failed rooms
only until then, not until D restarts.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from tspd_core import trace
from tspd_core.ids import Room
from tspd_core.layout import encode_contract, parse_contract
from tspd_core.pd.decode.directory import Lookup, PrefillDirectory
from tspd_core.pd.decode.exchange import PrefillExchange
from tspd_core.pd.decode.heartbeat import Heartbeat
from tspd_core.pd.decode.rooms import DecodeRooms
from tspd_core.pd.decode.state import DRoom
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.metrics.registry import labels
from tspd_core.pd.status import FailureCause, TransferPoll
from tspd_core.pd.transfer.scatter import StagingArea
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import ScatterRequest, StatusMessage, decode_d_inbound
from tspd_core.pd.worker.transfer_worker import TransferWorker, serve_transfer_worker
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

LOOKUP_THREADS = 4
SWEEP_S = 0.5


class DecodeWorker:
    """D's half of the transfer worker (see the module docstring)."""

    def __init__(self, worker: TransferWorker) -> None:
        spec, t = worker.spec, worker.tunables
        self.worker = worker
        contract = parse_contract(spec.contract.encode())
        self.directory = PrefillDirectory(contract, spec.tp_size, spec.tp_rank, spec.credential)
        self.rooms = DecodeRooms(worker)
        self.rooms.on_failed.append(self._look_up_again)
        self._lookups = ThreadPoolExecutor(
            LOOKUP_THREADS, thread_name_prefix="tspd-lookup", initializer=name_this_thread
        )
        self._next_sweep = 0.0
        self.staging = (
            StagingArea(
                worker.engine,
                worker.arena,
                t.staging_bytes,
                t.staging_slots,
                t.inline_scatter_bytes,
            )
            if t.staging_bytes
            else None
        )
        self.exchange = PrefillExchange(worker, self.rooms, encode_contract(contract), self.staging)
        self.heartbeat = Heartbeat(
            t.heartbeat_interval_s, t.heartbeat_max_failure, worker.post, self._probed, self._dead
        )
        self._watch()

    def close(self) -> None:
        self.heartbeat.close()
        self._lookups.shutdown(wait=True, cancel_futures=True)
        if self.staging is not None:
            self.staging.close()
        self.directory.close()

    # ---- frames from P ranks ------------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        inbound = decode_d_inbound(frames)
        if isinstance(inbound, ScatterRequest):
            self.exchange.on_scatter(inbound)
            return
        self._on_status(inbound)

    def _on_status(self, status: StatusMessage) -> None:
        # Our staging offers promise P ranks that a status frame counts only once the
        # scatters requested before it are done (P does not wait for their acks).
        trace.mark_room(status.room, "dw.status", status.status.name)
        post = self.worker.post
        if self.staging is None or not self.staging.after_scatters(
            lambda: post(lambda: self.rooms.on_status(status))
        ):
            self.rooms.on_status(status)

    # ---- commands from the engine -------------------------------------------------------

    def on_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.TrackRoom):
            self._track(msg)
        elif isinstance(msg, ipc.PublishManifest):
            self.exchange.publish(msg)
        elif isinstance(msg, ipc.ReleaseRoom):
            self.rooms.forget(msg.room)
        elif isinstance(msg, ipc.AbortRoom):
            room = self.rooms.get(msg.room)
            if room is not None and not room.status.is_final:
                # With the manifest out, P may be writing: the room is quiet once P answers.
                self.rooms.fail(msg.room, msg.reason or "aborted by the engine", msg.cause)
        else:
            raise FrameError(f"a decode worker cannot handle {type(msg).__name__}")

    def _track(self, msg: ipc.TrackRoom) -> None:
        address = f"{msg.bootstrap_host}:{msg.bootstrap_port}"
        self.rooms.track(msg.room, address)
        known = self.directory.cached(address, msg.room)
        if known is not None:  # the common case: no HTTP, no thread hop
            self._on_lookup(msg.room, known)
        else:
            self._lookups.submit(self._lookup, msg.room, address)

    def _lookup(self, room: Room, address: str) -> None:
        """On a helper thread: resolve the P ranks, then continue on the control thread."""
        try:
            found = self.directory.lookup(address, room)
        except PdError as exc:
            reason = str(exc)
            self._count_lookup("failed")
            self.worker.post(lambda: self.rooms.fail(room, reason, FailureCause.LOOKUP))
            return
        self._count_lookup("ok")
        self.worker.post(lambda: self._on_lookup(room, found))

    def _count_lookup(self, result: str) -> None:
        m = self.worker.metrics
        m.registry.inc(m.lookups, at=labels(result=result))

    def _on_lookup(self, room_id: Room, found: Lookup) -> None:
        """The P ranks are known: register with them, grant staging, then Bootstrapped."""
        room = self.rooms.get(room_id)
        if room is None or room.status is not TransferPoll.BOOTSTRAPPING:
            return
        room.lookup = found
        room.targets = frozenset(found.instance.route.targets(self.worker.spec.tp_rank))
        try:
            self.exchange.register(room.address, found)
        except PdError as exc:
            self.rooms.fail(room_id, str(exc), FailureCause.LOOKUP)
            return
        self.exchange.offer_staging(room.address, found, room.targets)
        if room.manifest is None:
            self.rooms.update(room, TransferPoll.BOOTSTRAPPED)
            return
        # The engine handed the manifest over early: the pre-allocations go first (the
        # engine hears WaitingForInput after; a note's wake-up would preempt the send).
        room.status = TransferPoll.BOOTSTRAPPED
        self.exchange.publish_held(room)

    def _look_up_again(self, room: DRoom) -> None:
        """``room`` failed: forget where its P ranks were and that we registered with them,
        so the next room of its DP group looks them up afresh (an abort costs one look-up)."""
        found = room.lookup
        if found is None:
            return
        dropped = self.directory.drop(room.address, found.dp_group, found.endpoints)
        self.exchange.forget_group(room.address, found.dp_group)
        if not dropped:
            return
        m = self.worker.metrics
        m.registry.inc(m.endpoint_drops, len(dropped))
        level = logging.DEBUG if room.cause == FailureCause.ABORT else logging.INFO
        log.log(
            level,
            "room %d failed (%s): P ranks %s of %s (DP group %d) will be looked up again",
            room.room,
            room.cause,
            sorted(found.endpoints),
            room.address,
            found.dp_group,
        )

    # ---- heartbeat and timeouts ---------------------------------------------------------

    def _probed(self, address: str, ok: bool) -> None:
        m = self.worker.metrics
        m.registry.inc(m.probes, at=labels(result="ok" if ok else "failed"))

    def _dead(self, address: str, why: str) -> None:
        """The heartbeat gave up on ``address``: forget it, fail its unfinished rooms."""
        m = self.worker.metrics
        m.registry.inc(m.node_failures)
        for ip, port in self.directory.forget(address):
            self.worker.control.forget(ip, port)
        self.exchange.forget(address)
        self.rooms.fail_address(address, f"P instance at {address} presumed dead: {why}")

    def idle(self) -> bool:
        return not self.rooms.rooms

    def on_tick(self, now: float) -> None:
        if self.heartbeat.due(now):
            # Instances D reached (a room still looking up fails on its own look-up).
            rooms = self.rooms.rooms.values()
            known = {r.address for r in rooms if r.lookup is not None}
            self.heartbeat.tick(now, self.directory.addresses() | known)
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        self.rooms.sweep(now, self.worker.tunables.waiting_timeout_s)

    # ---- sleep / wake, counters, gauges -------------------------------------------------

    def release_arena(self) -> str:
        if self.rooms.rooms:
            return f"rooms {sorted(self.rooms.rooms)[:4]} are still tracked"
        self.worker.engine.unregister(self.worker.base_ptr)
        return ""

    def restore_arena(self) -> str:
        """A fresh Mooncake session: P ranks learn it from new registrations, so every
        registration and staging grant made under the old session is forgotten."""
        if self.rooms.rooms:
            return f"rooms {sorted(self.rooms.rooms)[:4]} are still tracked"
        w = self.worker
        old, w.engine = w.engine, w.new_engine()
        w.engine.register(w.base_ptr, w.arena_bytes)
        if self.staging is not None:
            self.staging.rebind(w.engine)
        old.close()
        self.exchange.reset()
        log.info("restored under session %s (was %s)", w.engine.session_id, old.session_id)
        return ""

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {
            "rooms": len(self.rooms.rooms),
            "registrations": len(self.exchange.registered),
        }
        if self.staging is not None:
            out.update(self.staging.counters())
        return out

    def _watch(self) -> None:
        m, exchange = self.worker.metrics, self.exchange
        m.watch("gauge", "rooms", "Rooms this rank tracks, by state", self.rooms.states)
        m.watch(
            "gauge",
            "registrations",
            "Registrations sent (address, DP group, P ranks)",
            lambda: {(): len(exchange.registered)},
        )
        staging = self.staging
        if staging is not None:
            stats = staging.counters
            m.watch(
                "gauge",
                "scatter_queue",
                "Staged pieces waiting for their scatter",
                lambda: {(): staging.queue_length()},
            )
            m.watch(
                "counter",
                "scatters_total",
                "Staged pieces scattered, by result",
                lambda: {
                    labels(result="ok"): stats()["scatters"],
                    labels(result="refused"): stats()["refused_scatters"],
                },
            )
            m.watch(
                "counter",
                "scattered_bytes_total",
                "Bytes scattered from staging",
                lambda: {(): stats()["scattered_bytes"]},
            )


#: The entry point of a D rank's transfer worker process (what its peer spawns).
main = partial(serve_transfer_worker, role=DecodeWorker)
