"""Starting, talking to and stopping a rank's transfer worker process (engine side).

The engine process owns the arena; the worker receives it at start through torch's
multiprocessing reductions (a shared-memory file descriptor on CPU, a CUDA IPC handle on GPU),
so a Mooncake write into the worker's registered mapping is visible to the engine at once.

    engine process                               transfer worker process
    ─────────────────────────────                ───────────────────────────────────
    WorkerHandle.start ── Process(arena, spec) ─► _main: logging, Mooncake, sockets
                       ◄──── WorkerReady ──────── (or WorkerFatal, then exit)
    send(TrackRoom...)  ── command pipe ───────►  control thread (runtime.RoleWorker)
    drain()             ◄─ notes pipe ─────────   RoomUpdate ...
    close()             ── Shutdown ───────────►  stop threads, unregister, exit

Workers start with ``forkserver`` by default: the server imports torch once, so each worker
starts in well under a second, and it never inherits an engine's CUDA context. ``spawn`` works
too. Threading: :meth:`WorkerHandle.send` may be called from any thread; :meth:`drain` and
:meth:`wait` belong to the thread that polls the peer.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as tmp

from tspd_core.pd import ipc
from tspd_core.pd.errors import FrameError, PeerError
from tspd_core.pd.logs import install_worker_logging, log_queue
from tspd_core.pd.runtime import WorkerSpec

log = logging.getLogger(__name__)

_PRELOAD = ["torch", "numpy", "zmq"]
STOP_TIMEOUT_S = 10.0


class WorkerHandle:
    """The engine's end of one transfer worker: its process and the two pipes."""

    def __init__(self, proc: Any, commands: mpc.Connection, notes: mpc.Connection) -> None:
        self._proc = proc
        self._commands = commands
        self._notes = notes
        self._send_lock = threading.Lock()
        self._closed = False
        self.ready: ipc.WorkerReady | None = None

    @classmethod
    def start(
        cls, spec: WorkerSpec, arena: torch.Tensor, start_method: str, timeout_s: float
    ) -> WorkerHandle:
        """Start the worker and wait until it serves; :class:`PeerError` if it cannot."""
        ctx: Any = tmp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)
        if arena.device.type == "cpu" and not arena.is_shared():  # type: ignore[no-untyped-call]
            arena.share_memory_()  # type: ignore[no-untyped-call]
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        note_r, note_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_main,
            args=(spec, arena, cmd_r, note_w, log_queue(ctx)),
            name=f"tspd-{spec.role}-worker-tp{spec.tp_rank}",
            daemon=True,
        )
        proc.start()
        cmd_r.close()
        note_w.close()
        _grow_pipe(cmd_w.fileno())
        handle = cls(proc, cmd_w, note_r)
        handle._await_ready(timeout_s)
        return handle

    @property
    def alive(self) -> bool:
        return not self._closed and bool(self._proc.is_alive())

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    def send(self, msg: ipc.Message) -> None:
        """Hand a command to the worker; never waits for the worker to act on it."""
        buf = ipc.encode(msg)
        with self._send_lock:
            if self._closed:
                raise PeerError("the transfer worker is shut down")
            try:
                self._commands.send_bytes(buf)
            except OSError as exc:
                raise PeerError(f"transfer worker {self.pid} is gone: {exc}") from exc

    def drain(self) -> list[ipc.Message]:
        """Every message the worker published since the last drain (non-blocking).

        Raises :class:`PeerError` once the worker died and nothing is left to read.
        """
        out: list[ipc.Message] = []
        try:
            while self._notes.poll():
                out.append(ipc.decode(self._notes.recv_bytes()))
        except (EOFError, OSError) as exc:
            if not out:
                raise PeerError(f"transfer worker {self.pid} died: {exc or 'pipe closed'}") from exc
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until the worker published something or ``timeout_s`` passed."""
        return bool(self._notes.poll(timeout_s))

    def fileno(self) -> int:
        """The notes pipe's descriptor, for engines that multiplex waits (select/poll)."""
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
            log.warning("transfer worker %d ignored Shutdown; terminating it", self.pid)
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
                raise PeerError(f"transfer worker failed to start: {reason}")
            if not self._proc.is_alive():
                self.close(1.0)
                raise PeerError(f"transfer worker exited at start (code {self._proc.exitcode})")
        self.close(2.0)
        raise PeerError(f"transfer worker did not start within {timeout_s:g} s")


def _grow_pipe(fd: int, nbytes: int = 1 << 20) -> None:
    """Let the command pipe hold ~1 MiB, so an engine handing over a large batch does not wait
    for the worker to read (Linux; elsewhere the default size stays)."""
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, nbytes)  # F_SETPIPE_SZ
    except (ImportError, OSError) as exc:
        log.debug("could not grow the command pipe: %s", exc)


def _main(
    spec: WorkerSpec,
    arena: torch.Tensor,
    commands: mpc.Connection,
    notes: mpc.Connection,
    logs: Any,
) -> None:
    """Entry point of the worker process."""
    install_worker_logging(logs, spec.log_level)
    from tspd_core.pd.engine import quiet_mooncake_logs

    os.environ.update(dict(spec.mooncake_env))
    quiet_mooncake_logs(debug=spec.log_level <= logging.DEBUG)
    try:
        worker = _build(spec, arena, notes)
    except Exception as exc:
        log.exception("transfer worker failed to start")
        notes.send_bytes(ipc.encode(ipc.WorkerFatal(f"{type(exc).__name__}: {exc}")))
        return
    try:
        worker.ready()
        worker.run(commands)
    finally:
        worker.close()
        log.debug("transfer worker tp%d stopped", spec.tp_rank)


def _build(spec: WorkerSpec, arena: torch.Tensor, notes: mpc.Connection) -> Any:
    if spec.role == "prefill":
        from tspd_core.pd.prefill_worker import PrefillWorker

        return PrefillWorker(spec, arena, notes)
    if spec.role == "decode":
        from tspd_core.pd.decode_worker import DecodeWorker

        return DecodeWorker(spec, arena, notes)
    raise FrameError(f"unknown worker role {spec.role!r}")
