"""Staged transfers between tspd peers: gather on P, one bulk write, scatter on D.

Mooncake over TCP pays ~0.1-0.3 ms per descriptor, so routes whose runs are small (a head slice
of a page when re-slicing P TP 2 -> D TP 1, one page of one field after churn) move at a
fraction of the link's speed. Two memcpys cost far less than that, so such jobs go through a
staging slot instead::

    P transfer thread                                  D worker
    ─────────────────                                  ────────
    acquire slot k of the grant (credit) ◄──────────── scattered(k, seq)   (frees slot k)
    gather the job's source runs -> P buffer
    write P buffer -> D slot k (1 MiB descriptors)
    scatter(room, k, seq, D offsets, lengths) ───────► check room + ranges, scatter slot k
                                                       into the arena (scatter thread)
    ... next piece into slot k+1 meanwhile (double buffering)
    job done once every piece was acknowledged -> Success may follow

D grants each data-carrying P rank ``slots_per_rank`` slots when it registers (a stage offer);
a P rank without a grant, or a job whose runs are large, writes directly. Only tspd peers ever
see these messages (see :mod:`tspd_core.pd.wire`).
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
from tspd_core.pd.byterows import gather, scatter, split_runs
from tspd_core.pd.engine import MooncakeEngine
from tspd_core.pd.errors import FrameError, TransferError
from tspd_core.pd.wire import ScatterAck, ScatterRequest, StageOffer

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
Ack = Callable[[ScatterRequest, "tuple[str, int] | None", bool], None]
#: Largest descriptor of a staged bulk write (measured here: 2 MiB descriptors move fastest over
#: Mooncake's TCP lanes; one 2 MiB descriptor lands in ~1.5 ms, two of 1 MiB in ~2 ms).
BULK_CHUNK = 2 << 20


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
    """P-side: one registered staging buffer per transfer thread, and the staged write."""

    def __init__(self, engine: MooncakeEngine, arena: torch.Tensor) -> None:
        self._engine = engine
        self._arena = arena
        self._local = threading.local()

    def write(
        self, room: int, session: str, src: I64, dst: I64, lengths: I64, job: StagedJob
    ) -> None:
        """Move the descriptors through the grant's slots; returns once D scattered them all."""
        link, slot_bytes = job.link, job.link.offer.slot_bytes
        src, dst, lengths = split_runs(src, dst, lengths, slot_bytes)
        waits = []
        for lo, hi in _pieces(lengths, slot_bytes):
            slot = link.acquire()
            try:
                buf = self._buffer(slot_bytes)
                n = gather(self._arena, src[lo:hi], lengths[lo:hi], buf)
                if buf.is_cuda:
                    torch.cuda.current_stream(buf.device).synchronize()
                self._bulk(session, buf, link.offer.base_ptr + slot * slot_bytes, n)
            except BaseException:
                link.release(slot)
                raise
            seq, event, ok = link.expect(slot)
            req = ScatterRequest(
                Room(room), link.offer.grant, slot, seq, dst[lo:hi], lengths[lo:hi]
            )
            job.send_scatter(req)
            waits.append((event, ok))
        for event, ok in waits:
            if not event.wait(link.timeout_s):
                raise TransferError(f"D did not scatter a staged piece in {link.timeout_s:g} s")
            if not ok[0]:
                raise TransferError("D refused to scatter a staged piece (see D's log)")

    def _bulk(self, session: str, buf: torch.Tensor, remote: int, nbytes: int) -> None:
        starts = np.arange(0, nbytes, BULK_CHUNK, dtype=np.uint64)
        lengths = np.minimum(np.uint64(nbytes) - starts, np.uint64(BULK_CHUNK))
        self._engine.write(
            session, starts + np.uint64(buf.data_ptr()), starts + np.uint64(remote), lengths
        )

    def _buffer(self, nbytes: int) -> torch.Tensor:
        buf: torch.Tensor | None = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=self._arena.device)
            self._engine.register(buf.data_ptr(), nbytes)
            self._local.buf = buf  # registered until the engine closes
        return buf


def _pieces(lengths: I64, limit: int) -> list[tuple[int, int]]:
    """Consecutive descriptor ranges of at most ``limit`` bytes each (every length <= limit)."""
    end = np.cumsum(lengths)
    out, lo = [], 0
    while lo < lengths.size:
        before = int(end[lo] - lengths[lo])
        hi = int(np.searchsorted(end, before + limit, side="right"))
        out.append((lo, hi))
        lo = hi
    return out


class StagingArea:
    """D-side: the registered staging memory, its grants, and scatters into the arena.

    Grants are made by the control thread; scatters run on one dedicated thread (FIFO), each
    acknowledged through ``ack`` (which must be thread-safe).
    """

    def __init__(self, engine: MooncakeEngine, arena: torch.Tensor, total: int, slots: int) -> None:
        self.slot_bytes = total // slots
        self.slots = slots
        self.buffer = torch.zeros(self.slot_bytes * slots, dtype=torch.uint8, device=arena.device)
        engine.register(self.buffer.data_ptr(), self.buffer.numel())
        self._arena = arena
        self._next = 0
        self._stats = {"scatters": 0, "scattered_bytes": 0, "refused_scatters": 0}
        self._owners: dict[int, tuple[str, int]] = {}  # slot -> the P endpoint granted it
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="tspd-scatter", daemon=True)
        self._thread.start()

    def grant(self, session: str, endpoint: tuple[str, int], count: int) -> StageOffer | None:
        """Grant ``count`` slots to the P rank at ``endpoint`` (None when none are left)."""
        if self._next + count > self.slots:
            return None
        first, self._next = self._next, self._next + count
        for slot in range(first, first + count):
            self._owners[slot] = endpoint
        base = self.buffer.data_ptr() + first * self.slot_bytes
        return StageOffer(session, first, base, self.slot_bytes, count)

    def rebind(self, engine: MooncakeEngine) -> None:
        """Register the staging memory with a new engine (a wake under a fresh session) and
        forget every grant: P ranks get new ones when this rank registers again."""
        engine.register(self.buffer.data_ptr(), self.buffer.numel())
        self._next = 0
        self._owners.clear()

    def queue_length(self) -> int:
        """Scatters waiting for the scatter thread."""
        return self._jobs.qsize()

    def submit(self, req: ScatterRequest, ack: Ack, refuse: bool = False) -> None:
        """Queue a scatter (or, with ``refuse``, only its failure acknowledgement, so the slot
        frees in order); ``ack(req, endpoint, ok)`` runs on the scatter thread afterwards."""
        self._jobs.put(lambda: self._run(req, ack, refuse))

    def counters(self) -> dict[str, float]:
        """Scatters done, bytes scattered, scatters refused (read from any thread)."""
        return {**self._stats, "granted_slots": self._next}

    def close(self) -> None:
        """Finish queued scatters and stop the thread (the engine unregisters the memory)."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self, req: ScatterRequest, ack: Ack, refuse: bool) -> None:
        try:
            ok = not refuse and self._scatter(req)
            if ok and self._arena.is_cuda:
                torch.cuda.current_stream(self._arena.device).synchronize()
        except Exception:
            log.exception("scatter for room %d failed", req.room)
            ok = False
        key = "scatters" if ok else "refused_scatters"
        self._stats[key] += 1
        self._stats["scattered_bytes"] += int(req.lengths.sum()) if ok else 0
        ack(req, self._owners.get(req.grant + req.slot), ok)

    def _scatter(self, req: ScatterRequest) -> bool:
        slot = req.grant + req.slot
        total = int(req.lengths.sum())
        end = int((req.dst + req.lengths).max())
        if slot not in self._owners or total > self.slot_bytes or end > self._arena.numel():
            log.warning(
                "refused scatter for room %d: slot %d, %d bytes, end %d (arena %d bytes)",
                req.room,
                slot,
                total,
                end,
                self._arena.numel(),
            )
            return False
        data = self.buffer[slot * self.slot_bytes : slot * self.slot_bytes + total]
        scatter(self._arena, req.dst, req.lengths, data)
        return True

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
