"""The engine's end of an encode transfer worker process: start, command pipe, notes, close.

Same process model as PD's transfer workers (:mod:`tspd_core.pd.worker`): the engine process
keeps the tensors, the worker process owns the Mooncake engine and the sockets, the two share
the send buffer (shared memory on CPU), and the worker's logs reach the engine's handlers
through PD's log queue::

    engine process                              encode transfer worker process
    ──────────────                              ─────────────────────────────
    WorkerProcess.start ─ Process(buffer, spec) ─► entry: logging, Mooncake, sockets
                        ◄──── WorkerReady ─────── (or WorkerFatal, then exit)
    send(SubmitChunk...) ── command pipe ──────►  control thread
    drain()              ◄─ notes pipe ────────   ChunkDone ...
    close()              ── Shutdown ──────────►  writes drain, unregister, exit

Threading: :meth:`WorkerProcess.send` may be called from any thread; :meth:`drain` and
:meth:`wait` belong to the thread that polls.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as tmp

from tspd_core.epd import ipc
from tspd_core.pd.errors import PeerError
from tspd_core.pd.logs import log_queue

log = logging.getLogger(__name__)

_PRELOAD = ["torch", "numpy", "zmq"]
STOP_TIMEOUT_S = 10.0

#: ``entry(spec, buffer, commands, notes, log_queue)`` runs in the child process.
Entry = Callable[[Any, torch.Tensor, mpc.Connection, mpc.Connection, Any], None]


class WorkerProcess:
    """One worker process and its two pipes (commands in, notes out)."""

    def __init__(self, proc: Any, commands: mpc.Connection, notes: mpc.Connection) -> None:
        self._proc = proc
        self._commands = commands
        self._notes = notes
        self._send_lock = threading.Lock()
        self._closed = False
        self.ready: ipc.WorkerReady | None = None

    @classmethod
    def start(
        cls,
        entry: Entry,
        spec: Any,
        buffer: torch.Tensor,
        name: str,
        start_method: str,
        timeout_s: float,
    ) -> WorkerProcess:
        """Start the worker and wait until it serves; :class:`PeerError` if it cannot."""
        ctx: Any = tmp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)
        if buffer.device.type == "cpu" and not buffer.is_shared():  # type: ignore[no-untyped-call]
            buffer.share_memory_()  # type: ignore[no-untyped-call]
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        note_r, note_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=entry, args=(spec, buffer, cmd_r, note_w, log_queue(ctx)), name=name, daemon=True
        )
        proc.start()
        cmd_r.close()
        note_w.close()
        handle = cls(proc, cmd_w, note_r)
        handle._await_ready(timeout_s)
        return handle

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    @property
    def alive(self) -> bool:
        return not self._closed and bool(self._proc.is_alive())

    def send(self, msg: ipc.Message) -> None:
        """Hand a command to the worker; never waits for the worker to act on it."""
        buf = ipc.encode(msg)
        with self._send_lock:
            if self._closed:
                raise PeerError("the encode worker is shut down")
            try:
                self._commands.send_bytes(buf)
            except OSError as exc:
                raise PeerError(f"encode worker {self.pid} is gone: {exc}") from exc

    def drain(self) -> list[ipc.Message]:
        """Every note published since the last drain; :class:`PeerError` once the worker died."""
        out: list[ipc.Message] = []
        try:
            while self._notes.poll():
                out.append(ipc.decode(self._notes.recv_bytes()))
        except (EOFError, OSError) as exc:
            if not out:
                raise PeerError(f"encode worker {self.pid} died: {exc or 'pipe closed'}") from exc
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until the worker published something or ``timeout_s`` passed."""
        try:
            return bool(self._notes.poll(timeout_s))
        except (EOFError, OSError):
            return True  # the next drain reports the death

    def fileno(self) -> int:
        return self._notes.fileno()

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the worker: Shutdown, then terminate, then kill; idempotent."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._commands.send_bytes(ipc.encode(ipc.Shutdown()))
            except OSError:
                pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            log.warning("encode worker %d ignored Shutdown; terminating it", self.pid)
            self._proc.terminate()
            self._proc.join(2.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2.0)
        self._commands.close()
        self._notes.close()

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._notes.poll(0.1):
                msg = self.drain()[0]
                if isinstance(msg, ipc.WorkerReady):
                    self.ready = msg
                    return
                reason = msg.reason if isinstance(msg, ipc.WorkerFatal) else repr(msg)
                self.close(2.0)
                raise PeerError(f"encode worker failed to start: {reason}")
            if not self._proc.is_alive():
                self.close(1.0)
                raise PeerError(f"encode worker exited at start (code {self._proc.exitcode})")
        self.close(2.0)
        raise PeerError(f"encode worker did not start within {timeout_s:g} s")
