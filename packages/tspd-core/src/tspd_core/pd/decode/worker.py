"""The D rank's transfer worker: find the P ranks, register, publish manifests, collect Success.

Life of a room on D (control thread; ``notify`` publishes to the engine-side peer)::

    TrackRoom ──► Bootstrapping ── look-up (helper thread: bootstrap HTTP, cached per address)
                      │                 │ registration to each contacted P rank, once per
                      │                 ▼ (address, DP group, contact set)
                      │            Bootstrapped (notify) ── engine zeroes the pages ──┐
                      │                                                               ▼
                      │        PublishManifest ─► pre-allocations ─► WaitingForInput (notify)
                      │                                                   │ Success from P ranks
                      │                                                   ▼ (exact target set)
                      │                                          Success (notify, first token)
                      └── look-up failed / P aborted / bad Success / waiting timeout /
                          heartbeat / engine abort ─► Failed (notify; "quiet" once no P write
                          can land any more: see DRoom.quiet)

D never sends aborts (WIRE §2.4); a Failed room is reported and forgotten on release. The
heartbeat (:mod:`tspd_core.pd.decode.heartbeat`) declares a P instance dead when its bootstrap
server stops answering: its cached routes and registrations go, its unfinished rooms fail.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import torch

from tspd_core.ids import Room
from tspd_core.layout import encode_contract, parse_contract
from tspd_core.pd.decode.exchange import DecodeTalk
from tspd_core.pd.decode.heartbeat import Heartbeat
from tspd_core.pd.decode.state import DRoom, Lookup, PrefillDirectory
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.metrics.registry import Labels, labels
from tspd_core.pd.status import FailureCause, TransferPoll
from tspd_core.pd.transfer.staging import StagingArea
from tspd_core.pd.wire import ipc
from tspd_core.pd.worker.transfer_worker import WorkerSpec

log = logging.getLogger(__name__)

LOOKUP_THREADS = 4
SWEEP_S = 0.5


class DecodeWorker(DecodeTalk):
    """D's worker: owns the rooms and the registrations sent (see module docstring)."""

    def __init__(self, spec: WorkerSpec, arena: torch.Tensor, notes: Connection) -> None:
        super().__init__(spec, arena, notes)
        contract = parse_contract(spec.contract.encode())
        self.contract_bytes = encode_contract(contract)
        self.directory = PrefillDirectory(contract, spec.tp_size, spec.tp_rank)
        self.rooms: dict[Room, DRoom] = {}
        self.registered: set[tuple[str, int, tuple[int, ...]]] = set()
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="tspd-lookup")
        self._next_sweep = 0.0
        t = self.tunables
        self.staging = (
            StagingArea(self.engine, arena, t.staging_bytes, t.staging_slots)
            if t.staging_bytes
            else None
        )
        self.granted: set[tuple[str, int, int]] = set()  # (address, DP group, P rank)
        self.heartbeat = Heartbeat(
            t.heartbeat_interval_s, t.heartbeat_max_failure, self.post, self._probed, self._dead
        )
        self._watch()

    def close(self) -> None:
        self.heartbeat.close()
        self._lookups.shutdown(wait=True, cancel_futures=True)
        if self.staging is not None:
            self.staging.close()
        self.directory.close()
        super().close()

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {"rooms": len(self.rooms), "registrations": len(self.registered)}
        if self.staging is not None:
            out.update(self.staging.counters())
        return out

    def _watch(self) -> None:
        m = self.metrics
        m.watch("gauge", "rooms", "Rooms this rank tracks, by state", self._room_states)
        m.watch(
            "gauge",
            "registrations",
            "Registrations sent (address, DP group, P ranks)",
            lambda: {(): len(self.registered)},
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

    def _room_states(self) -> dict[Labels, float]:
        out = {labels(state=s.name.lower()): 0.0 for s in TransferPoll if s != 4}
        for room in self.rooms.values():
            out[labels(state=room.status.name.lower())] += 1
        return out

    # ---- sleep / wake -------------------------------------------------------------------

    def release_arena(self) -> str:
        if self.rooms:
            return f"rooms {sorted(self.rooms)[:4]} are still tracked"
        self.engine.unregister(self.base_ptr)
        return ""

    def restore_arena(self) -> str:
        """A fresh Mooncake session: P ranks learn it from new registrations, so every
        registration and staging grant made under the old session is forgotten."""
        if self.rooms:
            return f"rooms {sorted(self.rooms)[:4]} are still tracked"
        old, self.engine = self.engine, self.new_engine()
        self.engine.register(self.base_ptr, self.arena_bytes)
        if self.staging is not None:
            self.staging.rebind(self.engine)
        old.close()
        self.registered.clear()
        self.granted.clear()
        log.info("restored under session %s (was %s)", self.engine.session_id, old.session_id)
        return ""

    # ---- commands from the engine -------------------------------------------------------

    def on_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.TrackRoom):
            address = f"{msg.bootstrap_host}:{msg.bootstrap_port}"
            self.rooms[msg.room] = DRoom(msg.room, address, time.monotonic())
            known = self.directory.cached(address, msg.room)
            if known is not None:  # the common case: no HTTP, no thread hop
                self._on_lookup(msg.room, known)
            else:
                self._lookups.submit(self._lookup, msg.room, address)
        elif isinstance(msg, ipc.PublishManifest):
            self._publish(msg)
        elif isinstance(msg, ipc.ReleaseRoom):
            self.rooms.pop(msg.room, None)
        elif isinstance(msg, ipc.AbortRoom):
            room = self.rooms.get(msg.room)
            if room is not None and not room.status.is_final:
                # With the manifest out, P may be writing: the room is quiet once P answers.
                self._fail_room(msg.room, msg.reason or "aborted by the engine", msg.cause)
        else:
            raise FrameError(f"a decode worker cannot handle {type(msg).__name__}")

    def _lookup(self, room: Room, address: str) -> None:
        """On a helper thread: resolve the P ranks, then continue on the control thread."""
        try:
            found = self.directory.lookup(address, room)
        except PdError as exc:
            reason = str(exc)
            self._count_lookup("failed")
            self.post(lambda: self._fail_room(room, reason, FailureCause.LOOKUP))
            return
        self._count_lookup("ok")
        self.post(lambda: self._on_lookup(room, found))

    def _count_lookup(self, result: str) -> None:
        self.metrics.registry.inc(self.metrics.lookups, at=labels(result=result))

    def _on_lookup(self, room_id: Room, found: Lookup) -> None:
        room = self.rooms.get(room_id)
        if room is None or room.status is not TransferPoll.BOOTSTRAPPING:
            return
        room.lookup = found
        room.targets = frozenset(found.instance.route.targets(self.spec.tp_rank))
        try:
            self._register(room.address, found)
        except PdError as exc:
            self._fail_room(room_id, str(exc), FailureCause.LOOKUP)
            return
        self._offer_staging(room.address, found, room.targets)
        room.status = TransferPoll.BOOTSTRAPPED
        self.notify(ipc.RoomUpdate(room_id, room.status))

    # ---- heartbeat ----------------------------------------------------------------------

    def _probed(self, address: str, ok: bool) -> None:
        self.metrics.registry.inc(self.metrics.probes, at=labels(result="ok" if ok else "failed"))

    def _dead(self, address: str, why: str) -> None:
        """The heartbeat gave up on ``address``: forget it, fail its unfinished rooms."""
        self.metrics.registry.inc(self.metrics.node_failures)
        for ip, port in self.directory.forget(address):
            self.control.forget(ip, port)
        self.registered = {k for k in self.registered if k[0] != address}
        self.granted = {k for k in self.granted if k[0] != address}
        reason = f"P instance at {address} presumed dead: {why}"
        for room in list(self.rooms.values()):
            if room.address == address and room.status is not TransferPoll.SUCCESS:
                # Presumed dead, it writes nothing more: the rooms are quiet at once.
                self._fail_room(room.room, reason, FailureCause.HEARTBEAT, gave_up=True)

    # ---- timeouts -----------------------------------------------------------------------

    def on_tick(self, now: float) -> None:
        if self.heartbeat.due(now):
            # Instances D reached (a room still looking up fails on its own look-up).
            known = {r.address for r in self.rooms.values() if r.lookup is not None}
            self.heartbeat.tick(now, self.directory.addresses() | known)
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        limit = self.tunables.waiting_timeout_s
        for room in list(self.rooms.values()):
            if not room.published or now - room.published <= limit:
                continue
            if room.status is TransferPoll.WAITING_FOR_INPUT:
                missing = sorted(room.targets - room.arrived)
                why = f"no Success from P ranks {missing} in {limit:g} s"
                self._fail_room(room.room, why, FailureCause.TIMEOUT, gave_up=True)
            elif room.status is TransferPoll.FAILED and not room.quiet:
                log.warning("room %d: P never answered its abort in %g s", room.room, limit)
                self._fail_room(room.room, room.reason, room.cause, gave_up=True)
