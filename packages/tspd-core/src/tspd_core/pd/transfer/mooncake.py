"""The Mooncake transfer engine, wrapped: one engine and one arena registration per rank.

Ownership: a transfer worker process creates exactly one :class:`MooncakeEngine` and registers
its view of the rank's KV arena once. :meth:`MooncakeEngine.write` is safe to call from several
transfer threads at once (Mooncake's batch calls are); :meth:`close` must run after every
writer stopped.

How a write waits: through a :class:`~tspd_core.pd.transfer.write_stream.WriteStream` — over TCP a
window of asynchronous one-descriptor submissions polled with short naps, because Mooncake's
synchronous batch call busy-polls a core until the batch is done; over RDMA that batch call.

Mooncake reads its log level once, when ``mooncake.engine`` is first imported, so
:func:`quiet_mooncake_logs` must run before that import; this module imports Mooncake lazily
for that reason. Even at ERROR, every engine start printed two lines to stderr: glog's
``WARNING: Logging before InitGoogleLogging() is written to STDERR`` and Mooncake's own
``E... transfer_metadata.cpp] Local segment descriptor not found``, which its P2P handshake
set-up logs inside ``initialize`` before the local segment exists (Mooncake's order of calls,
benign, not ours to change). So ``initialize`` runs with the process's stderr (fd 2)
redirected to a temporary file, and the captured lines go to this module's logger at DEBUG
(at ERROR when ``initialize`` fails). ``TSPD_MOONCAKE_STDERR=1`` leaves stderr alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from tspd_core.pd.errors import ConfigError, TransferError, UsageError
from tspd_core.pd.transfer.write_stream import WriteStream

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
#: Descriptors per synchronous batch: the TCP lanes refuse tens of thousands at once, while
#: RDMA takes TokenSpeed's 4096 (wire.md §6.5).
DEFAULT_MAX_BATCH = {"tcp": 512, "rdma": 4096}
#: Descriptors in flight per write (0 = Mooncake's synchronous batch call, which spins).
DEFAULT_WINDOW = {"tcp": 64, "rdma": 0}
#: A descriptor not done after this long (plus 1 s per GB) fails the write, as Mooncake's own
#: synchronous call does after ``MC_TRANSFER_TIMEOUT`` (30 s by default).
TIMEOUT_S = 30.0


def quiet_mooncake_logs(debug: bool) -> None:
    """Set Mooncake's glog level before ``mooncake.engine`` is imported in this process.

    Mooncake honours ``MC_LOG_LEVEL`` (TRACE, INFO, WARNING, ERROR) at import time; glog's own
    ``GLOG_minloglevel`` has no effect on it. An operator's explicit ``MC_LOG_LEVEL`` wins.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if debug else "ERROR")


#: Set to 1 to leave Mooncake's start-up output on stderr (debugging Mooncake itself).
STDERR_ENV = "TSPD_MOONCAKE_STDERR"
_capture_lock = threading.Lock()  # fd 2 is process-wide: one capture at a time


@contextlib.contextmanager
def _startup_output() -> Iterator[list[str]]:
    """Redirect fd 2 to a temporary file for the block; the list holds its lines afterwards.

    A file, not a pipe: nothing reads while Mooncake writes, and a full pipe would block it.
    Other threads' stderr output during the block is captured too (start-up only, briefly).
    """
    lines: list[str] = []
    if os.environ.get(STDERR_ENV, "") not in ("", "0"):
        yield lines
        return
    with _capture_lock, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            lines.extend(line for line in text.splitlines() if line.strip())


class MooncakeEngine:
    """One rank's Mooncake transfer engine (``P2PHANDSHAKE`` metadata, TCP or RDMA)."""

    def __init__(
        self,
        host: str,
        protocol: str = "tcp",
        device: str = "",
        max_batch: int | None = None,
        window: int | None = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ConfigError(f"Mooncake protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.max_batch = max_batch or DEFAULT_MAX_BATCH[protocol]
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        #: Descriptors in flight per write; 0 = synchronous batches of ``max_batch``.
        self.window = DEFAULT_WINDOW[protocol] if window is None else window
        if self.window < 0:
            raise ConfigError(f"window must be >= 0 (0 = synchronous batches), got {window}")
        self.timeout_s = max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT") or TIMEOUT_S))
        from mooncake.engine import TransferEngine  # late: see quiet_mooncake_logs

        self._engine: Any = TransferEngine()
        with _startup_output() as lines:
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        for line in lines:
            log.log(logging.ERROR if rc else logging.DEBUG, "mooncake start-up: %s", line)
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

        Returns once all bytes landed. Raises :class:`TransferError` naming the failed
        descriptor (or batch); others may have landed, so a caller must treat the whole write
        as failed. Either way no descriptor of this call is still in flight when it returns
        or raises (except after a timeout, which is logged). ``cancel`` (set by another
        thread) stops the write before its next descriptor (batch), with a
        :class:`TransferError`.
        """
        n = len(src)
        if not len(dst) == len(lengths) == n:
            raise ValueError(f"descriptor arrays differ in length: {n}, {len(dst)}, {len(lengths)}")
        stream = self.stream(session, cancel)
        stream.push(src, dst, lengths)
        stream.finish()

    def stream(self, session: str, cancel: threading.Event | None = None) -> WriteStream:
        """A stream of writes to ``session`` for the calling thread (pushes complete in order,
        sharing one window: see :mod:`tspd_core.pd.transfer.write_stream`)."""
        return WriteStream(
            self._engine, session, self.window, self.max_batch, self.timeout_s, cancel
        )

    def close(self) -> None:
        """Unregister the memory this engine registered. The engine itself dies with the process."""
        with self._lock:
            ptrs, self._registered = self._registered, []
        for ptr in ptrs:
            rc = self._engine.unregister_memory(ptr)
            if rc != 0:
                log.warning("Mooncake unregister_memory(%#x) returned %d", ptr, rc)
