"""Inside a transfer worker process: what the prefill and decode workers share.

The loop itself (shared with EPD's encode worker too) is
:class:`tspd_core.pd.proc.loop.ControlLoop`.

Threading model (one worker process per rank)::

    control thread (owns ALL room/session state)          helper threads
    ─────────────────────────────────────────────         ──────────────────────────────
    zmq.Poller over                                        transfer threads (P): Mooncake
      · the PULL socket      -> on_peer(frames)              writes, then post(done)
      · the command pipe     -> on_command(msg)            bootstrap threads (D): HTTP
      · the wake-up pipe     -> run posted callbacks         look-ups, then post(result)
    every tick               -> on_tick(now)

Helper threads never touch state: they hand a callback to :meth:`RoleWorker.post`, which the
control thread runs in order. So room state needs no locks, and a status change the worker
publishes to the engine (:meth:`RoleWorker.notify`) is always consistent with what it sent on
the wire. Nothing a peer sends can raise out of the loop: every handler's error is logged with
the offending input and the loop goes on serving other rooms.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from tspd_core.pd.config import PdTunables
from tspd_core.pd.layerwise.schedule import LayerwiseSpec
from tspd_core.pd.metrics.worker import WorkerMetrics
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.proc.handle import WorkerKind
from tspd_core.pd.proc.loop import ControlLoop
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.transfer.mooncake import MooncakeEngine
from tspd_core.pd.wire import ipc

log = logging.getLogger(__name__)

#: The transfer worker's codec and start/stop messages (engine side: ``pd.worker``).
TRANSFER_WORKER: WorkerKind[ipc.Message, ipc.WorkerReady] = WorkerKind(
    "transfer worker", ipc.encode, ipc.decode, ipc.WorkerReady, ipc.Shutdown()
)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs besides the arena; built by the engine-side peer from its config."""

    role: str  #: "prefill" or "decode"
    contract: str  #: this rank's canonical contract JSON
    host: str
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    protocol: str
    ib_device: str
    max_batch: int
    tunables: PdTunables
    bootstrap_url: str | None  #: P only: where this rank registers
    log_level: int
    mooncake_env: tuple[tuple[str, str], ...] = ()  #: applied before Mooncake is imported
    layerwise: LayerwiseSpec | None = None  #: P only: stream layerwise (docs/pd.md)
    write_window: int | None = None  #: Mooncake descriptors in flight; None = by protocol


class RoleWorker(ControlLoop[ipc.Message]):
    """Base of the prefill and decode workers: engine, sockets, metrics, notify and the calls
    every worker answers (counters, metrics, sleep and wake).

    Subclasses implement :meth:`on_peer`, :meth:`on_command` and :meth:`on_tick`; all three
    run on the control thread only.
    """

    def __init__(self, spec: WorkerSpec, arena: torch.Tensor, notes: Connection) -> None:
        super().__init__(TRANSFER_WORKER, notes)
        self.spec = spec
        self.arena = arena
        self.base_ptr = int(arena.data_ptr())
        self.arena_bytes = arena.numel() * arena.element_size()
        self.metrics = WorkerMetrics(spec.role)
        self.engine = self.new_engine()
        self.engine.register(self.base_ptr, self.arena_bytes)
        self.control = ControlPlane(spec.host)

    @property
    def tunables(self) -> PdTunables:
        return self.spec.tunables

    def new_engine(self) -> MooncakeEngine:
        """A Mooncake engine on this rank's host (a fresh session id each time)."""
        s = self.spec
        return MooncakeEngine(s.host, s.protocol, s.ib_device, s.max_batch, s.write_window)

    def notify(self, update: ipc.RoomUpdate) -> None:
        """Publish a room's new state to the engine-side peer (control thread)."""
        if update.status is TransferPoll.FAILED:
            log.warning("room %d failed: %s", update.room, update.reason)
        self.send_engine(update)

    # ---- role hooks ---------------------------------------------------------------------

    def on_command(self, msg: ipc.Message) -> None:
        raise NotImplementedError

    def counters(self) -> dict[str, float]:
        """Cumulative counters for :meth:`TransferPeer.counters`."""
        return {}

    def release_arena(self) -> str:
        """Sleep: unregister the arena; returns why not ("" when done). Control thread."""
        raise NotImplementedError

    def restore_arena(self) -> str:
        """Wake: register the arena again; returns why not ("" when done). Control thread."""
        raise NotImplementedError

    # ---- the loop's hooks ---------------------------------------------------------------

    def count_rejected(self, source: str) -> None:
        self.metrics.message_rejected(source)

    def handle_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.StatsRequest):
            self.send_engine(ipc.WorkerCounters(self.counters(), msg.seq))
        elif isinstance(msg, ipc.MetricsRequest):
            self.send_engine(ipc.WorkerMetrics(self.metrics.snapshot().families, msg.seq))
        elif isinstance(msg, ipc.ReleaseArena | ipc.RestoreArena):
            release = isinstance(msg, ipc.ReleaseArena)
            try:
                why = self.release_arena() if release else self.restore_arena()
            except Exception as exc:  # the caller waits for an answer: give it the reason
                log.exception("%s of the arena failed", "release" if release else "restore")
                why = f"{type(exc).__name__}: {exc}"
            self.send_engine(ipc.Reply(msg.seq, not why, why, self.engine.session_id))
        else:
            self.on_command(msg)
