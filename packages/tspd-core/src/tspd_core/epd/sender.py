"""`EmbeddingSender`: the encode rank's engine-side handle.

The encode engine runs the vision tower and hands each item's rows to :meth:`EmbeddingSender.send`,
which copies them into the registered send buffer and passes the chunk to the rank's transfer
worker; :meth:`poll` returns each chunk's verdict once, after which its buffer space is free
again. Nothing here waits for a transfer::

    vision tower ─► EmbeddingChunk ─► send(): copy into the send buffer ─► SubmitChunk ─► worker
                                                                                      │
    poll() ◄─ SendOutcome (Success / Failed + reason) ◄─ ChunkDone (rows no longer read)

With ``tp_size`` > 1 every encode rank holds the same (TP-gathered) rows and sends each item;
rank ``e`` serves prefill ranks ``[e·fanout, (e+1)·fanout)``. Rank 0 may also host the encode
node's embedding bootstrap server (``serve_bootstrap``).

Threading: one engine thread drives ``send``, ``poll`` and ``abort_room``; they take a lock, so
another thread may call them too. ``sync`` (wait until the worker handled every command sent
so far) belongs to the thread that polls. ``shutdown`` is idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import torch

from tspd_bootstrap import BootstrapServer
from tspd_bootstrap.client import normalize_url
from tspd_core.epd import ipc
from tspd_core.epd.config import EmbeddingSenderConfig
from tspd_core.epd.encode_worker import EncodeWorkerSpec, worker_main
from tspd_core.epd.items import EmbeddingChunk, dtype_name
from tspd_core.epd.pool import BufferPool, Extent, PoolStats
from tspd_core.epd.process import WorkerProcess
from tspd_core.ids import Room
from tspd_core.pd.errors import ConfigError, PeerError, UsageError
from tspd_core.pd.status import TransferPoll

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SendOutcome:
    """A sent chunk's verdict (returned once by :meth:`EmbeddingSender.poll`)."""

    room: Room
    status: TransferPoll  #: SUCCESS or FAILED
    reason: str = ""
    parked: bool = False  #: the chunk waited for its receivers to register
    receivers: int = 0  #: prefill ranks it was sent to (or told Failed)
    nbytes: int = 0  #: bytes written over Mooncake


@dataclass(frozen=True, slots=True)
class SenderStats:
    """Counters of one encode rank (cumulative) and its send buffer (a snapshot)."""

    buffer: PoolStats
    in_flight: int  #: chunks sent, not yet concluded
    sent_total: int
    succeeded_total: int
    failed_total: int
    parked_total: int  #: chunks that waited for their receivers
    bytes_total: int  #: bytes written over Mooncake


class EmbeddingSender:
    """One encode rank. Start with :meth:`start`; close with :meth:`shutdown` (or ``with``)."""

    def __init__(
        self,
        config: EmbeddingSenderConfig,
        worker: WorkerProcess,
        buffer: BufferPool,
        server: BootstrapServer | None,
    ) -> None:
        self.config = config
        self._worker = worker
        self._buffer = buffer
        self._server = server
        self._lock = threading.Lock()
        self._in_flight: dict[Room, Extent] = {}
        self._dead: str | None = None
        self._counts = {"sent": 0, "ok": 0, "failed": 0, "parked": 0, "bytes": 0}
        self._held: list[SendOutcome] = []  # taken by sync(), returned by the next poll()
        self._syncs_sent = 0
        self._synced = 0  # the last Sync token the worker answered

    @classmethod
    def start(cls, config: EmbeddingSenderConfig) -> EmbeddingSender:
        """Allocate the send buffer, start the bootstrap server (rank 0, if asked) and the
        worker (Mooncake, PULL socket, bootstrap registration). :class:`PeerError` if the
        worker cannot start, e.g. the bootstrap server stays unreachable."""
        buffer = BufferPool(config.buffer_bytes, config.block_bytes, shared=True)
        server, bootstrap_url = _serve_bootstrap(config)
        spec = EncodeWorkerSpec(
            host=config.advertised_host(),
            tp_size=config.tp_size,
            tp_rank=config.tp_rank,
            protocol=config.protocol,
            ib_device=config.ib_device,
            max_batch=config.max_batch(),
            tunables=config.tunables,
            bootstrap_url=bootstrap_url,
            tombstone_s=config.tombstone_seconds,
            log_level=logging.DEBUG
            if config.debug
            else logging.getLogger("tspd_core.epd").getEffectiveLevel(),
        )
        try:
            worker = WorkerProcess.start(
                worker_main,
                spec,
                buffer.tensor,
                f"tspd-encode-worker-tp{config.tp_rank}",
                config.start_method,
                config.start_timeout_s,
            )
        except BaseException:
            if server is not None:
                server.close()
            raise
        return cls(config, worker, buffer, server)

    # ---- identity -----------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The worker's ZMQ PULL port (where prefill ranks push item infos)."""
        return self._ready().port

    @property
    def session_id(self) -> str:
        return self._ready().session_id

    @property
    def bootstrap_server(self) -> BootstrapServer | None:
        """The embedding bootstrap server this rank hosts, if any."""
        return self._server

    # ---- the engine's API ---------------------------------------------------------------

    def send(self, chunk: EmbeddingChunk) -> int | None:
        """Queue one item's rows for its receivers; returns the bytes staged.

        None when the send buffer has no room right now (poll, then retry). Raises
        :class:`UsageError` for a room already in flight or an item larger than the whole
        buffer, and :class:`PeerError` once the worker is gone.
        """
        main, deep = chunk.nbytes, chunk.deepstack_nbytes
        with self._lock:
            if self._dead is not None:
                raise PeerError(f"encode rank {self.config.tp_rank} is down: {self._dead}")
            if chunk.room in self._in_flight:
                raise UsageError(f"room {chunk.room} is already being sent")
            if not self._buffer.fits(main + deep):
                raise UsageError(
                    f"room {chunk.room}: {main + deep} bytes exceed the send buffer "
                    f"({self._buffer.nbytes} bytes); raise buffer_bytes"
                )
            extent = self._buffer.allocate(main + deep)
            if extent is None:
                return None
            _copy_in(self._buffer.view(extent, 0, main), chunk.embedding)
            if chunk.deepstack is not None:
                _copy_in(self._buffer.view(extent, main, deep), chunk.deepstack)
            offset = extent.start * self._buffer.block_bytes
            msg = ipc.SubmitChunk(
                room=chunk.room,
                offset=offset,
                n_tokens=chunk.n_tokens,
                hidden=chunk.hidden,
                dtype=dtype_name(chunk.embedding.dtype),
                nbytes=main,
                deepstack_offset=offset + main if deep else 0,
                deepstack_nbytes=deep,
            )
            self._in_flight[chunk.room] = extent
            self._counts["sent"] += 1
        self._worker.send(msg)
        return main + deep

    def poll(self) -> list[SendOutcome]:
        """Every chunk concluded since the last poll (its buffer space is free again)."""
        out = self._take()
        with self._lock:
            held, self._held = self._held, []
        return held + out

    def sync(self, timeout_s: float = 30.0) -> None:
        """Return once the worker handled every command sent before this call.

        Commands (:meth:`send`, :meth:`abort_room`) reach the worker in order, but their
        effect is not visible here until a chunk concludes. After ``sync`` a chunk sent before
        is known to the worker: e.g. parked, when its receivers have not asked yet. Outcomes
        that arrive meanwhile are kept for the next :meth:`poll`; call it from the thread that
        polls. :class:`PeerError` if the worker is down or does not answer in ``timeout_s``.
        """
        with self._lock:
            self._syncs_sent += 1
            token = self._syncs_sent
        self._worker.send(ipc.Sync(token))
        deadline = time.monotonic() + timeout_s
        while self._synced < token:
            if self._dead is not None:
                raise PeerError(f"encode rank {self.config.tp_rank} is down: {self._dead}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(
                    f"encode rank {self.config.tp_rank}: the worker did not answer a sync "
                    f"within {timeout_s:g} s"
                )
            self._worker.wait(min(left, 0.1))
            taken = self._take()
            with self._lock:
                self._held += taken

    def _take(self) -> list[SendOutcome]:
        """Handle the worker's notes: outcomes of concluded chunks, sync answers, its death."""
        try:
            notes = self._worker.drain()
        except PeerError as exc:
            return self._fail_all(str(exc))
        out: list[SendOutcome] = []
        with self._lock:
            for note in notes:
                if isinstance(note, ipc.ChunkDone):
                    extent = self._in_flight.pop(note.room, None)
                    if extent is not None:
                        self._buffer.free(extent)
                    out.append(self._count(_outcome(note)))
                elif isinstance(note, ipc.Synced):
                    self._synced = max(self._synced, note.token)
                elif isinstance(note, ipc.WorkerFatal):
                    self._dead = note.reason
        if self._dead is not None:
            out += self._fail_all(self._dead)
        return out

    def abort_room(self, room: Room, reason: str = "aborted by the encode engine") -> None:
        """Give up on ``room``: its receivers get Failed (now, or when they register), and its
        chunk, if any, concludes Failed once no write of it runs. Safe for unknown rooms."""
        self._worker.send(ipc.AbortRoom(room, reason))

    def in_flight(self) -> int:
        """Chunks sent and not yet concluded."""
        with self._lock:
            return len(self._in_flight)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the worker published something (or ``timeout_s``); for idle loops."""
        return self._worker.wait(timeout_s)

    def stats(self) -> SenderStats:
        """Counters and the send buffer's accounting."""
        with self._lock:
            c = self._counts
            return SenderStats(
                buffer=self._buffer.stats(),
                in_flight=len(self._in_flight),
                sent_total=c["sent"],
                succeeded_total=c["ok"],
                failed_total=c["failed"],
                parked_total=c["parked"],
                bytes_total=c["bytes"],
            )

    def shutdown(self) -> None:
        """Stop the worker (queued writes finish first) and the bootstrap server; idempotent."""
        with self._lock:
            self._dead = self._dead or "shut down"
        self._worker.close()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------

    def _ready(self) -> ipc.WorkerReady:
        ready = self._worker.ready
        if ready is None:
            raise PeerError("the encode worker never became ready")
        return ready

    def _count(self, outcome: SendOutcome) -> SendOutcome:
        c = self._counts
        c["ok" if outcome.status is TransferPoll.SUCCESS else "failed"] += 1
        c["parked"] += outcome.parked
        c["bytes"] += outcome.nbytes
        return outcome

    def _fail_all(self, reason: str) -> list[SendOutcome]:
        with self._lock:
            self._dead = self._dead or reason
            rooms, self._in_flight = list(self._in_flight.items()), {}
            for _, extent in rooms:
                self._buffer.free(extent)
            why = f"encode worker lost: {reason}"
            return [self._count(SendOutcome(r, TransferPoll.FAILED, why)) for r, _ in rooms]


def _outcome(note: ipc.ChunkDone) -> SendOutcome:
    return SendOutcome(
        note.room, note.status, note.reason, note.parked, note.receivers, note.nbytes
    )


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Raw bytes of ``src`` (any device, any layout) into the uint8 view ``dst``."""
    flat = src.detach().contiguous().reshape(-1).view(torch.uint8)
    dst.copy_(flat)


def _serve_bootstrap(config: EmbeddingSenderConfig) -> tuple[BootstrapServer | None, str]:
    """The embedding bootstrap server this rank serves (if any) and the URL it registers with.

    Port 0 in the URL serves on a port the system picks (an encode node of one rank only: no
    other rank could learn it); the rank then registers with the port the server got, which
    :attr:`EmbeddingSender.bootstrap_server` tells its launcher.
    """
    if config.serve_bootstrap is None or config.tp_rank != 0:
        return None, config.bootstrap_url
    try:
        parts = urllib.parse.urlsplit(normalize_url(config.bootstrap_url))
        port = parts.port
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if port is None:
        raise ConfigError(f"serving the bootstrap needs a fixed port in {config.bootstrap_url!r}")
    if port == 0 and config.tp_size > 1:
        raise ConfigError(
            f"serving the bootstrap on port 0 ({config.bootstrap_url!r}) needs an encode node of "
            f"one rank, not {config.tp_size}: the other ranks could not learn the port"
        )
    server = BootstrapServer(config.serve_bootstrap, port, embedding=True).start()
    if port != 0:
        return server, config.bootstrap_url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return server, f"{parts.scheme}://{host}:{server.port}"
