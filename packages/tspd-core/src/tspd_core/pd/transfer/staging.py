"""Staged transfers between tspd peers: gather on P, one bulk write, scatter on D.

Mooncake over TCP pays ~0.1-0.3 ms per descriptor, so routes whose runs are small (a head slice
of a page when re-slicing P TP 2 -> D TP 1, one page of one field after churn) move at a
fraction of the link's speed. Two memcpys cost far less than that, so such jobs go through a
staging slot instead::

    P transfer thread                                  D worker
    ─────────────────                                  ────────
    acquire slot k of the grant (credit) ◄──────────── scattered(k, seq)   (frees slot k)
    gather the piece's short source runs -> P buffer
    write long runs from the arena, the buffer's      (stage_plan: no gather where P's
      stretches -> D slot k (2 MiB descriptors)         side is contiguous already)
    scatter(room, k, seq, D offsets, lengths) ───────► check room + ranges, scatter slot k
                                                       into the arena (scatter thread)
    ... next piece into slot k+1 meanwhile (double buffering)
    job done once every piece was acknowledged -> Success may follow

D grants each data-carrying P rank ``slots_per_rank`` slots when it registers (a stage offer);
a P rank without a grant, or a job whose runs are large, writes directly. When a grant arrives,
each transfer thread of the session's queue warms up (:meth:`Stager.warm`): it allocates and
registers its gather buffers and writes a few bytes into a free slot of the grant, which opens
Mooncake's connection to D. Without it the first room to a D paid both on its hand-over
(15-40 ms in the demo against 1-5 ms for the next rooms). Only tspd peers ever
see these messages (see :mod:`tspd_core.pd.wire.frames`). This module is P's side: the grant's
slots (:class:`StagingLink`) and the staged write (:class:`Stager`); D's staging memory and its
scatter thread are :mod:`tspd_core.pd.transfer.scatter`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError, TransferError
from tspd_core.pd.transfer.byterows import gather, split_runs
from tspd_core.pd.transfer.mooncake import MooncakeEngine
from tspd_core.pd.transfer.stage_plan import DIRECT_RUN_BYTES, PiecePlan, pieces, plan_piece
from tspd_core.pd.transfer.write_stream import WriteStream
from tspd_core.pd.wire.frames import ScatterAck, ScatterRequest, StageOffer

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: Largest descriptor of a staged bulk write (measured here: 2 MiB descriptors move fastest over
#: Mooncake's TCP lanes; one 2 MiB descriptor lands in ~1.5 ms, two of 1 MiB in ~2 ms).
BULK_CHUNK = 2 << 20
#: Bytes of a warm-up write (any length opens the connection; one cache line).
WARM_BYTES = 64
#: The gather buffer an inline staged job uses: buffer 0 of the control thread's own list
#: (buffers are per thread; the transfer threads' lists are theirs).
INLINE_BUFFER = 0


class StagingLink:
    """P's side of one D session's grant: free slots and outstanding acknowledgements.

    Thread-safe: transfer threads acquire slots and wait; the control thread completes acks.
    """

    def __init__(self, offer: StageOffer, timeout_s: float) -> None:
        self.offer = offer
        self.timeout_s = timeout_s
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(offer.slots):
            self._free.put(slot)
        self._lock = threading.Lock()
        self._seq = 0
        self._waiting: dict[int, tuple[int, threading.Event, list[bool]]] = {}

    def acquire(self) -> int:
        try:
            return self._free.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TransferError(
                f"no staging slot of {self.offer.session_id} freed in {self.timeout_s:g} s"
            ) from None

    def try_acquire(self) -> int | None:
        """A free slot, or None."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def release(self, slot: int) -> None:
        """Give back a slot no scatter was requested for (the write before it failed)."""
        self._free.put(slot)

    def expect(self, slot: int) -> tuple[int, threading.Event, list[bool]]:
        with self._lock:
            self._seq += 1
            entry = (slot, threading.Event(), [False])
            self._waiting[self._seq] = entry
            return self._seq, entry[1], entry[2]

    def complete(self, ack: ScatterAck) -> None:
        """An acknowledgement arrived (control thread): free the slot, wake the writer."""
        with self._lock:
            entry = self._waiting.pop(ack.seq, None)
        if entry is None or entry[0] != ack.slot:
            raise FrameError(f"unexpected scatter ack (slot {ack.slot}, seq {ack.seq})")
        slot, event, result = entry
        result[0] = ack.ok
        self._free.put(slot)
        event.set()


@dataclass(frozen=True, slots=True)
class StagedJob:
    """What a transfer thread needs to stage one job (offsets relative to the arena bases)."""

    link: StagingLink
    send_scatter: Callable[[ScatterRequest], None]  #: thread-safe push to the D rank


class Stager:
    """P-side: the staged write, and each transfer thread's registered gather buffers."""

    def __init__(
        self,
        engine: MooncakeEngine,
        arena: torch.Tensor,
        direct_min: int = DIRECT_RUN_BYTES,
        inline_bytes: int = 0,
    ) -> None:
        self._engine = engine
        self._arena = arena
        self._direct_min = direct_min  #: source runs this long skip the gather (0: none)
        self.inline_bytes = inline_bytes  #: largest job :meth:`start_one` takes (0: none)
        #: Held while an inline job's write is in flight (its gather buffer is in use).
        self._inline_lock = threading.Lock()
        self._local = threading.local()
        #: Every buffer made, on any thread: registered until the engine closes, so kept
        #: until then (a thread's exit must not free registered memory whose address a later
        #: buffer could then reuse: Mooncake refuses overlapping registrations).
        self._registered: list[torch.Tensor] = []
        self._lock = threading.Lock()
        #: Bytes staged straight from the arena / through the gather buffer, and the bulk
        #: descriptors written into D's slots (any thread).
        self.stats = {
            "staged_direct_bytes": 0,
            "gathered_bytes": 0,
            "staged_wire_descriptors": 0,
            "gather_buffers": 0,  #: allocated and registered (each thread's, once)
            "gather_buffers_by_jobs": 0,  #: of those, made by a job (its thread was cold)
            "warm_ups": 0,  #: warm-up writes into a fresh grant's slot
        }

    def warm(self, session: str, link: StagingLink) -> bool:
        """Get this thread ready for ``link``'s first job: its gather buffers for the grant,
        and a write of a few bytes into a free slot (Mooncake connects to D on a session's
        first write). The slot goes back unchanged in meaning: D scatters a slot only when
        asked, and the next piece overwrites it. False when every slot is in use (a job got
        there first, so the way is open already)."""
        slot = link.try_acquire()
        if slot is None:
            return False
        try:
            slot_bytes = link.offer.slot_bytes
            bufs = [self._buffer(i, slot_bytes) for i in range(link.offer.slots)]
            one = np.array([bufs[0].data_ptr()], dtype=np.uint64)
            remote = np.array([link.offer.base_ptr + slot * slot_bytes], dtype=np.uint64)
            self._engine.write(session, one, remote, np.array([WARM_BYTES], dtype=np.uint64))
        finally:
            link.release(slot)
        with self._lock:
            self.stats["warm_ups"] += 1
        return True

    def write(
        self,
        room: int,
        session: str,
        src: I64,
        dst: I64,
        lengths: I64,
        job: StagedJob,
        cancel: threading.Event | None = None,
    ) -> None:
        """Move the descriptors through the grant's slots; returns once D scattered them all.

        Pieces share one write stream, so piece k+1 goes out while piece k drains; piece k's
        scatter is requested as soon as its last byte landed.
        """
        slot_bytes = job.link.offer.slot_bytes
        src, dst, lengths = split_runs(src, dst, lengths, slot_bytes)
        w = StagedWrite(self, room, session, job, cancel)
        try:
            for k, (lo, hi) in enumerate(pieces(lengths, slot_bytes)):
                slot = _acquire(job.link, w.stream)
                w.push(k, slot, src[lo:hi], dst[lo:hi], lengths[lo:hi], slot_bytes)
        except BaseException:
            w.release()
            raise
        w.finish()

    def start_one(
        self,
        room: int,
        session: str,
        src: I64,
        dst: I64,
        lengths: I64,
        job: StagedJob,
        cancel: threading.Event | None = None,
    ) -> StagedWrite | None:
        """Start a one-piece staged write on the calling thread (the control thread: see
        :meth:`TransferPool.submit`) without blocking: None unless the job fits one slot of an
        ordered grant (Success needs no acknowledgement), a slot is free and this stager's
        inline gather buffer is not still in flight from an earlier inline job."""
        link, nbytes = job.link, int(lengths.sum())
        if not link.offer.ordered or nbytes > min(link.offer.slot_bytes, self.inline_bytes):
            return None
        if not self._inline_lock.acquire(blocking=False):
            return None
        slot = link.try_acquire()
        if slot is None:
            self._inline_lock.release()
            return None
        w = StagedWrite(self, room, session, job, cancel, self._inline_lock)
        try:
            w.push(0, slot, src, dst, lengths, self.inline_bytes, buf_index=INLINE_BUFFER)
        except BaseException:
            w.release()
            raise
        return w

    def warm_inline(self) -> None:
        """Allocate and register the calling thread's inline gather buffer now (the control
        thread, when a grant arrives), not on a room's first inline job."""
        if self.inline_bytes:
            self._buffer(INLINE_BUFFER, self.inline_bytes)

    def _descriptors(
        self, plan: PiecePlan, buf_index: int, remote: int, buf_bytes: int
    ) -> tuple[U64, U64, U64]:
        """Gather the piece's short runs; the piece's writes into the slot at ``remote``."""
        parts = [(self._arena.data_ptr(), plan.direct)]
        with self._lock:
            self.stats["staged_direct_bytes"] += int(plan.direct[2].sum())
            self.stats["gathered_bytes"] += plan.gathered_bytes
        if plan.gathered_bytes:
            buf = self._buffer(buf_index, buf_bytes, by_job=True)
            gather(self._arena, *plan.gather, buf)
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
            parts.append((buf.data_ptr(), plan.buffered))
        srcs, dsts, lens = [], [], []
        for base, (off, at, n) in parts:
            s, d, n = split_runs(off, at, n, BULK_CHUNK)
            srcs.append(s + base)
            dsts.append(d + remote)
            lens.append(n)
        with self._lock:
            self.stats["staged_wire_descriptors"] += sum(int(n.size) for n in lens)
        return (
            np.concatenate(srcs).astype(np.uint64),
            np.concatenate(dsts).astype(np.uint64),
            np.concatenate(lens).astype(np.uint64),
        )

    def _buffer(self, index: int, nbytes: int, by_job: bool = False) -> torch.Tensor:
        """This thread's gather buffer ``index``: piece k uses buffer k mod slots, free again
        by then (piece k - slots was acknowledged, so its write had landed)."""
        bufs: list[torch.Tensor | None] = getattr(self._local, "bufs", [])
        self._local.bufs = bufs
        bufs.extend([None] * (index + 1 - len(bufs)))
        buf = bufs[index]
        if buf is None or buf.numel() < nbytes:
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=self._arena.device)
            self._engine.register(buf.data_ptr(), nbytes)
            bufs[index] = buf  # registered until the engine closes
            with self._lock:
                self._registered.append(buf)
                self.stats["gather_buffers"] += 1
                self.stats["gather_buffers_by_jobs"] += by_job
        return buf


class StagedWrite:
    """One job's staged write in flight: its stream, the slot each piece holds until its
    scatter is requested, and the acknowledgements to wait for. One thread at a time (the
    writer, or the control thread that started it and then the transfer thread resuming it)."""

    def __init__(
        self,
        stager: Stager,
        room: int,
        session: str,
        job: StagedJob,
        cancel: threading.Event | None,
        inline: threading.Lock | None = None,
    ) -> None:
        self._stager, self._room, self._job = stager, room, job
        self.stream = stager._engine.stream(session, cancel)
        self._held: dict[int, int] = {}  # piece -> its slot, until its scatter is requested
        self._waits: list[tuple[threading.Event, list[bool]]] = []
        self._inline = inline  # the stager's inline lock, held until the stream drained

    def push(
        self,
        k: int,
        slot: int,
        src: I64,
        dst: I64,
        lengths: I64,
        buf_bytes: int,
        buf_index: int | None = None,
    ) -> None:
        """Write piece ``k`` (at most a slot) into ``slot``; its scatter is requested once its
        last byte landed. The piece's gather buffer is ``buf_index`` (default: piece k's)."""
        link = self._job.link
        self._held[k] = slot
        plan = plan_piece(src, lengths, self._stager._direct_min)
        remote = link.offer.base_ptr + slot * link.offer.slot_bytes
        index = k % link.offer.slots if buf_index is None else buf_index
        s, d, n = self._stager._descriptors(plan, index, remote, buf_bytes)

        def scattered() -> None:  # on the stream's thread, once the piece landed
            seq, event, ok = link.expect(slot)
            req = ScatterRequest(Room(self._room), link.offer.grant, slot, seq, dst, lengths)
            self._job.send_scatter(req)
            del self._held[k]  # D frees the slot now
            self._waits.append((event, ok))

        self.stream.push(s, d, n, scattered)

    def settle(self, timeout_s: float) -> bool:
        """Reap what lands within ``timeout_s`` (see :meth:`WriteStream.settle`): True once
        every piece landed and had its scatter requested."""
        try:
            done = self.stream.settle(timeout_s)
        except BaseException:
            self.release()
            raise
        if done:
            self._unlock()
            self._await_acks()
        return done

    def finish(self) -> None:
        """Wait until every piece landed and (unordered grants) was scattered."""
        try:
            self.stream.finish()
        finally:
            self.release()
        self._await_acks()

    def release(self) -> None:
        """Give back the slots of pieces never written or written without a scatter request
        (the stream failed or drained), and the inline buffer."""
        for slot in self._held.values():
            self._job.link.release(slot)
        self._held.clear()
        self._unlock()

    def _unlock(self) -> None:
        if self._inline is not None:
            self._inline.release()
            self._inline = None

    def _await_acks(self) -> None:
        if not self._job.link.offer.ordered:  # else D handles our Success after the scatters
            _await_acks(self._waits, self._job.link.timeout_s)


def _acquire(link: StagingLink, stream: WriteStream) -> int:
    """A free slot; while none is, finish the oldest write in flight (its piece's scatter
    then goes out, and D's acknowledgement frees a slot), else wait for an acknowledgement."""
    while (slot := link.try_acquire()) is None:
        if not stream.reap():
            return link.acquire()
    return slot


def _await_acks(waits: list[tuple[threading.Event, list[bool]]], timeout_s: float) -> None:
    for event, ok in waits:
        if not event.wait(timeout_s):
            raise TransferError(f"D did not scatter a staged piece in {timeout_s:g} s")
        if not ok[0]:
            raise TransferError("D refused to scatter a staged piece (see D's log)")
