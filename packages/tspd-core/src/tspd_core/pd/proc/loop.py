"""The control thread of a worker process, shared by PD's transfer workers and EPD's.

One control thread owns all of a worker's state; helper threads (Mooncake writes, HTTP
look-ups, the layerwise pacer) never touch it but hand it callbacks through :class:`Posted`.
:class:`ControlLoop` is the loop itself and :func:`serve` the life of the process around it::

    serve(kind, build, ...)   build() ── raises ──► WorkerFatal(reason) to the engine, exit
                                 │
                              ready()  ──────────► WorkerReady(host, port, session, base_ptr)
                              run(commands): zmq.Poller over
                                · the PULL socket   -> on_peer(frames)      (256 at most a turn)
                                · the command pipe  -> handle_command(msg)  until the kind's
                                                       shutdown message (a batch frame: each
                                                       of its messages, in order)
                                · the wake-up pipe  -> the posted callbacks, in order
                                every tick_s()      -> on_tick(now)  (TICK_S; a kind
                                                       may tick slower while idle)
                              close()

Nothing a peer, the engine or a callback raises leaves the loop: :meth:`ControlLoop._guard`
logs it with the offending input (counting rejected frames) and the loop serves on.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar, cast

import zmq

from tspd_core.pd.errors import FrameError, PdError
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.proc.handle import WorkerKind, unpack_batch
from tspd_core.pd.transfer.mooncake import MooncakeEngine
from tspd_core.pd.wire.ipc import WorkerFatal, WorkerReady

log = logging.getLogger(__name__)

M = TypeVar("M")
#: How often the control thread wakes up with nothing to do (timeouts are checked then).
TICK_S = 0.05


class Posted:
    """Callbacks handed to one thread from any thread, with a pipe that wakes its poller.

    :meth:`post` may be called from any thread (also after :meth:`close`: the callback is then
    never run); :meth:`run` and :meth:`fileno` belong to the owning thread.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    def fileno(self) -> int:
        """The wake-up pipe's read end, for the owner's poller."""
        return self._wake_r

    def post(self, callback: Callable[[], None]) -> None:
        """Queue ``callback`` and wake the owner."""
        self._queue.put(callback)
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full of wake-ups already (the owner will run), or closed
            pass

    def run(self, guard: Callable[[Callable[[], None]], None]) -> None:
        """Run every queued callback, in order, each through ``guard`` (owner's thread)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                callback = self._queue.get_nowait()
            except queue.Empty:
                return
            guard(callback)

    def close(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)


class ControlLoop(Generic[M]):
    """Base of a worker's control thread, for a worker kind whose messages are ``M``.

    A subclass sets ``engine``, ``control`` and ``base_ptr`` in its constructor and implements
    :meth:`on_peer` and :meth:`handle_command` (and :meth:`on_tick` for timeouts); all of them
    run on the control thread only. ``M`` includes :class:`WorkerReady` (both codecs do).
    """

    engine: MooncakeEngine
    control: ControlPlane
    base_ptr: int  #: the registered tensor's address, as the engine side reports it

    def __init__(self, kind: WorkerKind[M, WorkerReady], notes: Connection) -> None:
        self.kind = kind
        self._notes = notes
        self._notes_lock = threading.Lock()
        self._posted = Posted()
        self._commands: Connection | None = None
        self._unread: collections.deque[bytes] = collections.deque()  # a batch's rest
        self.stopping = False

    def post(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the control thread soon (callable from any thread)."""
        self._posted.post(callback)

    def run_posted(self) -> None:
        """Run the callbacks posted so far, now (control thread only): e.g. a write that
        completed inline, so its Success goes before anything the handler does next."""
        self._posted.run(lambda callback: self._guard("posted callback", callback))

    def commands_pending(self) -> bool:
        """Whether a command from the engine waits unread (control thread): a decision made
        on shared state the engine moved after sending it (the layerwise step counter) can
        wait for the next turn of the loop, which reads the commands before the callbacks."""
        return bool(self._unread) or (self._commands is not None and self._commands.poll())

    def send_engine(self, msg: M) -> None:
        with self._notes_lock:
            self._notes.send_bytes(self.kind.encode(msg))

    def ready(self) -> None:
        """Tell the engine side where this worker serves."""
        note = WorkerReady(
            self.control.host, self.control.port, self.engine.session_id, self.base_ptr
        )
        self.send_engine(cast(M, note))

    def run(self, commands: Connection) -> None:
        """Serve until the kind's shutdown message or the engine's end of the pipe closes."""
        self._commands = commands
        poller = zmq.Poller()
        poller.register(self.control.pull, zmq.POLLIN)
        poller.register(commands.fileno(), zmq.POLLIN)
        poller.register(self._posted.fileno(), zmq.POLLIN)
        next_tick = time.monotonic()
        while not self.stopping:
            # Rounded up: truncated, the last millisecond before each tick polled with a
            # timeout of 0 over and over (~2 % of a core per worker at 20 ticks a second).
            wait_ms = math.ceil((next_tick - time.monotonic()) * 1000)
            ready = dict(poller.poll(max(0, wait_ms)))
            if self.control.pull in ready:
                self._drain_peer()
            if commands.fileno() in ready:
                self._read_commands(commands)
            if self._posted.fileno() in ready:
                self._posted.run(lambda callback: self._guard("posted callback", callback))
            now = time.monotonic()
            if now >= next_tick:
                self._guard("tick", self.on_tick, now)
                next_tick = now + self.tick_s()
            elif ready:  # news may have ended an idle spell: tick at the busy pace again
                next_tick = min(next_tick, now + self.tick_s())

    def close(self) -> None:
        """Release sockets and the Mooncake registration (after helper threads stopped)."""
        self.control.close()
        self.engine.close()
        self._posted.close()

    # ---- hooks --------------------------------------------------------------------------

    def on_peer(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def handle_command(self, msg: M) -> None:
        raise NotImplementedError

    def on_tick(self, now: float) -> None:
        """Periodic work (timeouts); nothing by default."""

    def tick_s(self) -> float:
        """Seconds to the next :meth:`on_tick` (:data:`TICK_S`; a kind may return more while
        it tracks nothing, so an idle worker does not wake 20 times a second)."""
        return TICK_S

    def count_rejected(self, source: str) -> None:
        """A frame from ``source`` ("peer" or "engine") was refused; counts it if you like."""

    # ---- internals ----------------------------------------------------------------------

    def _drain_peer(self) -> None:
        # Bounded so a flood on the PULL socket cannot starve the engine's commands.
        for _ in range(256):
            try:
                frames = self.control.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guard("peer message", self.on_peer, frames)

    def _read_commands(self, commands: Connection) -> None:
        while self._unread or commands.poll():
            if not self._unread:
                try:
                    frame = commands.recv_bytes()
                except (EOFError, OSError):
                    log.info("engine side closed the command pipe; stopping")
                    self.stopping = True
                    return
                try:
                    self._unread.extend(unpack_batch(frame))
                except FrameError as exc:
                    self.count_rejected("engine")
                    log.error("rejected engine commands: %s", exc)
                    continue
            buf = self._unread.popleft()
            try:
                msg = self.kind.decode(buf)
            except FrameError as exc:
                self.count_rejected("engine")
                log.error("rejected engine command: %s", exc)
                continue
            if isinstance(msg, type(self.kind.shutdown)):
                self.stopping = True
                return
            self._guard("engine command", self.handle_command, msg)

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except FrameError as exc:
            self.count_rejected("peer" if what == "peer message" else "engine")
            log.warning("rejected %s: %s", what, exc)
        except PdError as exc:
            log.warning("%s failed: %s", what, exc)
        except Exception:
            shown = [bytes(f[:48]) for f in args[0]] if what == "peer message" else args
            log.exception("unexpected error in %s (input %s); still serving", what, shown)


def serve(
    kind: WorkerKind[M, WorkerReady],
    build: Callable[[], ControlLoop[M]],
    commands: Connection,
    notes: Connection,
    name: str,
) -> None:
    """The life of a worker process once its logging is set up: build the worker (a failure
    goes to the engine as :class:`WorkerFatal`), announce it, serve, close it."""
    try:
        worker = build()
    except Exception as exc:
        log.exception("%s failed to start", kind.label)
        fatal = WorkerFatal(f"{type(exc).__name__}: {exc}")
        notes.send_bytes(kind.encode(cast(M, fatal)))  # every kind's messages include it
        return
    try:
        worker.ready()
        worker.run(commands)
    finally:
        worker.close()
        log.debug("%s %s stopped", kind.label, name)
