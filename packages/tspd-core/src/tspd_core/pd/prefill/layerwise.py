"""Layerwise streams in P's worker: armed chunks sent an interval of layers at a time (wire.md §7).

An :class:`~tspd_core.pd.wire.ipc.ArmChunk` arrives before its forward runs. The control thread
plans every interval of it at once (the job builder's targets, then one job per destination
per interval: :mod:`tspd_core.pd.prefill.jobs`), then walks the intervals in order::

    ArmChunk ─► plan all intervals ─► wait ─(pacer: counter passed begin+e−1)─► write the
                (room.pending += 1     ▲     interval's jobs to every destination ─┐
                 until the stream ends)└──────── all of them done ◄────────────────┘
    after the last interval: the stream ends; a final chunk's Success also waits for the
    BootstrapToken (the first token, sent after the forward), then goes out as usual.

When the network is behind the forward, the intervals the counter already passed by the time
the previous one is written go out together, one write per destination (their waits would
pass at once anyway). A room that fails stops at once where it waits (its streams end, so it
turns quiet: :meth:`LayerwiseStreams.end_waiting` is one of the rooms' failure hooks), or after
the interval being written (Mooncake writes stop between batches once ``room.cancel`` is set).
The pacer thread only posts: every room record is still touched by the control thread alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError, PdError, TransferError
from tspd_core.pd.layerwise.schedule import LayerwiseSpec, ProducerSchedule, interval_target
from tspd_core.pd.layerwise.step_counter import CounterReader, Pacer, ready
from tspd_core.pd.prefill.jobs import JobBuilder
from tspd_core.pd.prefill.rooms import PrefillRooms
from tspd_core.pd.prefill.state import PRoom
from tspd_core.pd.status import FailureCause, TransferPoll
from tspd_core.pd.transfer.pool import I64, WriteJob
from tspd_core.pd.wire import ipc
from tspd_core.pd.worker.transfer_worker import TransferWorker


@dataclass(slots=True, eq=False)
class Interval:
    """One interval of one armed chunk: the counter value to pass, and its write jobs."""

    target: int
    steps: tuple[int, int]
    jobs: list[WriteJob]


@dataclass(slots=True, eq=False)
class Stream:
    """One armed chunk on its way out (control thread only)."""

    room: Room
    intervals: list[Interval] = field(default_factory=list)
    next: int = 0  #: the interval to wait for next
    outstanding: int = 0  #: jobs of the interval being written
    writing: bool = False  #: an interval's jobs run (a failure waits for them)
    done: bool = False


class LayerwiseStreams:
    """The armed chunks of P's rooms, each walking its intervals (control thread only).

    Without a :class:`LayerwiseSpec` (streaming off) it only refuses armed chunks; its counter
    families are registered either way, so every P worker exposes the same metrics.
    """

    def __init__(
        self,
        worker: TransferWorker,
        spec: LayerwiseSpec | None,
        rooms: PrefillRooms,
        jobs: JobBuilder,
    ) -> None:
        self.worker = worker
        self.spec = spec
        self.rooms = rooms
        self.jobs = jobs
        self.streams: dict[Room, list[Stream]] = {}
        self.pacer: Pacer | None = None
        self.counter: CounterReader
        self.schedule: ProducerSchedule | None = None
        r = worker.metrics.registry
        self._m_chunks = r.counter("layerwise_chunks_total", "Chunks armed for layerwise sends")
        self._m_intervals = r.counter(
            "layerwise_intervals_total", "Intervals whose writes started (counter passed)"
        )
        self._m_writes = r.counter(
            "layerwise_writes_total", "Interval writes (intervals already passed go together)"
        )
        if spec is not None:
            self.schedule = ProducerSchedule.for_contract(jobs.contract, spec.draft_layers)
            self.counter = CounterReader(spec.counter)
            self.pacer = Pacer(self.counter)
            worker.metrics.watch(
                "gauge",
                "layerwise_waiting_chunks",
                "Armed chunks waiting for the step counter",
                lambda: {(): float(self.pacer.waiting() if self.pacer else 0)},
            )

    def close(self) -> None:
        if self.pacer is not None:
            self.pacer.close()

    # ---- commands -----------------------------------------------------------------------

    def arm(self, chunk: ipc.ArmChunk) -> None:
        """A chunk armed before its forward: plan its intervals, then wait for the first."""
        if self.pacer is None:
            room = self.rooms.rooms.get(chunk.room)
            why = "a chunk was armed but this P worker does not stream layerwise"
            if room is not None:
                self.rooms.fail(room, why, FailureCause.BAD_FRAME)
            raise FrameError(f"room {chunk.room}: {why}")
        room = self.rooms.admit(chunk)
        if room is None:
            return
        stream = Stream(room.room)
        try:
            stream.intervals = self._plan_intervals(room, chunk, stream)
        except (PdError, ValueError) as exc:
            why = f"cannot plan chunk [{chunk.start}, {chunk.end}): {exc}"
            self.rooms.fail(room, why, FailureCause.BAD_FRAME)
            return
        if not stream.intervals and not chunk.final:
            return  # wire.md §7: a non-final chunk selecting nothing is skipped
        room.chunks += 1
        self.worker.metrics.registry.inc(self._m_chunks)
        if chunk.final:
            room.final = chunk  # its BootstrapToken makes it a SubmitChunk
        self.streams.setdefault(room.room, []).append(stream)
        room.pending += 1  # the stream itself: the room can neither succeed nor go quiet
        self._stream_next(room, stream)

    def _plan_intervals(self, room: PRoom, chunk: ipc.ArmChunk, stream: Stream) -> list[Interval]:
        """Every interval's jobs, planned before the first is armed (empty ones dropped)."""
        assert self.schedule is not None
        assert self.spec is not None
        targets = self.jobs.targets(room, chunk)

        def done(job: WriteJob, error: TransferError | None) -> None:  # transfer thread
            self.worker.post(lambda: self._on_stream_job(stream, job, error))

        out = []
        for b, e in self.schedule.intervals(self.spec.interval):
            layers = self.schedule.layers(b, e)
            planned = (self.jobs.job(room, t, done, layers) for t in targets)
            jobs = [job for job in planned if job is not None]
            if jobs:
                out.append(Interval(interval_target(chunk.begin, e), (b, e), jobs))
        return out

    # ---- the walk over intervals (control thread) ---------------------------------------

    def _stream_next(self, room: PRoom, s: Stream) -> None:
        s.writing = False
        if room.status is TransferPoll.FAILED or s.next == len(s.intervals):
            self._stream_end(room, s)
            return
        assert self.pacer is not None
        target = s.intervals[s.next].target
        if ready(self.counter.value(), target):
            self._fire(s)  # the network is behind the forward: no need for the pacer
            return
        self.pacer.wait(s, target, lambda: self.worker.post(lambda: self._fire(s)))

    def _fire(self, s: Stream, value: int | None = None) -> None:
        """The counter passed the next interval's target: write it to every destination,
        together with every later interval the counter passed too (the next waits would
        pass at once; one write per destination costs less than one per interval). A command the
        engine sent before the counter passed is handled first: an abort stops the intervals
        its later layers would have sent."""
        room = self.rooms.rooms.get(s.room)
        if s.done or room is None:
            return  # the room failed (and this stream ended) after the pacer fired
        if room.status is TransferPoll.FAILED:
            self._stream_end(room, s)
            return
        if value is None:
            value = self.counter.value()
            if self.worker.commands_pending():
                # The engine may have sent something before it moved the counter to ``value``
                # (an abort between two layers): the loop's next turn reads it, then fires.
                self.worker.post(lambda: self._fire(s, value))
                return
        batch = [s.intervals[s.next]]
        s.next += 1
        while s.next < len(s.intervals) and ready(value, s.intervals[s.next].target):
            batch.append(s.intervals[s.next])
            s.next += 1
        jobs = merge_jobs([job for interval in batch for job in interval.jobs])
        s.writing, s.outstanding = True, len(jobs)
        registry = self.worker.metrics.registry
        registry.inc(self._m_intervals, len(batch))
        registry.inc(self._m_writes)
        self.rooms.queue(room, jobs)

    def _on_stream_job(self, s: Stream, job: WriteJob, error: TransferError | None) -> None:
        self.rooms.on_job_done(job, error)
        s.outstanding -= 1
        room = self.rooms.rooms.get(s.room)
        if s.outstanding == 0 and room is not None:
            self._stream_next(room, s)

    def _stream_end(self, room: PRoom, s: Stream) -> None:
        if s.done:
            return
        s.done = True
        if self.pacer is not None:
            self.pacer.discard(s)
        streams = self.streams.get(room.room, [])
        if s in streams:
            streams.remove(s)
        if not streams:
            self.streams.pop(room.room, None)
        room.pending -= 1
        self.rooms.maybe_done(room)

    # ---- failure ------------------------------------------------------------------------

    def end_waiting(self, room: PRoom) -> None:
        """The rooms' failure hook (it runs after the room turned Failed, so a stream that
        ends here cannot complete it as a Success): every stream of the room that waits for
        the counter ends now; one whose interval is being written ends when it drained."""
        for s in list(self.streams.get(room.room, ())):
            if not s.writing:
                self._stream_end(room, s)


def merge_jobs(jobs: list[WriteJob]) -> list[WriteJob]:
    """One direct job per destination session (descriptors concatenated in interval order);
    staged jobs stay as they are (each owns its staging round trip)."""
    direct: dict[str, list[WriteJob]] = {}
    out: list[WriteJob] = []
    for job in jobs:
        if job.staged is None:
            direct.setdefault(job.session, []).append(job)
        else:
            out.append(job)
    for same in direct.values():
        first = same[0]
        if len(same) == 1:
            out.append(first)
            continue
        src, dst, length = (np.concatenate(arrays) for arrays in _columns(same))
        out.append(dataclasses.replace(first, src=src, dst=dst, lengths=length))
    return out


def _columns(jobs: list[WriteJob]) -> tuple[list[I64], list[I64], list[I64]]:
    return [j.src for j in jobs], [j.dst for j in jobs], [j.lengths for j in jobs]
