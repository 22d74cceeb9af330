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
                      └── look-up failed / P aborted / bad Success / waiting timeout ─► Failed

D never sends aborts (WIRE §2.4); a Failed room is simply reported and forgotten on release.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import torch

from tspd_core.ids import Rank, Room
from tspd_core.layout import encode_contract, parse_contract
from tspd_core.pd import ipc
from tspd_core.pd.decode_state import DRoom, Lookup, PrefillDirectory
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.runtime import RoleWorker, WorkerSpec
from tspd_core.pd.staging import StagingArea
from tspd_core.pd.status import TransferPoll, advance
from tspd_core.pd.wire import (
    PreAllocation,
    Registration,
    ScatterAck,
    ScatterRequest,
    StatusMessage,
    decode_decode_inbound,
    encode_pre_allocation,
    encode_registration,
    encode_scattered,
    encode_stage_offer,
)

log = logging.getLogger(__name__)

LOOKUP_THREADS = 4
SWEEP_S = 0.5


class DecodeWorker(RoleWorker):
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

    def close(self) -> None:
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
            self._on_abort(msg)
        else:
            raise FrameError(f"a decode worker cannot handle {type(msg).__name__}")

    def _lookup(self, room: Room, address: str) -> None:
        """On a helper thread: resolve the P ranks, then continue on the control thread."""
        try:
            found = self.directory.lookup(address, room)
        except PdError as exc:
            reason = str(exc)
            self.post(lambda: self._fail_room(room, reason))
            return
        self.post(lambda: self._on_lookup(room, found))

    def _on_abort(self, msg: ipc.AbortRoom) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.status.is_final:
            return
        reason = msg.reason or "aborted by the engine"
        if room.status is TransferPoll.WAITING_FOR_INPUT:
            # P may be writing into the pages right now: keep them until P answers.
            room.aborting = reason
        else:
            self._fail_room(msg.room, reason)

    def _on_lookup(self, room_id: Room, found: Lookup) -> None:
        room = self.rooms.get(room_id)
        if room is None or room.status is not TransferPoll.BOOTSTRAPPING:
            return
        route = found.instance.route
        room.lookup = found
        room.targets = frozenset(route.targets(self.spec.tp_rank))
        key = (room.address, found.dp_group, tuple(sorted(found.endpoints)))
        if key not in self.registered:
            reg = Registration(
                endpoint=self.spec.host,
                port=self.control.port,
                session_id=self.engine.session_id,
                base_ptr=self.base_ptr,
                contract=self.contract_bytes,
                tp_size=self.spec.tp_size,
                tp_rank=self.spec.tp_rank,
            )
            frames = encode_registration(reg)
            for p_rank, (ip, port) in sorted(found.endpoints.items()):
                try:
                    self.control.send(ip, port, frames)
                except PdError as exc:
                    self._fail_room(room_id, f"cannot register with P rank {p_rank}: {exc}")
                    return
            self.registered.add(key)
        self._offer_staging(room.address, found, room.targets)
        room.status = TransferPoll.BOOTSTRAPPED
        self.notify(ipc.RoomUpdate(room_id, room.status))

    def _offer_staging(self, address: str, found: Lookup, targets: frozenset[int]) -> None:
        """Grant staging slots to each P rank that sends us data (once per P rank)."""
        if self.staging is None:
            return
        for p_rank in sorted(targets):
            key = (address, found.dp_group, p_rank)
            if key in self.granted:
                continue
            self.granted.add(key)
            endpoint = found.endpoints[Rank(p_rank)]
            offer = self.staging.grant(
                self.engine.session_id, endpoint, self.tunables.staging_slots_per_rank
            )
            if offer is None:
                log.info(
                    "no staging slots left for P rank %d at %s: it writes directly", p_rank, address
                )
                continue
            try:
                self.control.send(*endpoint, encode_stage_offer(offer))
            except PdError as exc:
                log.warning("could not offer staging to P rank %d: %s", p_rank, exc)

    def _on_scatter(self, req: ScatterRequest) -> None:
        room = self.rooms.get(req.room)
        if self.staging is None:
            raise FrameError("scatter request, but staging is off on this rank")
        if room is None or room.status is not TransferPoll.WAITING_FOR_INPUT:
            log.warning("refused scatter for room %d: not waiting for input", req.room)
            self.staging.submit(req, self._send_ack, refuse=True)
            return
        self.staging.submit(req, self._send_ack)

    def _send_ack(self, req: ScatterRequest, endpoint: tuple[str, int] | None, ok: bool) -> None:
        """On the scatter thread: tell the P rank its slot is free again."""
        if endpoint is None:
            return
        ack = ScatterAck(self.engine.session_id, req.grant, req.slot, req.seq, ok)
        try:
            self.control.send(*endpoint, encode_scattered(ack))
        except PdError as exc:
            log.warning("could not acknowledge a scatter to %s:%d: %s", *endpoint, exc)

    def _publish(self, msg: ipc.PublishManifest) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.status is TransferPoll.FAILED:
            return
        if room.status is not TransferPoll.BOOTSTRAPPED or room.lookup is None:
            self._fail_room(msg.room, "manifest handed over before the room was bootstrapped")
            return
        session = self.engine.session_id
        for p_rank, (ip, port) in sorted(room.lookup.endpoints.items()):
            body = msg.manifest.encode() if p_rank in room.targets else b""
            frames = encode_pre_allocation(PreAllocation(msg.room, session, body))
            try:
                self.control.send(ip, port, frames)
            except PdError as exc:
                self._fail_room(msg.room, f"cannot reach P rank {p_rank}: {exc}")
                return
        room.status = TransferPoll.WAITING_FOR_INPUT
        room.published = time.monotonic()
        self.notify(ipc.RoomUpdate(msg.room, room.status))

    # ---- status frames from P ranks -----------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        inbound = decode_decode_inbound(frames)
        if isinstance(inbound, ScatterRequest):
            self._on_scatter(inbound)
            return
        msg = inbound
        room = self.rooms.get(msg.room)
        if room is None:
            log.warning("ignored status %s for unknown room %d", msg.status.name, msg.room)
            return
        if room.status.is_final:
            return
        if room.aborting:
            self._fail_room(msg.room, room.aborting)  # P answered: its writes are over
        elif msg.status is TransferPoll.FAILED:
            self._fail_room(msg.room, f"P rank {msg.sender_rank} aborted the transfer")
        elif msg.status is TransferPoll.SUCCESS:
            self._on_success(room, msg)
        else:
            log.warning("room %d: unexpected status %s from P", msg.room, msg.status.name)
            room.status = advance(room.status, msg.status)

    def _on_success(self, room: DRoom, msg: StatusMessage) -> None:
        if room.status is not TransferPoll.WAITING_FOR_INPUT:
            # No manifest went out yet, so no P rank can have written our pages.
            self._fail_room(room.room, f"Success from P rank {msg.sender_rank} before the manifest")
            return
        if msg.sender_rank not in room.targets:
            self._fail_room(
                room.room, f"Success from P rank {msg.sender_rank}, expected {sorted(room.targets)}"
            )
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
            self.notify(
                ipc.RoomUpdate(
                    room.room,
                    room.status,
                    room.token,
                    room.spec_ids,
                    room.cached_tokens,
                    room.logprob,
                )
            )

    def _fail_room(self, room_id: Room, reason: str) -> None:
        room = self.rooms.get(room_id)
        if room is None or room.status is TransferPoll.FAILED:
            return
        room.status, room.reason = TransferPoll.FAILED, reason
        self.notify(ipc.RoomUpdate(room_id, room.status, reason=reason))

    # ---- timeouts -----------------------------------------------------------------------

    def on_tick(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        limit = self.tunables.waiting_timeout_s
        for room in list(self.rooms.values()):
            waiting = room.status is TransferPoll.WAITING_FOR_INPUT
            if waiting and now - room.published > limit:
                missing = sorted(room.targets - room.arrived)
                why = room.aborting or f"no Success from P ranks {missing} in {limit:g} s"
                self._fail_room(room.room, why)
