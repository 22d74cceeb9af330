"""Starting, talking to and stopping a rank's transfer worker process (engine side).

The engine process owns the arena; the worker receives it at start through torch's
multiprocessing reductions (a shared-memory file descriptor on CPU, a CUDA IPC handle on GPU),
so a Mooncake write into the worker's registered mapping is visible to the engine at once.

    engine process                               transfer worker process
    ─────────────────────────────                ───────────────────────────────────
    WorkerHandle.start ── Process(arena, spec) ─► _main: logging, Mooncake, sockets
                       ◄──── WorkerReady ──────── (or WorkerFatal, then exit)
    send(TrackRoom...)  ── command pipe ───────►  control thread (runtime.RoleWorker, a
                                                  loop.ControlLoop)
    drain()             ◄─ notes pipe ─────────   RoomUpdate ...
    close()             ── Shutdown ───────────►  stop threads, unregister, exit

The process plumbing (pipes, start, ready, stop) is :class:`tspd_core.pd.proc.handle.ProcessHandle`,
shared with EPD's encode workers. Threading: :meth:`WorkerHandle.send` may be called from any
thread; :meth:`drain` and :meth:`wait` belong to one thread at a time.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
from typing import Any

import torch

from tspd_core.pd.errors import FrameError
from tspd_core.pd.proc.handle import ProcessHandle
from tspd_core.pd.proc.logs import install_worker_logging
from tspd_core.pd.proc.loop import serve
from tspd_core.pd.wire import ipc
from tspd_core.pd.worker.transfer_worker import TRANSFER_WORKER, RoleWorker, WorkerSpec


class WorkerHandle(ProcessHandle[ipc.Message, ipc.WorkerReady]):
    """The engine's end of one transfer worker: its process and the two pipes."""

    @classmethod
    def start(
        cls, spec: WorkerSpec, arena: torch.Tensor, start_method: str, timeout_s: float
    ) -> WorkerHandle:
        """Start the worker and wait until it serves; :class:`PeerError` if it cannot."""
        name = f"tspd-{spec.role}-worker-tp{spec.tp_rank}"
        return cls.spawn(TRANSFER_WORKER, _main, spec, arena, name, start_method, timeout_s)


def _main(
    spec: WorkerSpec,
    arena: torch.Tensor,
    commands: mpc.Connection,
    notes: mpc.Connection,
    logs: Any,
) -> None:
    """Entry point of the worker process."""
    install_worker_logging(logs, spec.log_level)
    from tspd_core.pd.transfer.mooncake import quiet_mooncake_logs

    os.environ.update(dict(spec.mooncake_env))
    quiet_mooncake_logs(debug=spec.log_level <= logging.DEBUG)
    serve(TRANSFER_WORKER, lambda: _build(spec, arena, notes), commands, notes, f"tp{spec.tp_rank}")


def _build(spec: WorkerSpec, arena: torch.Tensor, notes: mpc.Connection) -> RoleWorker:
    if spec.role == "prefill":
        from tspd_core.pd.prefill.worker import PrefillWorker

        return PrefillWorker(spec, arena, notes)
    if spec.role == "decode":
        from tspd_core.pd.decode.worker import DecodeWorker

        return DecodeWorker(spec, arena, notes)
    raise FrameError(f"unknown worker role {spec.role!r}")
