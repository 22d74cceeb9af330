"""What a D rank sends its P ranks: registrations, staging grants, the manifest — and how it
answers their scatter requests (the staged path's last step into D's pages).

    look-up done ─► register (once per address, DP group, contact set; sealed with the
                    cluster credential to P ranks that announced tspd.auth/1) ─► grant staging
                    slots (once per P rank endpoint that sends data) ─► Bootstrapped
    PublishManifest ─► a pre-allocation to every contacted P rank (the manifest to the
                       targets, an empty one to dummies) ─► WaitingForInput; handed over
                       before the look-up finished, it is held and goes out once Bootstrapped
    scatter request ─► D's staging area scatters the slot into the arena (scatter thread)
                       ─► acknowledgement to the P rank (a piece it could not scatter fails
                       the room here: P may have sent Success already)

Control thread only, except the acknowledgements (scatter thread, through the thread-safe
control plane).
"""

from __future__ import annotations

import logging
import time

from tspd_bootstrap.auth import AUTH_EXTENSION
from tspd_core import trace
from tspd_core.ids import Rank
from tspd_core.pd.decode.directory import Lookup
from tspd_core.pd.decode.rooms import DecodeRooms
from tspd_core.pd.decode.state import DRoom
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.status import FailureCause, TransferPoll, alone
from tspd_core.pd.transfer.scatter import StagingArea
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import (
    PreAllocation,
    Registration,
    ScatterAck,
    ScatterRequest,
    encode_pre_allocation,
    encode_registration,
    encode_scattered,
    encode_stage_offer,
    seal_frames,
)
from tspd_core.pd.worker.transfer_worker import TransferWorker

log = logging.getLogger(__name__)


class PrefillExchange:
    """D's messages to P ranks and its scatter acknowledgements (see the module docstring).

    It remembers which registrations and staging grants went out, so each goes once; both
    are forgotten per P instance (:meth:`forget`) or all at once after a wake (:meth:`reset`),
    a registration also when a room of its P ranks failed (:meth:`forget_group`).
    """

    def __init__(
        self,
        worker: TransferWorker,
        rooms: DecodeRooms,
        contract_bytes: bytes,
        staging: StagingArea | None,
    ) -> None:
        self.worker = worker
        self.rooms = rooms
        self.contract_bytes = contract_bytes
        self.staging = staging
        self.registered: set[tuple[str, int, tuple[int, ...]]] = set()
        # (address, DP group, P rank, its endpoint): a rank found at a new address is granted anew
        self.granted: set[tuple[str, int, int, tuple[str, int]]] = set()

    def register(self, address: str, found: Lookup) -> None:
        """Register with each contacted P rank once per (address, DP group, contact set)."""
        key = (address, found.dp_group, tuple(sorted(found.endpoints)))
        if key in self.registered:
            return
        spec = self.worker.spec
        reg = Registration(
            endpoint=spec.host,
            port=self.worker.control.port,
            session_id=self.worker.engine.session_id,
            base_ptr=self.worker.base_ptr,
            contract=self.contract_bytes,
            tp_size=spec.tp_size,
            tp_rank=spec.tp_rank,
        )
        frames = encode_registration(reg)
        sends = [(p, endpoint, self._sealed(address, found, p, frames))
                 for p, endpoint in sorted(found.endpoints.items())]  # fmt: skip
        for p_rank, (ip, port), message in sends:
            try:
                self.worker.control.send(ip, port, message)
            except PdError as exc:
                raise PdError(f"cannot register with P rank {p_rank}: {exc}") from exc
        self.registered.add(key)

    def _sealed(
        self, address: str, found: Lookup, p_rank: Rank, frames: list[bytes]
    ) -> list[bytes]:
        """``frames`` as P rank ``p_rank`` takes them: sealed iff it announced tspd.auth/1.

        With the credential, every P rank must have announced it (else this node and that
        P instance disagree on whether the cluster is sealed); without, none may have.
        """
        credential = self.worker.spec.credential
        where = f"P rank {p_rank} of {address}"
        if p_rank in found.sealed:
            if credential is None:
                raise PdError(
                    f"{where} requires the cluster credential (it announced {AUTH_EXTENSION}); "
                    "start this node with --cluster-token-file (or $TSPD_CLUSTER_TOKEN_FILE)"
                )
            return seal_frames(frames, credential)
        if credential is not None:
            raise PdError(
                f"{where} does not take the cluster credential (it did not announce "
                f"{AUTH_EXTENSION}): with the credential on, every prefill node needs it too"
            )
        return frames

    def offer_staging(self, address: str, found: Lookup, targets: frozenset[int]) -> None:
        """Grant staging slots to each P rank that sends us data and announced it takes them
        (``tspd.stage/2`` in its look-up: a TokenSpeed P never did), once per P rank and
        endpoint (sealed where the rank asked for it, as the registration is)."""
        if self.staging is None:
            return
        for p_rank in sorted(targets):
            endpoint = found.endpoints[Rank(p_rank)]
            key = (address, found.dp_group, p_rank, endpoint)
            if key in self.granted or Rank(p_rank) not in found.staging:
                continue
            self.granted.add(key)
            offer = self.staging.grant(
                self.worker.engine.session_id,
                endpoint,
                self.worker.tunables.staging_slots_per_rank,
            )
            if offer is None:
                log.info("no staging slots left for P rank %d at %s", p_rank, address)
                continue
            frames = encode_stage_offer(offer)
            credential = self.worker.spec.credential
            if Rank(p_rank) in found.sealed and credential is not None:
                frames = seal_frames(frames, credential)
            try:
                self.worker.control.send(*endpoint, frames)
            except PdError as exc:
                log.warning("could not offer staging to P rank %d: %s", p_rank, exc)

    def publish(self, msg: ipc.PublishManifest) -> None:
        """The engine zeroed the room's pages: the manifest goes to the P ranks — now if the
        room is Bootstrapped, else once its look-up finished (:meth:`publish_held`)."""
        room = self.rooms.get(msg.room)
        if room is None or room.status is TransferPoll.FAILED:
            return
        if room.status is TransferPoll.BOOTSTRAPPING and room.manifest is None:
            room.manifest = msg.manifest  # early: the look-up is still running
            return
        if room.status is not TransferPoll.BOOTSTRAPPED or room.manifest is not None:
            why = "a second manifest handed over"
            self.rooms.fail(msg.room, why, FailureCause.BAD_FRAME)
            return
        self._send_manifest(room, msg.manifest)

    def publish_held(self, room: DRoom) -> None:
        """The room just turned Bootstrapped: send the manifest the engine handed over early."""
        if room.manifest is not None and room.status is TransferPoll.BOOTSTRAPPED:
            self._send_manifest(room, room.manifest)

    def _send_manifest(self, room: DRoom, manifest: str) -> None:
        """The pre-allocations: the manifest to the target P ranks, an empty one to the others."""
        assert room.lookup is not None, "a Bootstrapped room has its look-up"
        session = self.worker.engine.session_id
        trace.mark_room(room.room, "dw.prealloc_send")
        for p_rank, (ip, port) in sorted(room.lookup.endpoints.items()):
            body = manifest.encode() if p_rank in room.targets else b""
            frames = encode_pre_allocation(PreAllocation(room.room, session, body))
            try:
                self.worker.control.send(ip, port, frames)
            except PdError as exc:
                # Ranks before this one may have it: from here on, count the room as published.
                room.published = time.monotonic()
                self.rooms.fail(room.room, f"cannot reach P rank {p_rank}: {exc}", "lookup")
                return
        room.published = time.monotonic()
        self.rooms.update(room, TransferPoll.WAITING_FOR_INPUT)

    def forget(self, address: str) -> None:
        """The P instance at ``address`` is gone: register and grant afresh next time."""
        self.registered = {k for k in self.registered if k[0] != address}
        self.granted = {k for k in self.granted if k[0] != address}

    def forget_group(self, address: str, group: int) -> None:
        """A room of DP ``group`` at ``address`` failed: its P ranks are looked up again, and
        registered with again (a P rank that kept our session takes an identical one as a
        no-op; one that restarted needs it). Staging grants stay: they are per endpoint."""
        self.registered = {k for k in self.registered if k[:2] != (address, group)}

    def reset(self) -> None:
        """A wake under a fresh Mooncake session: every registration and grant is stale."""
        self.registered.clear()
        self.granted.clear()

    # ---- the staged path's scatters -----------------------------------------------------

    def on_scatter(self, req: ScatterRequest) -> None:
        """A P rank wrote a staged piece into its slot: scatter it (or refuse, in order)."""
        room = self.rooms.get(req.room)
        if self.staging is None:
            raise FrameError("scatter request, but staging is off on this rank")
        if room is None or room.status is not TransferPoll.WAITING_FOR_INPUT:
            log.warning("refused scatter for room %d: not waiting for input", req.room)
            self.staging.submit(req, self._send_ack, refuse=True)
            return
        # Inline only for a room alone on this rank: under load the control thread, busy
        # scattering, would fall behind on the other rooms' frames.
        self.staging.submit(req, self._send_ack, inline=alone(self.rooms.rooms, room))

    def _send_ack(self, req: ScatterRequest, endpoint: tuple[str, int] | None, ok: bool) -> None:
        """On the scatter thread: tell the P rank its slot is free again (and fail the room
        here if its piece could not be scattered: P may have sent Success already)."""
        if not ok:
            self.worker.post(lambda: self._scatter_failed(req))
        if endpoint is None:
            return
        ack = ScatterAck(self.worker.engine.session_id, req.grant, req.slot, req.seq, ok)
        try:
            self.worker.control.send(*endpoint, encode_scattered(ack))
        except PdError as exc:
            log.warning("could not acknowledge a scatter to %s:%d: %s", *endpoint, exc)

    def _scatter_failed(self, req: ScatterRequest) -> None:
        room = self.rooms.get(req.room)
        if room is not None and room.status is TransferPoll.WAITING_FOR_INPUT:
            why = "a staged piece could not be scattered into the arena (see the log)"
            self.rooms.fail(req.room, why, FailureCause.WRITE)
