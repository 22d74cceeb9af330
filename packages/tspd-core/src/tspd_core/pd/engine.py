"""The Mooncake transfer engine, wrapped: one engine and one arena registration per rank.

Ownership: a transfer worker process creates exactly one :class:`MooncakeEngine` and registers
its view of the rank's KV arena once. :meth:`MooncakeEngine.write` is safe to call from several
transfer threads at once (Mooncake's batch calls are); :meth:`close` must run after every
writer stopped.

Mooncake reads its log level once, when ``mooncake.engine`` is first imported, so
:func:`quiet_mooncake_logs` must run before that import; this module imports Mooncake lazily
for that reason.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from tspd_core.pd.errors import ConfigError, TransferError, UsageError

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
#: Descriptors per synchronous batch: the TCP lanes refuse tens of thousands at once, while
#: RDMA takes TokenSpeed's 4096 (WIRE.md §6.5).
DEFAULT_MAX_BATCH = {"tcp": 512, "rdma": 4096}


def quiet_mooncake_logs(debug: bool) -> None:
    """Set Mooncake's glog level before ``mooncake.engine`` is imported in this process.

    Mooncake honours ``MC_LOG_LEVEL`` (TRACE, INFO, WARNING, ERROR) at import time; glog's own
    ``GLOG_minloglevel`` has no effect on it. An operator's explicit ``MC_LOG_LEVEL`` wins.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if debug else "ERROR")


class MooncakeEngine:
    """One rank's Mooncake transfer engine (``P2PHANDSHAKE`` metadata, TCP or RDMA)."""

    def __init__(
        self,
        host: str,
        protocol: str = "tcp",
        device: str = "",
        max_batch: int | None = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ConfigError(f"Mooncake protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.max_batch = max_batch or DEFAULT_MAX_BATCH[protocol]
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        from mooncake.engine import TransferEngine  # late: see quiet_mooncake_logs

        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device!r}) "
                f"returned {rc}; check the host address and, for rdma, the device name"
            )
        if protocol == "tcp" and os.environ.get("MC_TCP_PROTO") == "1":
            log.warning(
                "MC_TCP_PROTO=1 forces Mooncake's unacknowledged TCP framing: a write may be "
                "reported complete before it landed, so Success can overtake the KV"
            )
        self.host = host
        self.protocol = protocol
        self.rpc_port = int(self._engine.get_rpc_port())
        self._registered: list[int] = []
        self._lock = threading.Lock()

    @property
    def session_id(self) -> str:
        """What peers pass as the target of a write: ``"<host>:<rpc_port>"``."""
        return f"{self.host}:{self.rpc_port}"

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``[ptr, ptr + nbytes)`` for one-sided access (once per arena)."""
        if ptr == 0 or nbytes <= 0:
            raise ConfigError(f"cannot register {nbytes} bytes at {ptr:#x}")
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({ptr:#x}, {nbytes}) returned {rc}")
        with self._lock:
            self._registered.append(ptr)

    def unregister(self, ptr: int) -> None:
        """Unregister the region :meth:`register` registered at ``ptr`` (e.g. a receiver that
        borrowed this engine shuts down, or a peer releases its arena for sleep).

        :class:`UsageError` if ``ptr`` is not registered here; :class:`TransferError` when
        Mooncake refuses (the region then stays registered and tracked).
        """
        with self._lock:
            if ptr not in self._registered:
                raise UsageError(f"{ptr:#x} is not registered with this engine")
            rc = self._engine.unregister_memory(ptr)
            if rc != 0:
                raise TransferError(f"Mooncake unregister_memory({ptr:#x}) returned {rc}")
            self._registered.remove(ptr)

    def is_registered(self, ptr: int) -> bool:
        """Whether a region starting at ``ptr`` is registered through this engine."""
        with self._lock:
            return ptr in self._registered

    def write(
        self,
        session: str,
        src: npt.NDArray[np.uint64],
        dst: npt.NDArray[np.uint64],
        lengths: npt.NDArray[np.uint64],
        cancel: threading.Event | None = None,
    ) -> None:
        """Write ``lengths[i]`` bytes from local ``src[i]`` to remote ``dst[i]`` for every i.

        Splits the descriptors into batches of at most ``max_batch``; returns once all bytes
        landed. Raises :class:`TransferError` naming the failed batch; earlier batches may have
        landed, so a caller must treat the whole write as failed. ``cancel`` (set by another
        thread) stops the write between two batches, with a :class:`TransferError`.
        """
        n = len(src)
        if not len(dst) == len(lengths) == n:
            raise ValueError(f"descriptor arrays differ in length: {n}, {len(dst)}, {len(lengths)}")
        for start in range(0, n, self.max_batch):
            if cancel is not None and cancel.is_set():
                raise TransferError(
                    f"write to {session} cancelled after {start} of {n} descriptors"
                )
            end = min(start + self.max_batch, n)
            rc = self._engine.batch_transfer_sync_write(
                session,
                src[start:end].tolist(),
                dst[start:end].tolist(),
                lengths[start:end].tolist(),
            )
            if rc != 0:
                nbytes = int(lengths[start:end].sum())
                raise TransferError(
                    f"Mooncake write to {session} failed (rc {rc}) on descriptors "
                    f"{start}..{end - 1} of {n} ({nbytes} bytes)"
                )

    def close(self) -> None:
        """Unregister the memory this engine registered. The engine itself dies with the process."""
        with self._lock:
            ptrs, self._registered = self._registered, []
        for ptr in ptrs:
            rc = self._engine.unregister_memory(ptr)
            if rc != 0:
                log.warning("Mooncake unregister_memory(%#x) returned %d", ptr, rc)
