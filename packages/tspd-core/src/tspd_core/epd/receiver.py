"""`EmbeddingReceiver`: the prefill node's first stage, driven by the scheduling loop.

Every rank of a prefill replica stages the same requests in the same order; each round every rank
calls :meth:`settle`, which computes one admission code per staged request (wire.md §1: FAILED 0,
PENDING 1, DONE 2), reduces the codes with MIN across the replica (skipped at TP 1) and acts on
the agreed codes, so all ranks admit or fail the same requests in the same round::

    stage(rid, items) ─► waiting for pool space ─► extent allocated, advertised to the encode rank
                                                         │ status from E (via the sink)
    settle(group): local codes ─ MIN ─► DONE    ─► LandedRequest (rows in the pool) ─► release(rid)
                   PENDING > waiting_timeout ─► 0 ─► FAILED  ─► FailedRequest, buffers released or
                   abort(rid) / item failed ──► 0               quarantined, PD room aborted

Buffers: one extent per item in a pool registered once with the transfer engine. An extent is
freed when the encode rank can no longer write into it (its rows landed, it said Failed, or it
was never told the address); otherwise it is quarantined until that status arrives or
``quarantine_s`` passes. Pool space is handed out in staging order (a request that does not fit
waits, and so does everything staged after it), so a large item cannot starve.

Threading: everything here belongs to the scheduler thread; the sink's own thread does the
network I/O. ``settle`` is collective over the replica; ``sweep`` is not.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tspd_core.epd.config import EmbeddingReceiverConfig
from tspd_core.epd.items import (
    Admission,
    EmbeddingItem,
    FailedRequest,
    LandedItem,
    LandedRequest,
    Settlement,
    ShardMode,
    dtype_name,
    shard_rows,
)
from tspd_core.epd.pool import BufferPool, Extent, PoolStats
from tspd_core.epd.receive_state import RItem, RRequest, local_code
from tspd_core.epd.sink import Advert, EmbeddingSink, NoteKind, SinkIdentity
from tspd_core.ids import RequestId, Room
from tspd_core.pd.errors import PeerError, UsageError
from tspd_core.pd.peer.agreement import ReplicaGroup
from tspd_core.pd.prefill.peer import PrefillPeer
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs

log = logging.getLogger(__name__)


class RoomAborter(Protocol):
    """Fails a request's P→D room so the decode node waiting on it stops waiting (wire.md §2.4:
    an EPD embedding timeout on P aborts the room). Called on the scheduler thread, once per
    failed request that was staged with a ``pd_room``; it must not block. The PD prefill peer
    is meant to provide it (``PrefillPeer.abort_room``, see docs/epd.md)."""

    def abort_room(self, room: Room, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """Counters of one receiver (cumulative, except the pool snapshot and the two sizes)."""

    pool: PoolStats
    pending: int  #: staged, not yet admitted or failed
    admitted: int  #: admitted, not yet released
    staged_total: int
    admitted_total: int
    failed_total: int
    timed_out_total: int
    landed_bytes: int  #: bytes of rows (and deepstack) that landed here


class EmbeddingReceiver:
    """A prefill rank's EPD receiver; build it with :func:`embedding_receiver`."""

    def __init__(
        self,
        config: EmbeddingReceiverConfig,
        engine: MooncakeEngine,
        owns_engine: bool,
        aborter: RoomAborter | None = None,
    ) -> None:
        self.config = config
        self._engine = engine
        self._owns_engine = owns_engine
        self._aborter = aborter
        self._pool = BufferPool(config.pool_bytes, config.block_bytes, config.device, shared=True)
        engine.register(self._pool.base_ptr, self._pool.nbytes)
        me = SinkIdentity(
            host=engine.host,
            session_id=engine.session_id,
            tp_size=config.tp_size,
            tp_rank=config.tp_rank,
            hidden=config.hidden,
            dtype=dtype_name(config.dtype),
            has_deepstack=config.deepstack_levels > 0,
            pool_ptr=self._pool.base_ptr,
        )
        self._sink = EmbeddingSink(me, config.lookup_timeout_s, config.quarantine_seconds)
        self._pending: dict[RequestId, RRequest] = {}  # staging order
        self._admitted: dict[RequestId, RRequest] = {}
        self._rooms: dict[Room, RRequest] = {}  # every tracked item's room
        self._counts = {"staged": 0, "admitted": 0, "failed": 0, "timed_out": 0, "bytes": 0}
        self._closed = False

    @property
    def port(self) -> int:
        """This receiver's ZMQ PULL port (where encode ranks push status)."""
        return self._sink.port

    @property
    def mode(self) -> ShardMode:
        return self.config.mode

    # ---- the scheduler's API ------------------------------------------------------------

    def stage(
        self, rid: RequestId, items: Sequence[EmbeddingItem], pd_room: Room | None = None
    ) -> None:
        """Start fetching a request's item embeddings (returns at once).

        ``pd_room`` is the request's P→D room, aborted if the embeddings never arrive. Raises
        :class:`UsageError` for a request already tracked or a room already in use.
        """
        if self._closed:
            raise PeerError("the embedding receiver is shut down")
        if rid in self._pending or rid in self._admitted:
            raise UsageError(f"request {rid!r} is already staged")
        rooms = [item.room for item in items]
        for room in rooms:
            if room in self._rooms or self._pool.is_held(room) or rooms.count(room) > 1:
                raise UsageError(f"request {rid!r}: room {room} is already in use")
        per_row = self.config.row_bytes + self.config.deepstack_row_bytes
        request = RRequest.build(rid, items, pd_room, time.monotonic(), self._geometry, per_row)
        for item in request.items:
            if not self._pool.fits(item.nbytes):
                item.failed = (
                    f"needs {item.nbytes} bytes; the receive pool holds {self._pool.nbytes} "
                    "(raise pool_bytes)"
                )
        self._pending[rid] = request
        self._rooms.update((room, request) for room in rooms)
        self._counts["staged"] += 1
        self._allocate(time.monotonic())  # advertise now rather than at the next round

    def settle(self, group: ReplicaGroup | None = None) -> Settlement:
        """One round: agree on every staged request's code and act on it (collective).

        Every rank of the replica calls it in the same round with the same staged requests;
        ``group`` is the replica's group (required at TP > 1; a replica of one needs none).
        """
        if self.config.tp_size > 1 and group is None:
            raise UsageError("a prefill replica of TP > 1 must settle over its replica group")
        now = time.monotonic()
        self.sweep(now)
        self._allocate(now)
        pending = list(self._pending.values())
        if not pending:  # the same on every rank: no collective this round
            return Settlement()
        codes = [local_code(r, now, self.config.tunables.waiting_timeout_s) for r in pending]
        agreed, why = self._reduce(codes, group)
        admitted: list[LandedRequest] = []
        failed: list[FailedRequest] = []
        for request, code, mine in zip(pending, agreed, codes, strict=True):
            if code == Admission.DONE:
                admitted.append(self._admit(request))
            elif code == Admission.FAILED:
                failed.append(self._fail(request, now, why or request.reason(mine)))
        return Settlement(tuple(admitted), tuple(failed))

    def release(self, rid: RequestId) -> None:
        """The prefill consumed an admitted request's rows: give its extents back."""
        request = self._admitted.pop(rid, None)
        if request is None:
            raise UsageError(f"request {rid!r} is not admitted (or was released already)")
        self._drop(request, time.monotonic())

    def abort(self, rid: RequestId, reason: str = "aborted by the engine") -> bool:
        """Give up on a request: a staged one fails (everywhere) at the next :meth:`settle`,
        an admitted one is released. Every rank must abort it in the same round. False if
        the request is not tracked."""
        if rid in self._pending:
            self._pending[rid].aborted = reason
            return True
        if rid in self._admitted:
            self.release(rid)
            return True
        return False

    def sweep(self, now: float | None = None) -> None:
        """Take the sink's notes and free lapsed quarantines (local; any time, any rank)."""
        now = time.monotonic() if now is None else now
        for note in self._sink.notes():
            request = self._rooms.get(note.room)
            if request is None:
                self._pool.lift(note.room)  # a quarantined room's writer is done with it
                continue
            item = request.item(note.room)
            item.settled = True
            if note.kind is NoteKind.LANDED:
                item.landed = True
            else:
                item.failed = note.reason
        self._pool.sweep(now)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the encode side answered something (or ``timeout_s``): an idle
        scheduler loop's pause between rounds. True if there is news for :meth:`settle`."""
        return self._sink.wait(timeout_s)

    def stats(self) -> ReceiverStats:
        c = self._counts
        return ReceiverStats(
            pool=self._pool.stats(),
            pending=len(self._pending),
            admitted=len(self._admitted),
            staged_total=c["staged"],
            admitted_total=c["admitted"],
            failed_total=c["failed"],
            timed_out_total=c["timed_out"],
            landed_bytes=c["bytes"],
        )

    def shutdown(self) -> None:
        """Stop the sink; close the engine if this receiver opened it, else unregister the
        pool from the borrowed engine (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._sink.close()
        if self._owns_engine:
            self._engine.close()
        else:
            self._engine.unregister(self._pool.base_ptr)

    # ---- internals ----------------------------------------------------------------------

    def _geometry(self, span: int) -> tuple[int, int]:
        if self.mode is ShardMode.ROWS:
            return shard_rows(span, self.config.tp_rank, self.config.tp_size)
        return 0, span

    def _allocate(self, now: float) -> None:
        """Hand out pool space in staging order; stop at the first item that does not fit."""
        for request in self._pending.values():
            if request.aborted or request.any_failed():
                continue
            for item in request.items:
                if item.extent is not None:
                    continue
                extent = self._pool.allocate(item.nbytes)
                if extent is None:
                    return
                item.extent = extent
                self._advertise(item.spec.room, item, extent)

    def _advertise(self, room: Room, item: RItem, extent: Extent) -> None:
        main = item.n_rows * self.config.row_bytes
        deep = self._pool.ptr(extent, main) if self.config.deepstack_levels else 0
        spec = item.spec
        ptr = self._pool.ptr(extent)
        host, port = spec.bootstrap_host, spec.bootstrap_port
        advert = Advert(room, host, port, ptr, deep, item.n_rows, item.row_start, spec.n_tokens)
        self._sink.advertise(advert)
        item.handed = True

    def _reduce(
        self, codes: list[Admission], group: ReplicaGroup | None
    ) -> tuple[list[Admission], str | None]:
        if self.config.tp_size == 1 or group is None:
            return codes, None
        flag = int(self.mode is ShardMode.ROWS)
        vector = np.asarray([*codes, flag, 1 - flag], dtype=np.uint8)
        out = group.min_reduce(vector).tolist()
        if out[-2] == 0 and out[-1] == 0:
            why = "TOKENSPEED_EPD_EMBEDDING_SHARD differs across the prefill replica; set it alike"
            log.error(why)
            return [Admission.FAILED] * len(codes), why
        return [Admission(v) for v in out[:-2]], None

    def _admit(self, request: RRequest) -> LandedRequest:
        del self._pending[request.rid]
        self._admitted[request.rid] = request
        self._counts["admitted"] += 1
        items = []
        for item in request.items:
            extent = item.extent
            assert extent is not None, "an admitted item has its extent"
            items.append(self._landed(item.spec.room, item.row_start, item.spec.n_tokens, extent))
            self._counts["bytes"] += extent.nbytes
        return LandedRequest(request.rid, tuple(items))

    def _landed(self, room: Room, row_start: int, span: int, extent: Extent) -> LandedItem:
        c = self.config
        n_rows = extent.nbytes // (c.row_bytes + c.deepstack_row_bytes)
        main = self._pool.view(extent, 0, n_rows * c.row_bytes).view(c.dtype).view(n_rows, c.hidden)
        deep = None
        if c.deepstack_levels:
            raw = self._pool.view(extent, n_rows * c.row_bytes, n_rows * c.deepstack_row_bytes)
            deep = raw.view(c.dtype).view(n_rows, c.hidden * c.deepstack_levels)
        return LandedItem(room, span, row_start, main, deep, self.mode)

    def _fail(self, request: RRequest, now: float, reason: str) -> FailedRequest:
        del self._pending[request.rid]
        self._counts["failed"] += 1
        self._counts["timed_out"] += reason.startswith("timed out")
        self._drop(request, now)
        if request.pd_room is not None and self._aborter is not None:
            try:
                self._aborter.abort_room(request.pd_room, f"EPD embeddings: {reason}")
            except Exception:
                log.exception(
                    "could not abort PD room %d of request %r", request.pd_room, request.rid
                )
        return FailedRequest(request.rid, reason, request.pd_room)

    def _drop(self, request: RRequest, now: float) -> None:
        """Give every extent of a request back: free if no write can come, else quarantine."""
        for item in request.items:
            room = item.spec.room
            self._rooms.pop(room, None)
            if item.handed:
                self._sink.forget(room)
            if item.extent is None:
                continue
            if item.handed and not item.settled:
                self._pool.quarantine(room, item.extent, now + self.config.quarantine_seconds)
            else:
                self._pool.free(item.extent)


def embedding_receiver(
    engine: MooncakeEngine, config: EmbeddingReceiverConfig, aborter: RoomAborter | None = None
) -> EmbeddingReceiver:
    """A receiver over an existing transfer engine (the prefill rank's own, borrowed).

    Each rank of a replica needs its own engine (the encode rank keeps one item info per
    (room, Mooncake session)); receivers of *different* models may share one.
    """
    return EmbeddingReceiver(config, engine, owns_engine=False, aborter=aborter)


def open_embedding_receiver(
    config: EmbeddingReceiverConfig, aborter: RoomAborter | None = None
) -> EmbeddingReceiver:
    """A receiver with a transfer engine of its own (closed by :meth:`shutdown`)."""
    quiet_mooncake_logs(debug=False)
    engine = MooncakeEngine(
        config.advertised_host(), config.protocol, config.ib_device, config.max_batch()
    )
    try:
        return EmbeddingReceiver(config, engine, owns_engine=True, aborter=aborter)
    except BaseException:
        engine.close()
        raise


def receiver_for_peer(peer: PrefillPeer, config: EmbeddingReceiverConfig) -> EmbeddingReceiver:
    """The EPD receiver of the prefill rank ``peer`` serves; a request whose embeddings fail has
    its P→D room aborted through ``peer.abort_room`` (the peer is the :class:`RoomAborter`).

    It takes the peer's host, Mooncake protocol, RDMA device and TP place. A PD peer's Mooncake
    engine lives in its transfer worker process, while the receive pool must be registered with
    the engine the encode rank writes through, in the process that reads the rows (the
    engine's). So the receiver opens an engine of its own here, as TokenSpeed's prefill does.
    (EPD builds on PD: PD knows nothing of EPD, so this lives here, not on the peer.)
    """
    placing = peer.config
    placed = dataclasses.replace(
        config,
        host=config.host or placing.advertised_host(),
        protocol=placing.protocol,
        ib_device=placing.ib_device,
        tp_size=placing.tp_size,
        tp_rank=placing.tp_rank,
    )
    return open_embedding_receiver(placed, aborter=peer)
