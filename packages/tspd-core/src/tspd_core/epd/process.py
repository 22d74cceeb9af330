"""The engine's end of an encode transfer worker process: start, command pipe, notes, close.

Same process model as PD's transfer workers, and the same implementation
(:class:`tspd_core.pd.proc.handle.ProcessHandle`): the engine process keeps the tensors, the worker
process owns the Mooncake engine and the sockets, the two share the send buffer (shared memory
on CPU), and the worker's logs reach the engine's handlers through PD's log queue::

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

from typing import Any

import torch

from tspd_core.epd import ipc
from tspd_core.pd.proc.handle import Entry, ProcessHandle, WorkerKind

ENCODE_WORKER: WorkerKind[ipc.Message, ipc.WorkerReady] = WorkerKind(
    "encode worker", ipc.encode, ipc.decode, ipc.WorkerReady, ipc.Shutdown()
)


class WorkerProcess(ProcessHandle[ipc.Message, ipc.WorkerReady]):
    """One encode worker process and its two pipes (commands in, notes out)."""

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
        return cls.spawn(ENCODE_WORKER, entry, spec, buffer, name, start_method, timeout_s)
