"""The encode rank's transfer worker: registrations, item infos, parking, writes, status pushes.

Runs in its own process (:mod:`tspd_core.epd.process`) with the send buffer shared with the
engine. One control thread owns every room (no locks): PD's
:class:`~tspd_core.pd.proc.loop.ControlLoop`, the same loop as the PD transfer workers'.
Mooncake writes (one or two descriptors per receiver) run on ``THREAD_POOL_SIZE`` writer threads
and report back through :meth:`EncodeWorker.post`, so the receivers of one room are written
concurrently. Life of a room (see :mod:`tspd_core.epd.encode_state`)::

    item infos (any order) ─┐
    SubmitChunk ────────────┴─► all receivers in + chunk ─► check_fanout ─► writes ─► Success
          │ not all in: parked                 │ mismatch                             to each
          ▼                                    ▼                                      receiver
    reaper after bootstrap_timeout ──────► Failed to every receiver that registered (after the
    AbortRoom / write failure ───────────►   room's writes drained), ChunkDone to the engine

Concluded rooms leave a tombstone for ``tombstone_s`` (``bootstrap_timeout_s`` by default): an
info that arrives late gets a Failed push instead of waiting for a chunk that was already sent or
refused.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from tspd_core.epd import ipc
from tspd_core.epd.encode_state import ChunkMeta, ERoom, Writes, check_fanout, plan_writes
from tspd_core.epd.process import ENCODE_WORKER
from tspd_core.epd.wire import (
    EmbeddingRegistration,
    EmbeddingStatus,
    ItemInfo,
    decode_encode_inbound,
    encode_status,
)
from tspd_core.ids import Room
from tspd_core.pd.config import PdTunables
from tspd_core.pd.errors import FrameError, PdError, TransferError
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.proc.logs import install_worker_logging
from tspd_core.pd.proc.loop import ControlLoop, serve
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs
from tspd_core.procname import name_this_thread, set_process_name

log = logging.getLogger(__name__)

SWEEP_S = 0.5


@dataclass(frozen=True, slots=True)
class EncodeWorkerSpec:
    """What the worker needs besides the send buffer; built by :class:`EmbeddingSender`."""

    host: str
    tp_size: int
    tp_rank: int
    protocol: str
    ib_device: str
    max_batch: int
    tunables: PdTunables
    bootstrap_url: str
    log_level: int
    tombstone_s: float  #: how long a concluded room is remembered


def worker_main(
    spec: EncodeWorkerSpec, buffer: torch.Tensor, commands: Connection, notes: Connection, logs: Any
) -> None:
    """Entry point of the encode worker process."""
    install_worker_logging(logs, spec.log_level)
    set_process_name(f"tspd-e-enc{spec.tp_rank}")
    quiet_mooncake_logs(debug=spec.log_level <= logging.DEBUG)
    serve(
        ENCODE_WORKER,
        lambda: EncodeWorker(spec, buffer, notes),
        commands,
        notes,
        f"tp{spec.tp_rank}",
    )


class EncodeWorker(ControlLoop[ipc.Message]):
    """One encode rank's Mooncake engine, PULL socket, writer threads and rooms."""

    def __init__(self, spec: EncodeWorkerSpec, buffer: torch.Tensor, notes: Connection) -> None:
        super().__init__(ENCODE_WORKER, notes)
        self.spec = spec
        self.tunables = spec.tunables
        self.base_ptr = int(buffer.data_ptr())
        self.engine = MooncakeEngine(spec.host, spec.protocol, spec.ib_device, spec.max_batch)
        self.engine.register(self.base_ptr, buffer.numel() * buffer.element_size())
        self.control = ControlPlane(spec.host)
        self.writers = ThreadPoolExecutor(
            max(1, spec.tunables.thread_pool_size),
            thread_name_prefix="tspd-epd-write",
            initializer=name_this_thread,
        )
        self.rooms: dict[Room, ERoom] = {}
        self.sessions: dict[str, EmbeddingRegistration] = {}
        #: concluded rooms: when, verdict, the sessions it was pushed to
        self.tombstones: dict[Room, tuple[float, TransferPoll, frozenset[str]]] = {}
        self._next_sweep = 0.0
        self._register_with_bootstrap()

    def _register_with_bootstrap(self) -> None:
        from tspd_bootstrap import BootstrapClient, Role

        # wire.md §3: E ranks retry 60 x 0.5 s (the server may start alongside them). The role is
        # TokenSpeed's "Prefill" (a discoverable data source), which every server stores.
        with BootstrapClient(
            self.spec.bootstrap_url, timeout=5.0, retries=60, backoff=0.5, max_backoff=0.5
        ) as client:
            client.register_rank(
                engine_rank=self.spec.tp_rank,
                world_size=self.spec.tp_size,
                dp_size=1,
                rank_ip=self.spec.host,
                rank_port=self.control.port,
                role=Role.PREFILL,
            )

    def close(self) -> None:
        """Let queued writes finish, then release sockets and the registration."""
        self.writers.shutdown(wait=True)
        super().close()

    # ---- frames from prefill ranks ------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        msg = decode_encode_inbound(frames)
        if isinstance(msg, EmbeddingRegistration):
            self.sessions[msg.session_id] = msg
            log.debug(
                "registered prefill receiver %s (%s:%d)", msg.session_id, msg.endpoint, msg.port
            )
        else:
            self._on_info(msg)

    def _on_info(self, info: ItemInfo) -> None:
        tomb = self.tombstones.get(info.room)
        if tomb is not None:
            _, verdict, sessions = tomb
            if verdict is TransferPoll.FAILED or info.session_id not in sessions:
                self._push(info, TransferPoll.FAILED)
                raise FrameError(f"room {info.room}: item info after the room concluded")
            return  # a duplicate from a receiver that was already served
        room = self.rooms.setdefault(info.room, ERoom(info.room, time.monotonic()))
        if room.status is not TransferPoll.BOOTSTRAPPING and info.session_id not in room.infos:
            self._push(info, TransferPoll.FAILED)
            raise FrameError(f"room {info.room}: item info from a new receiver while sending")
        room.infos[info.session_id] = info  # one frame per (room, session): the latest wins
        self._maybe_send(room)

    # ---- commands from the engine -------------------------------------------------------

    def handle_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.SubmitChunk):
            self._on_chunk(msg)
        elif isinstance(msg, ipc.AbortRoom):
            room = self.rooms.get(msg.room)
            if room is None:
                self.tombstones[msg.room] = (time.monotonic(), TransferPoll.FAILED, frozenset())
            else:
                self._fail(room, msg.reason or "aborted by the encode engine")
        elif isinstance(msg, ipc.Sync):  # commands are handled in order: all before it are
            self.send_engine(ipc.Synced(msg.token))
        else:
            raise FrameError(f"an encode worker cannot handle {type(msg).__name__}")

    def _on_chunk(self, msg: ipc.SubmitChunk) -> None:
        meta = ChunkMeta(
            room=msg.room,
            offset=msg.offset,
            n_tokens=msg.n_tokens,
            hidden=msg.hidden,
            dtype=msg.dtype,
            nbytes=msg.nbytes,
            deepstack_offset=msg.deepstack_offset,
            deepstack_nbytes=msg.deepstack_nbytes,
        )
        tomb = self.tombstones.get(msg.room)
        room = self.rooms.get(msg.room)
        if tomb is not None or (room is not None and room.chunk is not None):
            why = "the room was aborted or failed" if tomb else "the room already has a chunk"
            self.send_engine(ipc.ChunkDone(msg.room, TransferPoll.FAILED, why))
            return
        if room is None:
            room = self.rooms[msg.room] = ERoom(msg.room, time.monotonic())
        room.chunk, room.chunk_at = meta, time.monotonic()
        self._maybe_send(room)
        room.parked = room.status is TransferPoll.BOOTSTRAPPING and room.room in self.rooms

    # ---- sending ------------------------------------------------------------------------

    def _maybe_send(self, room: ERoom) -> None:
        chunk = room.chunk
        if chunk is None or not room.complete or room.status is not TransferPoll.BOOTSTRAPPING:
            return
        infos = list(room.infos.values())
        why = check_fanout(infos, chunk)
        if why is not None:
            self._fail(room, why)
            return
        room.status = TransferPoll.TRANSFERRING
        for info in infos:
            w = plan_writes(info, chunk, self.base_ptr)
            if len(w.src):
                room.pending += 1
                self.writers.submit(self._write, room.room, w, room.cancel)
        self._maybe_done(room)

    def _write(self, room: Room, w: Writes, cancel: threading.Event) -> None:
        """On a writer thread: one receiver's rows; the result goes to the control thread."""
        error: TransferError | None = None
        try:
            if cancel.is_set():
                raise TransferError(f"room {room}: write cancelled (the room failed)")
            self.engine.write(w.session, w.src, w.dst, w.lengths)
        except TransferError as exc:
            error = exc
        self.post(lambda: self._on_write_done(room, w, error))

    def _on_write_done(self, key: Room, w: Writes, error: TransferError | None) -> None:
        room = self.rooms.get(key)
        if room is None:
            return
        room.pending -= 1
        if error is None:
            room.nbytes += w.nbytes
        else:
            self._fail(room, str(error))
        self._maybe_done(room)

    def _maybe_done(self, room: ERoom) -> None:
        if room.pending:
            return
        if room.status is TransferPoll.TRANSFERRING:
            room.status = TransferPoll.SUCCESS
        if room.status.is_final:
            self._finish(room)

    def _fail(self, room: ERoom, reason: str) -> None:
        if room.status.is_final:
            return
        log.warning("room %d: %s", room.room, reason)
        room.status, room.reason = TransferPoll.FAILED, reason
        room.cancel.set()
        self._maybe_done(room)

    def _finish(self, room: ERoom) -> None:
        """Once no write of the room runs: the verdict to every receiver, then to the engine."""
        for info in room.infos.values():
            self._push(info, room.status)
        if room.chunk is not None:
            self.send_engine(
                ipc.ChunkDone(
                    room.room, room.status, room.reason, room.parked, len(room.infos), room.nbytes
                )
            )
        self.tombstones[room.room] = (time.monotonic(), room.status, frozenset(room.infos))
        del self.rooms[room.room]

    def _push(self, info: ItemInfo, status: TransferPoll) -> None:
        frames = encode_status(EmbeddingStatus(info.room, status, self.spec.tp_rank))
        try:
            self.control.send(info.endpoint, info.port, frames)
        except PdError as exc:
            log.error(
                "room %d: cannot push status to %s:%d: %s", info.room, info.endpoint, info.port, exc
            )

    # ---- the reaper ---------------------------------------------------------------------

    def on_tick(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        limit = self.tunables.bootstrap_timeout_s
        for room in list(self.rooms.values()):
            if room.status is not TransferPoll.BOOTSTRAPPING:
                continue
            if room.chunk is not None and now - room.chunk_at > limit:
                need = room.required
                self._fail(
                    room,
                    f"{len(room.infos)} of {need if need is not None else '?'} receivers "
                    f"registered within {limit:g} s",
                )
            elif room.chunk is None and now - room.created > limit:
                self._fail(room, f"receivers registered but no embedding came within {limit:g} s")
        for key, (since, _, _) in list(self.tombstones.items()):
            if now - since > self.spec.tombstone_s:
                del self.tombstones[key]
