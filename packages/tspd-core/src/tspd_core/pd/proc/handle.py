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
    defer(msg), batch() ── (one write, later) ───►  (a batch frame: its messages in order)
    drain()             ◄─ notes pipe ───────────   notes ...
    close()             ── shutdown message ─────►  stop, unregister, exit (then terminate/kill)

The tensor (arena or send buffer) is shared with the worker through torch's multiprocessing
reductions: a shared-memory file descriptor on CPU, a CUDA IPC handle on GPU. Workers start with
``forkserver`` by default: the server imports torch and the workers' modules once
(:data:`PRELOAD`), so a worker starts in ~0.1 s of CPU and never inherits an engine's CUDA
context; an engine rank uses its launcher's server (:mod:`.forkserver`). The worker runs with
the environment its engine had when it started it (passed along, installed first).

Each write to the command pipe wakes the worker, and on a busy host the woken worker may
preempt the engine thread right there. Commands that need not go at once can be held to ride
with the next write: :meth:`defer` holds one (cleanup such as a finished room's release),
:meth:`batch` holds a thread's sends until the block ends (a registration and its manifest). A
write of several messages is one batch frame (:func:`pack_batch`, wire.md §9.3), which the
worker unpacks and handles in order. A command the worker should start on while the engine
goes on (P's registration, a hand-over) is better sent alone: the wake-up is then work done
in parallel, not only a cost (docs/measurements/transfer.md, eighth session).

Threading: :meth:`ProcessHandle.send`, :meth:`defer` and :meth:`flush` may be called from any
thread (held messages keep their order, and go before any later write); :meth:`batch` holds
only its own thread's sends; :meth:`drain`, :meth:`wait` and :meth:`fileno` belong to one
thread at a time (the caller serializes them).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

import torch
import torch.multiprocessing as tmp

from tspd_core.pd.errors import FrameError, PeerError
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
#: The first byte of a batch frame; every kind's message tags stay below it.
BATCH_MARK = 0xFF
#: The most messages one batch frame may carry (the engine's writes are far smaller).
MAX_BATCH = 4096
_U32 = struct.Struct("<I")
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
        self._deferred: list[bytes] = []  # encoded, for the next write (under _send_lock)
        self._holding = threading.local()  # per thread: depth of open batch() blocks
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
        """Hand a command to the worker (with any held before it, in one write); never waits
        for the worker to act on it. Inside this thread's :meth:`batch`: held until its end."""
        buf = self.kind.encode(msg)
        if getattr(self._holding, "depth", 0):
            self._hold(buf)
        else:
            self._write(buf)

    def defer(self, msg: M) -> None:
        """Hold a command for the next write (any thread's :meth:`send` or :meth:`flush`)."""
        self._hold(self.kind.encode(msg))

    def flush(self) -> None:
        """Write the held commands now, if any."""
        self._write(None)

    def holding(self) -> bool:
        """Whether commands are held for the next write."""
        with self._send_lock:
            return bool(self._deferred)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold this thread's sends until the block ends, then write them in one frame (with
        any deferred before them). The write at the end may raise :class:`PeerError`; a block
        left by an exception still writes what it held (those commands were issued)."""
        depth = getattr(self._holding, "depth", 0)
        self._holding.depth = depth + 1
        try:
            yield
        finally:
            self._holding.depth = depth
            if depth == 0:
                self.flush()

    def _hold(self, buf: bytes) -> None:
        with self._send_lock:
            if self._closed:
                raise PeerError(f"the {self.kind.label} is shut down")
            self._deferred.append(buf)

    def _write(self, buf: bytes | None) -> None:
        with self._send_lock:
            if self._closed:
                raise PeerError(f"the {self.kind.label} is shut down")
            bufs, self._deferred = self._deferred, []
            if buf is not None:
                bufs.append(buf)
            if not bufs:
                return
            try:
                self._commands.send_bytes(_frame(bufs))
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
            bufs, self._deferred = self._deferred, []  # held cleanup first, then the stop
            bufs.append(self.kind.encode(self.kind.shutdown))
            try:
                self._commands.send_bytes(_frame(bufs))
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


def pack_batch(bufs: list[bytes]) -> bytes:
    """Several encoded messages as one frame: the mark, a count, then each length-prefixed."""
    parts = [bytes([BATCH_MARK]), _U32.pack(len(bufs))]
    for buf in bufs:
        parts += [_U32.pack(len(buf)), buf]
    return b"".join(parts)


def _frame(bufs: list[bytes]) -> bytes:
    """One message alone, several as a batch frame."""
    return bufs[0] if len(bufs) == 1 else pack_batch(bufs)


def unpack_batch(frame: bytes) -> list[bytes]:
    """The messages of a frame: those of a batch frame, else the frame itself.

    :class:`FrameError` for a batch frame that does not add up (a count above
    :data:`MAX_BATCH`, an empty or overrunning part, trailing bytes): none of it is handled.
    """
    if not frame or frame[0] != BATCH_MARK:
        return [frame]
    try:
        (count,) = _U32.unpack_from(frame, 1)
        if not 1 <= count <= MAX_BATCH:
            raise ValueError(f"{count} messages (1 to {MAX_BATCH})")
        pos, out = 1 + _U32.size, []
        for _ in range(count):
            (n,) = _U32.unpack_from(frame, pos)
            pos += _U32.size
            if n == 0 or pos + n > len(frame):
                raise ValueError(f"a part of {n} bytes at offset {pos}")
            out.append(frame[pos : pos + n])
            pos += n
        if pos != len(frame):
            raise ValueError(f"{len(frame) - pos} trailing bytes")
        return out
    except (ValueError, struct.error) as exc:
        raise FrameError(f"bad batch frame ({len(frame)} bytes): {exc}"[:300]) from exc


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
