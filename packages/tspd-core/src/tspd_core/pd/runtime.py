"""Inside a transfer worker process: the control thread's loop and what both roles share.

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
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from tspd_core.pd import ipc
from tspd_core.pd.config import PdTunables
from tspd_core.pd.control import ControlPlane
from tspd_core.pd.engine import MooncakeEngine
from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.layerwise import LayerwiseSpec
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

#: How often the control thread wakes up with nothing to do (timeouts are checked then).
TICK_S = 0.05


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


class RoleWorker:
    """Base of the prefill and decode workers: engine, sockets, the loop, post and notify.

    Subclasses implement :meth:`on_peer`, :meth:`on_command` and :meth:`on_tick`; all three
    run on the control thread only.
    """

    def __init__(self, spec: WorkerSpec, arena: torch.Tensor, notes: Connection) -> None:
        self.spec = spec
        self.arena = arena
        self.base_ptr = int(arena.data_ptr())
        self.arena_bytes = arena.numel() * arena.element_size()
        self.metrics = WorkerMetrics(spec.role)
        self.engine = self.new_engine()
        self.engine.register(self.base_ptr, self.arena_bytes)
        self.control = ControlPlane(spec.host)
        self._notes = notes
        self._notes_lock = threading.Lock()
        self._posted: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.stopping = False

    @property
    def tunables(self) -> PdTunables:
        return self.spec.tunables

    def new_engine(self) -> MooncakeEngine:
        """A Mooncake engine on this rank's host (a fresh session id each time)."""
        s = self.spec
        return MooncakeEngine(s.host, s.protocol, s.ib_device, s.max_batch, s.write_window)

    # ---- for helper threads -------------------------------------------------------------

    def post(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the control thread soon (callable from any thread)."""
        self._posted.put(callback)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already: the loop will run
            pass

    # ---- for the control thread ---------------------------------------------------------

    def notify(self, update: ipc.RoomUpdate) -> None:
        """Publish a room's new state to the engine-side peer."""
        if update.status is TransferPoll.FAILED:
            log.warning("room %d failed: %s", update.room, update.reason)
        self.send_engine(update)

    def send_engine(self, msg: ipc.Message) -> None:
        with self._notes_lock:
            self._notes.send_bytes(ipc.encode(msg))

    def ready(self) -> None:
        """Tell the engine-side peer where this worker serves."""
        self.send_engine(
            ipc.WorkerReady(
                self.spec.host, self.control.port, self.engine.session_id, self.base_ptr
            )
        )

    def run(self, commands: Connection) -> None:
        """Serve until a Shutdown command or the engine's end of the pipe closes."""
        poller = zmq.Poller()
        poller.register(self.control.pull, zmq.POLLIN)
        poller.register(commands.fileno(), zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self.stopping:
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            ready = dict(poller.poll(timeout_ms))
            if self.control.pull in ready:
                self._drain_peer()
            if commands.fileno() in ready:
                self._read_command(commands)
            if self._wake_r in ready:
                self._run_posted()
            now = time.monotonic()
            if now >= next_tick:
                self._guard("tick", self.on_tick, now)
                next_tick = now + TICK_S

    def close(self) -> None:
        """Release sockets and the Mooncake registration (after helper threads stopped)."""
        self.control.close()
        self.engine.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- role hooks ---------------------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def on_command(self, msg: ipc.Message) -> None:
        raise NotImplementedError

    def on_tick(self, now: float) -> None:
        """Periodic work (timeouts); nothing by default."""

    def counters(self) -> dict[str, float]:
        """Cumulative counters for :meth:`TransferPeer.counters`."""
        return {}

    def release_arena(self) -> str:
        """Sleep: unregister the arena; returns why not ("" when done). Control thread."""
        raise NotImplementedError

    def restore_arena(self) -> str:
        """Wake: register the arena again; returns why not ("" when done). Control thread."""
        raise NotImplementedError

    # ---- internals ----------------------------------------------------------------------

    def _drain_peer(self) -> None:
        # Bounded so a flood on the PULL socket cannot starve the engine's commands.
        for _ in range(256):
            try:
                frames = self.control.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guard("peer message", self.on_peer, frames)

    def _read_command(self, commands: Connection) -> None:
        while commands.poll():
            try:
                buf = commands.recv_bytes()
            except (EOFError, OSError):
                log.info("engine side closed the command pipe; stopping")
                self.stopping = True
                return
            try:
                msg = ipc.decode(buf)
            except FrameError as exc:
                self.metrics.message_rejected("engine")
                log.error("rejected engine command: %s", exc)
                continue
            if isinstance(msg, ipc.Shutdown):
                self.stopping = True
                return
            self._guard("engine command", self._on_engine, msg)

    def _on_engine(self, msg: ipc.Message) -> None:
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

    def _run_posted(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                callback = self._posted.get_nowait()
            except queue.Empty:
                return
            self._guard("posted callback", callback)

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except FrameError as exc:
            self.metrics.message_rejected("peer" if what == "peer message" else "engine")
            log.warning("rejected %s: %s", what, exc)
        except PdError as exc:
            log.warning("%s failed: %s", what, exc)
        except Exception:
            shown = [bytes(f[:48]) for f in args[0]] if what == "peer message" else args
            log.exception("unexpected error in %s (input %s); still serving", what, shown)
