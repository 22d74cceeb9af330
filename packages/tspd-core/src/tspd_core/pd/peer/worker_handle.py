"""Starting, talking to and stopping a rank's transfer worker process (engine side).

The engine process owns the arena; the worker receives it at start through torch's
multiprocessing reductions (a shared-memory file descriptor on CPU, a CUDA IPC handle on GPU),
so a Mooncake write into the worker's registered mapping is visible to the engine at once::

    engine process                               transfer worker process
    ─────────────────────────────                ───────────────────────────────────
    WorkerHandle.start ── Process(arena, spec) ─► the role's main (prefill.worker.main or
                                                  decode.worker.main): logging, Mooncake,
                       ◄──── WorkerReady ──────── sockets (or WorkerFatal, then exit)
    send(TrackRoom...)  ── command pipe ───────►  control thread (worker.transfer_worker:
                                                  a TransferWorker with the role's half)
    drain()             ◄─ notes pipe ─────────   RoomUpdate ...
    close()             ── Shutdown ───────────►  stop threads, unregister, exit

The process plumbing (pipes, start, ready, stop) is
:class:`tspd_core.pd.proc.handle.ProcessHandle`, shared with EPD's encode workers. Threading:
:meth:`WorkerHandle.send` may be called from any thread; :meth:`drain` and :meth:`wait` belong
to one thread at a time.
"""

from __future__ import annotations

import torch

from tspd_core.pd.proc.handle import Entry, ProcessHandle
from tspd_core.pd.wire import ipc
from tspd_core.pd.worker.spec import TRANSFER_WORKER, WorkerSpec


class WorkerHandle(ProcessHandle[ipc.Message, ipc.WorkerReady]):
    """The engine's end of one transfer worker: its process and the two pipes."""

    @classmethod
    def start(
        cls,
        spec: WorkerSpec,
        arena: torch.Tensor,
        main: Entry,
        start_method: str,
        timeout_s: float,
    ) -> WorkerHandle:
        """Start the worker process at ``main`` (its role's entry point) and wait until it
        serves; :class:`PeerError` if it cannot."""
        name = f"tspd-{spec.role}-worker-tp{spec.tp_rank}"
        return cls.spawn(TRANSFER_WORKER, main, spec, arena, name, start_method, timeout_s)
