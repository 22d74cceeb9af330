"""What the engine-side peer tells its transfer worker process at start, and the worker's kind.

Built by the peer from its config (:mod:`tspd_core.pd.peer.start`), pickled into the new
process with the arena, read by :class:`~tspd_core.pd.worker.transfer_worker.TransferWorker`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tspd_bootstrap.auth import ClusterCredential
from tspd_core.pd.config import PdTunables, WorkerRole
from tspd_core.pd.layerwise.schedule import LayerwiseSpec
from tspd_core.pd.proc.handle import WorkerKind
from tspd_core.pd.wire import ipc

#: The transfer worker's codec and start/stop messages (engine side:
#: :class:`~tspd_core.pd.peer.worker_handle.WorkerHandle`).
TRANSFER_WORKER: WorkerKind[ipc.Message, ipc.WorkerReady] = WorkerKind(
    "transfer worker", ipc.encode, ipc.decode, ipc.WorkerReady, ipc.Shutdown()
)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs besides the arena; built by the engine-side peer from its config."""

    role: WorkerRole
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
    layerwise: LayerwiseSpec | None = None  #: P only: stream layerwise (docs/layerwise.md)
    write_window: int | None = None  #: Mooncake descriptors in flight; None = by protocol
    #: The cluster credential (P: requires D's seals, seals its bootstrap registration; D:
    #: seals its look-ups and registrations); None = off.
    credential: ClusterCredential | None = field(default=None, repr=False)
