"""Inside a transfer worker process: the one loop both roles run, and the process's entry.

:class:`TransferWorker` is the rank's control thread (a
:class:`~tspd_core.pd.proc.loop.ControlLoop`, the loop EPD's encode worker runs too) with what
every transfer worker owns — the Mooncake engine and the arena's registration, the ZMQ control
plane, the metrics — and the calls every worker answers (counters, metrics, sleep and wake).
What differs by role is one object it holds, built by the role's entry point::

    prefill.worker.main / decode.worker.main        (what the engine-side peer spawns)
      └─ serve_transfer_worker(..., PrefillWorker)   logging, Mooncake's environment
           └─ TransferWorker(spec, arena, notes, PrefillWorker)
                engine, control plane, metrics ──── then ──► role = PrefillWorker(worker)
                on_peer / on_tick / engine commands ───────► role.on_peer / on_tick / on_command
                StatsRequest, MetricsRequest, ReleaseArena,  answered here (sleep and wake ask
                RestoreArena                                 the role: role.release_arena ...)

Threading model (one worker process per rank)::

    control thread (owns ALL room/session state)          helper threads
    ─────────────────────────────────────────────         ──────────────────────────────
    zmq.Poller over                                        transfer threads (P): Mooncake
      · the PULL socket      -> role.on_peer(frames)         writes, then post(done)
      · the command pipe     -> role.on_command(msg)       bootstrap threads (D): HTTP
      · the wake-up pipe     -> run posted callbacks         look-ups, then post(result)
    every tick               -> role.on_tick(now)

Helper threads never touch state: they hand a callback to :meth:`TransferWorker.post`, which
the control thread runs in order. So room state needs no locks, and a status change the worker
publishes to the engine (:meth:`TransferWorker.notify`) is always consistent with what it sent
on the wire. Nothing a peer sends can raise out of the loop: every handler's error is logged
with the offending input and the loop goes on serving other rooms.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tspd_core import trace
from tspd_core.pd.config import PdTunables, WorkerRole
from tspd_core.pd.metrics.worker import WorkerMetrics
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.proc.logs import install_worker_logging
from tspd_core.pd.proc.loop import TICK_S, ControlLoop, serve
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs
from tspd_core.pd.wire import ipc
from tspd_core.pd.worker.spec import TRANSFER_WORKER, WorkerSpec
from tspd_core.procname import set_process_name

log = logging.getLogger(__name__)
#: The control loop's tick while no room is tracked (TICK_S otherwise).
IDLE_TICK_S = 0.5


class Role(Protocol):
    """A role's half of the transfer worker (P's or D's). Every method runs on the control
    thread; :meth:`close` runs once, before the worker closes its sockets and engine."""

    def on_peer(self, frames: list[bytes]) -> None:
        """A message from a peer rank arrived on the PULL socket."""

    def on_command(self, msg: ipc.Message) -> None:
        """An engine command the worker does not answer itself."""

    def on_tick(self, now: float) -> None:
        """Periodic work (timeouts, heartbeats)."""

    def idle(self) -> bool:
        """Nothing tracked: no room timeout can be due, the worker may tick slowly."""
        ...

    def counters(self) -> dict[str, float]:
        """Cumulative counters for :meth:`TransferPeer.counters`."""
        ...

    def release_arena(self) -> str:
        """Sleep: unregister the arena; returns why not ("" when done)."""
        ...

    def restore_arena(self) -> str:
        """Wake: register the arena again; returns why not ("" when done)."""
        ...

    def close(self) -> None:
        """Stop the role's helper threads."""


#: Builds a role's half for a worker whose engine, sockets and metrics are ready.
RoleFactory = Callable[["TransferWorker"], Role]


class TransferWorker(ControlLoop[ipc.Message]):
    """One rank's transfer worker (see the module docstring); ``role`` does the PD protocol."""

    def __init__(
        self, spec: WorkerSpec, arena: torch.Tensor, notes: mpc.Connection, role: RoleFactory
    ) -> None:
        super().__init__(TRANSFER_WORKER, notes)
        self.spec = spec
        self.arena = arena
        self.base_ptr = int(arena.data_ptr())
        self.arena_bytes = arena.numel() * arena.element_size()
        self.metrics = WorkerMetrics(spec.role)
        self.engine = self.new_engine()
        self.engine.register(self.base_ptr, self.arena_bytes)
        self.control = ControlPlane(spec.host)
        self._tag = "pw" if spec.role is WorkerRole.PREFILL else "dw"  # trace stamps' prefix
        self.role = role(self)

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
        trace.mark_room(update.room, self._tag + ".notify", update.status.name)

    def close(self) -> None:
        self.role.close()
        super().close()

    # ---- the loop's hooks ---------------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        self.role.on_peer(frames)

    def on_tick(self, now: float) -> None:
        self.role.on_tick(now)

    def tick_s(self) -> float:
        # Idle, a tick only expires tombstones and (D) probes P instances every few seconds.
        return IDLE_TICK_S if self.role.idle() else TICK_S

    def count_rejected(self, source: str) -> None:
        self.metrics.message_rejected(source)

    def handle_command(self, msg: ipc.Message) -> None:
        if isinstance(msg, ipc.StatsRequest):
            self.send_engine(ipc.WorkerCounters(self.role.counters(), msg.seq))
        elif isinstance(msg, ipc.MetricsRequest):
            self.send_engine(ipc.WorkerMetrics(self.metrics.snapshot().families, msg.seq))
        elif isinstance(msg, ipc.ReleaseArena | ipc.RestoreArena):
            release = isinstance(msg, ipc.ReleaseArena)
            try:
                why = self.role.release_arena() if release else self.role.restore_arena()
            except Exception as exc:  # the caller waits for an answer: give it the reason
                log.exception("%s of the arena failed", "release" if release else "restore")
                why = f"{type(exc).__name__}: {exc}"
            self.send_engine(ipc.Reply(msg.seq, not why, why, self.engine.session_id))
        else:
            room = getattr(msg, "room", None)
            if room is not None:
                trace.mark_room(room, self._tag + ".cmd", type(msg).__name__)
            self.role.on_command(msg)


def serve_transfer_worker(
    spec: WorkerSpec,
    arena: torch.Tensor,
    commands: mpc.Connection,
    notes: mpc.Connection,
    logs: Any,
    role: RoleFactory,
) -> None:
    """The body of a transfer worker process (each role's ``main`` calls it): route the logs
    to the engine, set Mooncake's environment before Mooncake loads, then build the worker
    with ``role`` and serve until the engine stops it."""
    install_worker_logging(logs, spec.log_level)
    trace.label(f"{spec.role.value}-worker{spec.tp_rank}")
    set_process_name(f"tspd-{spec.role.value[0]}-xfer{spec.tp_rank}")
    os.environ.update(dict(spec.mooncake_env))
    quiet_mooncake_logs(debug=spec.log_level <= logging.DEBUG)
    worker = f"tp{spec.tp_rank}"
    serve(
        TRANSFER_WORKER, lambda: TransferWorker(spec, arena, notes, role), commands, notes, worker
    )
