"""The engine's end of a worker process: start it, talk to it over two pipes, stop it.

Shared by PD's transfer workers (:mod:`tspd_core.pd.peer.worker_handle`) and EPD's encode workers
(:mod:`tspd_core.epd.process`). A worker kind supplies its message codec, its ready message
type and its shutdown message (:class:`WorkerKind`) and an entry point; everything about the
process itself lives here once::

    engine process                                worker process
    ─────────────────────────────                 ─────────────────────────────────
    ProcessHandle.spawn ── Process(spec, tensor) ─► entry(spec, tensor, commands, notes, logs)
                        ◄──── ready message ─────── (or a fatal message with ``reason``, exit)
    send(msg)           ── command pipe ─────────►  the worker's control thread
    drain()             ◄─ notes pipe ───────────   notes ...
    close()             ── shutdown message ─────►  stop, unregister, exit (then terminate/kill)

The tensor (arena or send buffer) is shared with the worker through torch's multiprocessing
reductions: a shared-memory file descriptor on CPU, a CUDA IPC handle on GPU. Workers start with
``forkserver`` by default: the server imports torch and the workers' modules once
(:data:`PRELOAD`), so a worker starts in ~0.1 s of CPU and never inherits an engine's CUDA
context; an engine rank uses its launcher's server (:mod:`.forkserver`). The worker runs with
the environment its engine had when it started it (passed along, installed first).

Threading: :meth:`ProcessHandle.send` may be called from any thread; :meth:`drain`, :meth:`wait`
and :meth:`fileno` belong to one thread at a time (the caller serializes them).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

import torch
import torch.multiprocessing as tmp

from tspd_core.pd.errors import PeerError
from tspd_core.pd.proc.logs import log_queue

log = logging.getLogger(__name__)

M = TypeVar("M")
R = TypeVar("R")

#: What a worker's forkserver imports before it forks workers: torch, numpy, zmq and the PD
#: workers' own modules (their imports were ~0.4 s of CPU per worker started; a test session
#: starts ~150). Nothing here starts a thread or reads the environment at import (Mooncake,
#: which starts threads as it loads, is loaded by each worker).
PRELOAD = ["torch", "numpy", "zmq", "tspd_core.pd.prefill.worker", "tspd_core.pd.decode.worker"]
STOP_TIMEOUT_S = 10.0
#: ``entry(spec, tensor, commands, notes, log_queue)`` runs in the child process.
Entry = Callable[[Any, torch.Tensor, mpc.Connection, mpc.Connection, Any], None]


@dataclass(frozen=True, slots=True)
class WorkerKind(Generic[M, R]):
    """What differs between worker kinds: names, codec, and the start/stop messages."""

    label: str  #: how errors and logs name the worker ("transfer worker", "encode worker")
    encode: Callable[[M], bytes]
    decode: Callable[[bytes], M]
    ready: type[R]  #: the first note of a worker that serves
    shutdown: M  #: the command that asks the worker to stop


class ProcessHandle(Generic[M, R]):
    """One worker process and its two pipes (commands in, notes out)."""

    def __init__(
        self, kind: WorkerKind[M, R], proc: Any, commands: mpc.Connection, notes: mpc.Connection
    ) -> None:
        self.kind = kind
        self._proc = proc
        self._commands = commands
        self._notes = notes
        self._send_lock = threading.Lock()
        self._closed = False
        self.ready: R | None = None

    @classmethod
    def spawn(
        cls,
        kind: WorkerKind[M, R],
        entry: Entry,
        spec: Any,
        tensor: torch.Tensor,
        name: str,
        start_method: str,
        timeout_s: float,
    ) -> Self:
        """Start the worker and wait for its ready note; :class:`PeerError` if it cannot."""
        ctx: Any = tmp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(PRELOAD)
        if tensor.device.type == "cpu" and not tensor.is_shared():  # type: ignore[no-untyped-call]
            tensor.share_memory_()  # type: ignore[no-untyped-call]
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        note_r, note_w = ctx.Pipe(duplex=False)
        env = dict(os.environ)
        args = (entry, env, spec, tensor, cmd_r, note_w, log_queue(ctx))
        proc = ctx.Process(target=_enter, args=args, name=name, daemon=True)
        proc.start()
        cmd_r.close()
        note_w.close()
        _grow_pipe(cmd_w.fileno())
        handle = cls(kind, proc, cmd_w, note_r)
        handle._await_ready(timeout_s)
        return handle

    @property
    def alive(self) -> bool:
        return not self._closed and bool(self._proc.is_alive())

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    def send(self, msg: M) -> None:
        """Hand a command to the worker; never waits for the worker to act on it."""
        buf = self.kind.encode(msg)
        with self._send_lock:
            if self._closed:
                raise PeerError(f"the {self.kind.label} is shut down")
            try:
                self._commands.send_bytes(buf)
            except OSError as exc:
                raise PeerError(f"{self.kind.label} {self.pid} is gone: {exc}") from exc

    def drain(self) -> list[M]:
        """Every note published since the last drain (non-blocking).

        Raises :class:`PeerError` once the worker died and nothing is left to read.
        """
        out: list[M] = []
        try:
            while self._notes.poll():
                out.append(self.kind.decode(self._notes.recv_bytes()))
        except (EOFError, OSError) as exc:
            if not out:
                reason = exc or "pipe closed"
                raise PeerError(f"{self.kind.label} {self.pid} died: {reason}") from exc
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until the worker published something (or died), or ``timeout_s`` passed."""
        try:
            return bool(self._notes.poll(timeout_s))
        except (EOFError, OSError):
            return True  # the next drain reports the death

    def fileno(self) -> int:
        """The notes pipe's descriptor, for engines that multiplex waits (select/poll)."""
        return self._notes.fileno()

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the worker: the shutdown message, then terminate, then kill; idempotent."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._commands.send_bytes(self.kind.encode(self.kind.shutdown))
            except OSError:
                pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            log.warning("%s %d ignored the shutdown; terminating it", self.kind.label, self.pid)
            self._proc.terminate()
            self._proc.join(2.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2.0)
        self._commands.close()
        self._notes.close()

    def _await_ready(self, timeout_s: float) -> None:
        label = self.kind.label
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._notes.poll(0.1):
                msg = self.drain()[0]
                if isinstance(msg, self.kind.ready):
                    self.ready = msg
                    return
                self.close(2.0)
                raise PeerError(f"{label} failed to start: {getattr(msg, 'reason', repr(msg))}")
            if not self._proc.is_alive():
                self.close(1.0)
                raise PeerError(f"{label} exited at start (code {self._proc.exitcode})")
        self.close(2.0)
        raise PeerError(f"{label} did not start within {timeout_s:g} s")


def _enter(entry: Entry, env: dict[str, str], *args: Any) -> None:
    """The worker process's first steps: its starter's environment (a forkserver's child has
    the server's, which is its starter's only if nothing changed since the server started,
    and the server may be another process's: :mod:`.forkserver`), SIGINT ignored, then
    ``entry``.

    A worker stops when its engine tells it to or its engine's end of the pipe closes; a
    terminal's Ctrl-C reaches every process of its group, and a worker that took it would
    die mid-transfer with a KeyboardInterrupt of its own instead of waiting for its engine
    (whatever signal handlers the server that forked it had)."""
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    entry(*args)


def _grow_pipe(fd: int, nbytes: int = 1 << 20) -> None:
    """Let the command pipe hold ~1 MiB, so an engine handing over a large batch does not wait
    for the worker to read (Linux; elsewhere the default size stays)."""
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, nbytes)  # F_SETPIPE_SZ
    except (ImportError, OSError) as exc:
        log.debug("could not grow the command pipe: %s", exc)
