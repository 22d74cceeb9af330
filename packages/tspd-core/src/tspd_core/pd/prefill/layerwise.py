"""The P worker's layerwise half: armed chunks sent an interval at a time (WIRE §7).

An :class:`~tspd_core.pd.wire.ipc.ArmChunk` arrives before its forward runs. The control thread
plans every interval of it at once (per destination: the chunk's positions, then one
``plan_copies(layers=...)`` per interval), then walks the intervals in order::

    ArmChunk ─► plan all intervals ─► wait ─(pacer: counter passed begin+e−1)─► write the
                (room.pending += 1     ▲     interval's jobs to every destination ─┐
                 until the stream ends)└──────── all of them done ◄────────────────┘
    after the last interval: the stream ends; a final chunk's Success also waits for the
    BootstrapToken (the first token, sent after the forward), then goes out as usual.

When the network is behind the forward, the intervals the counter already passed by the time
the previous one is written go out together, one write per destination (their waits would
pass at once anyway). A room that fails stops at once where it waits (its streams end, so it
turns quiet), or after the interval being written (Mooncake writes stop between batches once
``room.cancel`` is set). The pacer thread only posts: every room record is still touched by the
control thread alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import torch

from tspd_core.ids import Room
from tspd_core.layout import parse_contract
from tspd_core.pd.errors import FrameError, PdError, TransferError
from tspd_core.pd.layerwise.schedule import LayerwiseSpec, ProducerSchedule, interval_target
from tspd_core.pd.layerwise.step_counter import CounterReader, Pacer, ready
from tspd_core.pd.prefill.rooms import PrefillRooms
from tspd_core.pd.prefill.state import PRoom
from tspd_core.pd.status import FailureCause, TransferPoll
from tspd_core.pd.transfer.pool import I64, WriteJob
from tspd_core.pd.wire import ipc
from tspd_core.pd.worker.transfer_worker import WorkerSpec


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


class LayerwiseRooms(PrefillRooms):
    """Layerwise streaming on top of :class:`PrefillRooms` (inactive without a spec)."""

    def __init__(self, spec: WorkerSpec, arena: torch.Tensor, notes: Connection) -> None:
        super().__init__(spec, arena, notes)
        self.streams: dict[Room, list[Stream]] = {}
        self.layerwise: LayerwiseSpec | None = spec.layerwise
        self.pacer: Pacer | None = None
        self.counter: CounterReader
        self.schedule: ProducerSchedule | None = None
        r = self.metrics.registry
        self._m_chunks = r.counter("layerwise_chunks_total", "Chunks armed for layerwise sends")
        self._m_intervals = r.counter(
            "layerwise_intervals_total", "Intervals whose writes started (counter passed)"
        )
        self._m_writes = r.counter(
            "layerwise_writes_total", "Interval writes (intervals already passed go together)"
        )
        if self.layerwise is not None:
            contract = parse_contract(spec.contract.encode())
            self.schedule = ProducerSchedule.for_contract(contract, self.layerwise.draft_layers)
            self.counter = CounterReader(self.layerwise.counter)
            self.pacer = Pacer(self.counter)
            self.metrics.watch(
                "gauge",
                "layerwise_waiting_chunks",
                "Armed chunks waiting for the step counter",
                lambda: {(): float(self.pacer.waiting() if self.pacer else 0)},
            )

    def close(self) -> None:
        if self.pacer is not None:
            self.pacer.close()
        super().close()

    # ---- commands -----------------------------------------------------------------------

    def _on_arm(self, chunk: ipc.ArmChunk) -> None:
        if self.pacer is None:
            room = self.rooms.get(chunk.room)
            why = "a chunk was armed but this P worker does not stream layerwise"
            if room is not None:
                self._fail(room, why, FailureCause.BAD_FRAME)
            raise FrameError(f"room {chunk.room}: {why}")
        room = self._admit(chunk)
        if room is None:
            return
        stream = Stream(room.room)
        try:
            stream.intervals = self._plan_intervals(room, chunk, stream)
        except (PdError, ValueError) as exc:
            why = f"cannot plan chunk [{chunk.start}, {chunk.end}): {exc}"
            self._fail(room, why, FailureCause.BAD_FRAME)
            return
        if not stream.intervals and not chunk.final:
            return  # WIRE §7: a non-final chunk selecting nothing is skipped
        room.chunks += 1
        self.metrics.registry.inc(self._m_chunks)
        if chunk.final:
            c = chunk
            room.final = ipc.SubmitChunk(c.room, c.start, c.end, True, c.block_ids)
            room.awaiting_token = True
        self.streams.setdefault(room.room, []).append(stream)
        room.pending += 1  # the stream itself: the room can neither succeed nor go quiet
        self._stream_next(room, stream)

    def _on_token(self, msg: ipc.BootstrapToken) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.status is TransferPoll.FAILED:
            return  # released or failed meanwhile
        f = room.final
        if f is None or not room.awaiting_token:
            why = "a first token came for a room whose final chunk was not armed"
            if f is None:
                self._fail(room, why, FailureCause.BAD_FRAME)
            raise FrameError(f"room {msg.room}: {why}")
        room.final = ipc.SubmitChunk(
            f.room,
            f.start,
            f.end,
            True,
            f.block_ids,
            msg.token,
            msg.spec_ids,
            msg.cached_tokens,
            msg.logprob,
        )
        room.awaiting_token = False
        self._maybe_done(room)

    # ---- planning -----------------------------------------------------------------------

    def _plan_intervals(self, room: PRoom, chunk: ipc.ArmChunk, stream: Stream) -> list[Interval]:
        """Every interval's jobs, planned before the first is armed (empty ones dropped)."""
        assert self.schedule is not None
        assert self.layerwise is not None
        targets = self.jobs.targets(room, chunk)

        def done(job: WriteJob, error: TransferError | None) -> None:  # transfer thread
            self.post(lambda: self._on_stream_job(stream, job, error))

        out = []
        for b, e in self.schedule.intervals(self.layerwise.interval):
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
        self.pacer.wait(s, target, lambda: self.post(lambda: self._fire(s)))

    def _fire(self, s: Stream) -> None:
        """The counter passed the next interval's target: write it to every destination,
        together with every later interval the counter passed too (the next waits would
        pass at once; one write per destination costs less than one per interval)."""
        room = self.rooms.get(s.room)
        if s.done or room is None:
            return  # the room failed (and this stream ended) after the pacer fired
        if room.status is TransferPoll.FAILED:
            self._stream_end(room, s)
            return
        value = self.counter.value()
        batch = [s.intervals[s.next]]
        s.next += 1
        while s.next < len(s.intervals) and ready(value, s.intervals[s.next].target):
            batch.append(s.intervals[s.next])
            s.next += 1
        jobs = merge_jobs([job for interval in batch for job in interval.jobs])
        s.writing, s.outstanding = True, len(jobs)
        self.metrics.registry.inc(self._m_intervals, len(batch))
        self.metrics.registry.inc(self._m_writes)
        self._queue(room, jobs)

    def _on_stream_job(self, s: Stream, job: WriteJob, error: TransferError | None) -> None:
        self._on_job_done(job, error)
        s.outstanding -= 1
        room = self.rooms.get(s.room)
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
        self._maybe_done(room)

    # ---- failure ------------------------------------------------------------------------

    def _fail(self, room: PRoom, reason: str, cause: str) -> None:
        # Failed first, so ending a waiting stream cannot complete the room as a Success.
        super()._fail(room, reason, cause)
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
