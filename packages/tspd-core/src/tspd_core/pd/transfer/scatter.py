"""D's side of staged transfers: the staging memory, its grants, and the scatter thread that
copies each staged piece from its slot into D's pages.

    P rank ── stage offer (grant: slots k..k+n) ◄──────── grant() at registration
    P rank ── writes a piece into slot k ───────────────► (Mooncake, into the staging memory)
    P rank ── scatter(room, k, seq, D offsets, lengths) ► submit(): checked, then scattered
                                                          on the scatter thread (FIFO) with
                                                          byterows.scatter ─► D's pages
                                                          (a small one finding that thread
                                                          idle: on the caller's, at once)
    P rank ◄─ scattered(k, seq, ok) ───────────────────── ack(req, endpoint, ok)

D's offers are *ordered*: a P rank's status frame is handled only after the scatters it
requested before it (:meth:`StagingArea.after_scatters`), so P may send Success as soon as its
pieces are in D's slots. P's side is :mod:`tspd_core.pd.transfer.staging`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from tspd_core.pd.transfer.byterows import scatter
from tspd_core.pd.transfer.mooncake import MooncakeEngine
from tspd_core.pd.wire.frames import ScatterRequest, StageOffer
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

#: ``ack(request, the granted P endpoint or None, ok)``, run on the scatter thread.
Ack = Callable[[ScatterRequest, "tuple[str, int] | None", bool], None]


class StagingArea:
    """D-side: the registered staging memory, its grants, and scatters into the arena.

    Grants are made by the control thread; scatters run on one dedicated thread (FIFO), each
    acknowledged through ``ack`` (which must be thread-safe). A scatter of at most
    ``inline_bytes`` submitted while that thread has nothing queued runs on the submitting
    thread instead (see :meth:`submit`). One thread submits (the control thread).
    """

    def __init__(
        self,
        engine: MooncakeEngine,
        arena: torch.Tensor,
        total: int,
        slots: int,
        inline_bytes: int = 0,
    ) -> None:
        self.slot_bytes = total // slots
        self.slots = slots
        self.inline_bytes = inline_bytes
        self.buffer = torch.zeros(self.slot_bytes * slots, dtype=torch.uint8, device=arena.device)
        engine.register(self.buffer.data_ptr(), self.buffer.numel())
        self._arena = arena
        self._next = 0
        self._stats = {
            "scatters": 0,
            "scattered_bytes": 0,
            "refused_scatters": 0,
            "inline_scatters": 0,
        }
        self._owners: dict[int, tuple[str, int]] = {}  # slot -> the P endpoint granted it
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._queued = 0  # scatters and barriers submitted and not yet run (under _lock)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="tspd-scatter", daemon=True)
        self._thread.start()

    def grant(self, session: str, endpoint: tuple[str, int], count: int) -> StageOffer | None:
        """Grant ``count`` slots to the P rank at ``endpoint`` (None when none are left); a
        P rank granted slots before gets the same ones offered again (no slot is lost when D
        forgot what it granted, e.g. after its heartbeat gave up on the P instance)."""
        owned = sorted(slot for slot, owner in self._owners.items() if owner == endpoint)
        if owned:
            base = self.buffer.data_ptr() + owned[0] * self.slot_bytes
            return StageOffer(session, owned[0], base, self.slot_bytes, len(owned), ordered=True)
        if self._next + count > self.slots:
            return None
        first, self._next = self._next, self._next + count
        for slot in range(first, first + count):
            self._owners[slot] = endpoint
        base = self.buffer.data_ptr() + first * self.slot_bytes
        return StageOffer(session, first, base, self.slot_bytes, count, ordered=True)

    def rebind(self, engine: MooncakeEngine) -> None:
        """Register the staging memory with a new engine (a wake under a fresh session) and
        forget every grant: P ranks get new ones when this rank registers again."""
        engine.register(self.buffer.data_ptr(), self.buffer.numel())
        self._next = 0
        self._owners.clear()

    def queue_length(self) -> int:
        """Scatters waiting for the scatter thread."""
        return self._jobs.qsize()

    def submit(
        self, req: ScatterRequest, ack: Ack, refuse: bool = False, inline: bool = True
    ) -> None:
        """Queue a scatter (or, with ``refuse``, only its failure acknowledgement, so the slot
        frees in order); ``ack(req, endpoint, ok)`` runs on the scatter thread afterwards.

        Inline (unless ``inline`` is False: the caller has other rooms to serve): a scatter
        of at most ``inline_bytes`` (a one-page room's piece, a short prompt's) that finds
        nothing queued runs here, on the caller's thread, and acks before
        returning. That saves two thread hand-offs (to the scatter thread, and back through
        :meth:`after_scatters` for the status frame that follows it), each a wake-up that waits
        for a core when the host is busy. Order is kept: nothing is queued, nothing runs on the
        thread, and the one submitting thread cannot queue more until this returns.
        """
        with self._lock:
            inline = inline and not self._queued and int(req.lengths.sum()) <= self.inline_bytes
        if inline:
            self._stats["inline_scatters"] += 1
            self._run(req, ack, refuse)
            return
        self._put(lambda: self._run(req, ack, refuse))

    def after_scatters(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` once every scatter submitted so far is done: False when none is
        pending (the caller goes on at once), else True and ``callback`` runs later on the
        scatter thread (it must only post). This is how D keeps the promise of its ordered
        offers: a P rank's status frame is handled after the scatters it requested before."""
        with self._lock:
            if not self._queued:
                return False
        self._put(callback)
        return True

    def _put(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._queued += 1
        self._jobs.put(job)

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
        name_this_thread()
        while (job := self._jobs.get()) is not None:
            try:
                job()
            finally:
                with self._lock:
                    self._queued -= 1
