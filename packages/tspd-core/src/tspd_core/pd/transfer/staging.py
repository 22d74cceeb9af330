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

import functools
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
        self, engine: MooncakeEngine, arena: torch.Tensor, direct_min: int = DIRECT_RUN_BYTES
    ) -> None:
        self._engine = engine
        self._arena = arena
        self._direct_min = direct_min  #: source runs this long skip the gather (0: none)
        self._local = threading.local()
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
        link, slot_bytes = job.link, job.link.offer.slot_bytes
        src, dst, lengths = split_runs(src, dst, lengths, slot_bytes)
        stream = self._engine.stream(session, cancel)
        held: dict[int, int] = {}  # piece -> its slot, until the piece's scatter is requested
        waits: list[tuple[threading.Event, list[bool]]] = []

        def scattered(k: int, lo: int, hi: int) -> None:  # on this thread, from the stream
            slot = held[k]
            seq, event, ok = link.expect(slot)
            grant = link.offer.grant
            job.send_scatter(
                ScatterRequest(Room(room), grant, slot, seq, dst[lo:hi], lengths[lo:hi])
            )
            del held[k]  # D frees the slot now
            waits.append((event, ok))

        try:
            for k, (lo, hi) in enumerate(pieces(lengths, slot_bytes)):
                held[k] = slot = _acquire(link, stream)
                plan = plan_piece(src[lo:hi], lengths[lo:hi], self._direct_min)
                remote = link.offer.base_ptr + slot * slot_bytes
                s, d, n = self._descriptors(plan, k % link.offer.slots, remote, slot_bytes)
                stream.push(s, d, n, functools.partial(scattered, k, lo, hi))
            stream.finish()
        finally:
            for slot in held.values():  # never written, or the stream drained: reusable
                link.release(slot)
        if not link.offer.ordered:  # else D handles our Success only after these scatters
            _await_acks(waits, link.timeout_s)

    def _descriptors(
        self, plan: PiecePlan, buf_index: int, remote: int, slot_bytes: int
    ) -> tuple[U64, U64, U64]:
        """Gather the piece's short runs; the piece's writes into the slot at ``remote``."""
        parts = [(self._arena.data_ptr(), plan.direct)]
        with self._lock:
            self.stats["staged_direct_bytes"] += int(plan.direct[2].sum())
            self.stats["gathered_bytes"] += plan.gathered_bytes
        if plan.gathered_bytes:
            buf = self._buffer(buf_index, slot_bytes, by_job=True)
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
                self.stats["gather_buffers"] += 1
                self.stats["gather_buffers_by_jobs"] += by_job
        return buf


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
