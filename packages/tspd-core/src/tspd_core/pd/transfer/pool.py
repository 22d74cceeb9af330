"""P's transfer queues: Mooncake writes run here, off the control thread.

wire.md §8: ``QUEUE_SIZE`` FIFO queues (a room goes to queue ``sum of its sessions' RPC ports mod
queues``, so one destination's rooms keep their order) served by ``THREAD_POOL_SIZE`` threads
(thread ``i`` serves queue ``i mod queues``). A job is one room's descriptors to one
destination; different destinations and rooms in different queues move concurrently.

Ownership: the control thread submits jobs; a transfer thread runs each job's Mooncake write
and reports back through ``done`` (which must only *post* to the control thread, never touch
room state). A small direct job whose queue is idle starts on the control thread instead and
is handed to its queue's thread only if it has not landed within 2 ms (:meth:`submit`).
:meth:`TransferPool.close` waits for queued jobs to finish.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from tspd_core import trace
from tspd_core.ids import Room
from tspd_core.pd.errors import TransferError
from tspd_core.pd.transfer.byterows import split_runs
from tspd_core.pd.transfer.mooncake import MooncakeEngine
from tspd_core.pd.transfer.staging import StagedJob, StagedWrite, Stager, StagingLink
from tspd_core.pd.transfer.write_stream import WriteStream
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: A direct job this small may start on the control thread (see TransferPool.submit).
INLINE_DESCRIPTORS = 64
#: How long the control thread waits for an inline job before leaving it to its queue.
INLINE_WAIT_S = 2e-3
#: ``observer(nbytes, descriptors, staged, ok, seconds)`` after each job, on its thread.
Observer = Callable[[int, int, bool, bool, float], None]


@dataclass(frozen=True, slots=True, eq=False)
class WarmUp:
    """A transfer thread's warm-up for a D session's staging grant (:meth:`Stager.warm`)."""

    session: str
    link: StagingLink


@dataclass(frozen=True, slots=True, eq=False)
class WriteJob:
    """One room's writes to one destination session.

    Offsets are relative to the two arena bases (P's worker mapping, D's registered base).
    """

    room: Room
    session: str
    src: I64
    dst: I64
    lengths: I64
    src_base: int
    dst_base: int
    #: Called on the transfer thread with the error (None on success); must only post.
    done: Callable[[WriteJob, TransferError | None], None]
    #: Set by the control thread when the room failed: queued jobs are skipped, not written.
    cancel: threading.Event | None = None
    #: Go through D's staging slots (small runs) instead of writing directly.
    staged: StagedJob | None = None
    #: Set when the job started inline on the control thread and is still in flight: the
    #: transfer thread only waits for the rest (see :meth:`TransferPool.submit`).
    resume: WriteStream | StagedWrite | None = None
    #: Test-only fault injection: the draw that fails this job (see ``fault_probability``).
    fault: FaultDraw | None = None

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


@dataclass(frozen=True, slots=True)
class FaultDraw:
    """An injected failure drawn for one job: the ``index``-th job of ``room`` in a pool whose
    draws use ``seed`` (the same seed, rank and job order fail the same jobs again)."""

    seed: int
    index: int


def fault_draw(seed: int, rank: int, room: Room, index: int) -> float:
    """The uniform draw in [0, 1) that decides whether the ``index``-th job of ``room`` on P
    rank ``rank`` fails. A pure function of its arguments (a string seed is hashed with
    SHA-512, independent of ``PYTHONHASHSEED``), so a run is replayed by its seed whatever order
    the transfer threads take the jobs in; ranks draw independently."""
    return random.Random(f"tspd-fault:{seed}:{rank}:{room}:{index}").random()


@dataclass(slots=True)
class TransferStats:
    """Counters of one pool (read by metrics; updated under the pool's lock)."""

    jobs: int = 0
    failed_jobs: int = 0
    staged_jobs: int = 0
    bytes: int = 0
    descriptors: int = 0
    #: Descriptors handed to the engine by direct jobs (long runs cut); a staged job's are
    #: counted by the stager.
    wire_descriptors: int = 0
    #: Jobs started on the submitting (control) thread, direct or staged (:meth:`submit`).
    inline_jobs: int = 0
    busy_s: float = 0.0
    per_thread_busy_s: dict[str, float] = field(default_factory=dict)


class TransferPool:
    """``queues`` FIFO queues, ``threads`` transfer threads, one Mooncake engine."""

    def __init__(
        self,
        engine: MooncakeEngine,
        queues: int,
        threads: int,
        stager: Stager | None = None,
        max_run: int = 2 << 20,
        fault_probability: float = 0.0,
        observer: Observer | None = None,
        inline_bytes: int = 0,
        fault_seed: int = 0,
        fault_rank: int = 0,
    ) -> None:
        self._engine = engine
        self._max_run = max_run
        self._inline_bytes = inline_bytes
        self._busy = [0] * queues  # jobs queued or running per queue (ordering for inline)
        self._stager = stager
        self._observer = observer
        # Test-only fault injection (PdTunables.fault_write_probability, drawn from
        # fault_write_seed and this P rank): never on by default.
        self._fault_p = fault_probability
        self._fault_seed, self._fault_rank = fault_seed, fault_rank
        self._fault_jobs: dict[Room, int] = {}  # jobs submitted per room (control thread only)
        if fault_probability > 0:
            log.warning(
                "write fault injection is ON: p=%g per job, seed %d (TSPD_FAULT_WRITE_SEED), "
                "rank %d",
                fault_probability,
                fault_seed,
                fault_rank,
            )
        self._queues: list[queue.SimpleQueue[WriteJob | WarmUp | None]] = [
            queue.SimpleQueue() for _ in range(queues)
        ]
        self._lock = threading.Lock()
        self.stats = TransferStats()
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(self._queues[i % queues], i % queues),
                name=f"tspd-transfer-{i}",
                daemon=True,
            )
            for i in range(max(threads, queues))
        ]
        for t in self._threads:
            t.start()

    def queue_for(self, rpc_ports: int) -> int:
        """The queue of a room whose destination sessions' RPC ports sum to ``rpc_ports``."""
        return rpc_ports % len(self._queues)

    def submit(self, queue_index: int, job: WriteJob, inline: bool = True) -> None:
        """Queue ``job``; a small job whose queue is idle starts on the caller's thread (unless
        ``inline`` is False: the caller has other work waiting, e.g. other rooms' frames).

        Inline: the caller (the control thread) submits the descriptors and waits up to
        ``INLINE_WAIT_S`` for them, saving the two thread hand-offs (~0.2-0.4 ms here, several
        ms when the cores are busy) of a one-page request or a short prompt's staged piece;
        what has not landed by then is left to the queue's thread, so a slow or hung peer never
        holds the control thread longer. The queue is idle, so the job keeps its place in the
        queue's order. A direct job qualifies up to ``inline_bytes`` and 64 descriptors; a
        staged one up to the stager's ``inline_bytes`` in one slot of an ordered grant
        (:meth:`Stager.start_one`: the gather is a memcpy of at most that many bytes).
        """
        if self._fault_p > 0:
            job = self._draw_fault(job)
        if inline and self._may_inline(queue_index, job):
            t0 = time.perf_counter()
            try:
                started = self._start(job)
                if started is not None:
                    trace.mark_room(job.room, "pw.write", "inline")
                    with self._lock:
                        self.stats.inline_jobs += 1
                    if started.settle(INLINE_WAIT_S):
                        self._finish(job, None, t0)
                        return
                    job = replace(job, resume=started)
            except TransferError as exc:
                self._finish(job, exc, t0)
                return
            except Exception as exc:  # a bad range or a bug: fail the room, as a thread would
                log.exception("room %d: write to %s failed", job.room, job.session)
                self._finish(job, TransferError(f"write to {job.session} failed: {exc}"), t0)
                return
        with self._lock:
            self._busy[queue_index] += 1
        self._queues[queue_index].put(job)

    def _start(self, job: WriteJob) -> WriteStream | StagedWrite | None:
        """Submit an inline job's writes (None: a staged job that cannot start now)."""
        if job.staged is None:
            stream = self._engine.stream(job.session, job.cancel)
            stream.push(*self._direct(job))
            return stream
        assert self._stager is not None
        return self._stager.start_one(
            job.room, job.session, job.src, job.dst, job.lengths, job.staged, job.cancel
        )

    def warm(self, rpc_port: int, session: str, link: StagingLink) -> None:
        """Warm the threads that serve a room bound for ``session`` alone up for its grant
        ``link`` (each takes one item; where several threads serve the queue, one of them may
        take two and another none: a cold thread then pays on its first job, as without)."""
        if self._stager is None:
            return
        index = self.queue_for(rpc_port)
        serving = sum(1 for i in range(len(self._threads)) if i % len(self._queues) == index)
        for _ in range(serving):
            self._queues[index].put(WarmUp(session, link))

    def _draw_fault(self, job: WriteJob) -> WriteJob:
        """Decide now, in submission order, whether ``job`` fails (test-only injection)."""
        index = self._fault_jobs.get(job.room, 0)
        self._fault_jobs[job.room] = index + 1
        if fault_draw(self._fault_seed, self._fault_rank, job.room, index) < self._fault_p:
            return replace(job, fault=FaultDraw(self._fault_seed, index))
        return job

    def _may_inline(self, queue_index: int, job: WriteJob) -> bool:
        if (
            self._fault_p > 0
            or self._busy[queue_index]
            or (job.cancel is not None and job.cancel.is_set())
        ):
            return False
        if job.staged is None:
            if len(job.src) > INLINE_DESCRIPTORS or job.nbytes > self._inline_bytes:
                return False
            # Counted as they go on the wire: ``max_run`` may cut the runs.
            wire = int((-(-job.lengths // self._max_run)).sum()) if self._max_run else len(job.src)
            return wire <= INLINE_DESCRIPTORS
        return self._stager is not None and job.nbytes <= self._stager.inline_bytes

    def queue_lengths(self) -> list[int]:
        """Jobs waiting in each queue (approximate while threads take them)."""
        return [q.qsize() for q in self._queues]

    def close(self) -> None:
        """Let every queued job finish, then stop the threads."""
        for i in range(len(self._threads)):
            self._queues[i % len(self._queues)].put(None)
        for t in self._threads:
            t.join()

    def _execute(self, job: WriteJob) -> None:
        trace.mark_room(job.room, "pw.write", "queued")
        if job.resume is not None:
            job.resume.finish()
            return
        if job.fault is not None:
            self._inject_fault(job, job.fault)
        if job.staged is not None and self._stager is not None:
            self._stager.write(
                job.room, job.session, job.src, job.dst, job.lengths, job.staged, job.cancel
            )
            return
        self._engine.write(job.session, *self._direct(job), job.cancel)

    def _direct(self, job: WriteJob) -> tuple[U64, U64, U64]:
        """A direct job's absolute descriptors, long runs cut at ``max_run``."""
        rel_src, rel_dst, lengths = split_runs(job.src, job.dst, job.lengths, self._max_run)
        with self._lock:
            self.stats.wire_descriptors += int(lengths.size)
        src = (rel_src + job.src_base).astype(np.uint64)
        dst = (rel_dst + job.dst_base).astype(np.uint64)
        return src, dst, lengths.astype(np.uint64)

    def _inject_fault(self, job: WriteJob, draw: FaultDraw) -> None:
        """Fail like a link that breaks mid-job: the first half of the descriptors land."""
        half = len(job.src) // 2
        if half and job.staged is None:
            src = (job.src[:half] + job.src_base).astype(np.uint64)
            dst = (job.dst[:half] + job.dst_base).astype(np.uint64)
            self._engine.write(job.session, src, dst, job.lengths[:half].astype(np.uint64))
        raise TransferError(
            f"room {job.room}: injected write failure (fault_write_probability {self._fault_p:g}, "
            f"seed {draw.seed}, rank {self._fault_rank}, job {draw.index} of the room)"
        )

    def _warm(self, item: WarmUp) -> None:
        """Best effort: a warm-up that fails costs nothing but the warmth (the first job then
        meets the same error and fails its room as it would have)."""
        assert self._stager is not None
        try:
            self._stager.warm(item.session, item.link)
        except Exception as exc:
            log.info("warm-up of the staging grant from %s failed: %s", item.session, exc)

    def _serve(self, jobs: queue.SimpleQueue[WriteJob | WarmUp | None], index: int) -> None:
        name_this_thread()
        while (job := jobs.get()) is not None:
            if isinstance(job, WarmUp):
                self._warm(job)
                continue
            t0 = time.perf_counter()
            error: TransferError | None = None
            try:
                if job.resume is None and job.cancel is not None and job.cancel.is_set():
                    raise TransferError(f"room {job.room}: write cancelled (the room failed)")
                self._execute(job)
            except TransferError as exc:
                error = exc
            except Exception as exc:  # a broken peer or a bug: fail the room, keep the thread
                log.exception("room %d: write to %s failed", job.room, job.session)
                error = TransferError(f"write to {job.session} failed: {exc}")
            self._finish(job, error, t0)
            with self._lock:
                self._busy[index] -= 1

    def _finish(self, job: WriteJob, error: TransferError | None, t0: float) -> None:
        """Count the job and report it (on whichever thread ran it)."""
        trace.mark_room(job.room, "pw.written", "ok" if error is None else "failed")
        elapsed = time.perf_counter() - t0
        name = threading.current_thread().name
        with self._lock:
            s = self.stats
            s.jobs += 1
            s.failed_jobs += error is not None
            s.bytes += job.nbytes if error is None else 0
            s.descriptors += len(job.src)
            s.staged_jobs += job.staged is not None
            s.busy_s += elapsed
            s.per_thread_busy_s[name] = s.per_thread_busy_s.get(name, 0.0) + elapsed
        if self._observer is not None:
            ok = error is None
            self._observer(job.nbytes, len(job.src), job.staged is not None, ok, elapsed)
        try:
            job.done(job, error)
        except Exception:
            log.exception("transfer completion callback failed for room %d", job.room)
