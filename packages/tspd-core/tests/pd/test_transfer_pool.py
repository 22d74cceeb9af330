"""The transfer pool over real Mooncake TCP: which thread runs a job, and exact bytes either way."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tspd_core.ids import Room
from tspd_core.pd.errors import TransferError
from tspd_core.pd.prefill.state import PRoom
from tspd_core.pd.status import TransferPoll, alone
from tspd_core.pd.transfer import pool as transfer
from tspd_core.pd.transfer import write_stream
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs
from tspd_core.pd.transfer.pool import TransferPool, WriteJob
from tspd_core.pd.transfer.staging import StagedJob, StagedWrite, Stager, StagingLink
from tspd_core.pd.wire.frames import ScatterAck, ScatterRequest, StageOffer

quiet_mooncake_logs(debug=False)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[MooncakeEngine, MooncakeEngine, torch.Tensor, torch.Tensor]]:
    src, dst = MooncakeEngine("127.0.0.1"), MooncakeEngine("127.0.0.1")
    a = torch.randint(
        0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    b = torch.zeros(1 << 20, dtype=torch.uint8)
    src.register(a.data_ptr(), a.numel())
    dst.register(b.data_ptr(), b.numel())
    # The first write to a session opens Mooncake's connection (longer than the inline wait).
    one = np.ones(1, dtype=np.uint64)
    src.write(dst.session_id, one * np.uint64(a.data_ptr()), one * np.uint64(b.data_ptr()), one)
    yield src, dst, a, b
    src.close()
    dst.close()


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control thread waits for an inline job as long as it takes (no timing in tests)."""
    monkeypatch.setattr(transfer, "INLINE_WAIT_S", 60.0)


class Done:
    """Records which thread reported each job, and its error (and, given a shared ``order``
    list, appends ``label`` to it: the order in which jobs were reported)."""

    def __init__(self, order: list[str] | None = None, label: str = "") -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.event = threading.Event()
        self.order, self.label = order, label

    def __call__(self, job: WriteJob, error: TransferError | None) -> None:
        self.seen.append((threading.current_thread().name, None if error is None else str(error)))
        if self.order is not None:
            self.order.append(self.label)
        self.event.set()


def _job(engines: tuple, offset: int, length: int, count: int, done: Done) -> WriteJob:  # type: ignore[type-arg]
    _, dst, a, b = engines
    starts = np.arange(count, dtype=np.int64) * length + offset
    lengths = np.full(count, length, dtype=np.int64)
    return WriteJob(
        Room(1), dst.session_id, starts, starts, lengths, a.data_ptr(), b.data_ptr(), done
    )


class Regions:
    """This test's own bytes: the source holds words tagged with the test's identity, the
    destination holds the source's complement (every byte differs), and ``want`` is what the
    destination must hold: the complement, plus the source bytes of each job that landed."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, tag: int) -> None:
        words = torch.arange(src.numel() // 4, dtype=torch.int32) | (tag << 24)
        src.view(torch.int32).copy_(words)  # word i = (tag, i): only this test writes it
        dst.copy_(torch.bitwise_not(src))
        self.src, self.dst, self.want = src, dst, dst.clone()

    def untouched(self, offset: int, nbytes: int) -> None:
        """None of the source's ``nbytes`` at ``offset`` is in the destination yet."""
        end = offset + nbytes
        assert not bool((self.dst[offset:end] == self.src[offset:end]).any())

    def landed(self, offset: int, nbytes: int) -> None:
        """A job landed the source's ``nbytes`` at ``offset``."""
        self.want[offset : offset + nbytes] = self.src[offset : offset + nbytes]

    def expect(self, offset: int, nbytes: int) -> None:
        """A job will land ``nbytes`` at ``offset``: none of them is there yet."""
        self.untouched(offset, nbytes)
        self.landed(offset, nbytes)

    def exact(self) -> bool:
        """The whole destination holds exactly what the jobs so far wrote, nothing else."""
        return torch.equal(self.dst, self.want)


@pytest.fixture
def regions(
    engines: tuple,  # type: ignore[type-arg]
    request: pytest.FixtureRequest,
) -> Regions:
    _, _, a, b = engines
    return Regions(a, b, zlib.crc32(request.node.name.encode()) & 0x7F)


def test_a_small_job_on_an_idle_queue_runs_on_the_submitting_thread(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    patient: None,
) -> None:
    pool = TransferPool(engines[0], queues=2, threads=2, max_run=8192, inline_bytes=64 << 10)
    small, many, cut = Done(), Done(), Done()
    regions.expect(0, 4 * 4096)
    pool.submit(0, _job(engines, 0, 4096, 4, small))
    assert small.seen == [("MainThread", None)]  # reported before submit returned
    assert regions.exact()
    regions.expect(65536, 65 * 256)
    pool.submit(1, _job(engines, 65536, 256, 65, many))  # 16.25 KiB in 65 descriptors: too many
    assert many.event.wait(10)
    assert many.seen == [("tspd-transfer-1", None)]
    assert regions.exact()
    # 64 KiB in 2 runs, cut at max_run into 8 KiB descriptors: 8 on the wire, inline.
    regions.expect(131072, 2 * (32 << 10))
    pool.submit(0, _job(engines, 131072, 32 << 10, 2, cut))
    assert cut.seen == [("MainThread", None)]
    assert regions.exact()
    pool.close()
    assert pool.stats.jobs == 3
    assert pool.stats.bytes == 4 * 4096 + 65 * 256 + (64 << 10)
    assert (pool.stats.descriptors, pool.stats.wire_descriptors) == (4 + 65 + 2, 4 + 65 + 8)


def test_a_job_cut_past_64_descriptors_does_not_start_inline(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    patient: None,
) -> None:
    # Two 32 KiB runs (64 KiB, within inline_bytes) that max_run cuts into 128 descriptors of
    # 512 B: the transfer thread, so the control thread is never held by a long write.
    pool = TransferPool(engines[0], queues=1, threads=1, max_run=512, inline_bytes=64 << 10)
    _runs_on_its_queue(pool, engines, regions, 0, 32 << 10, 2)
    assert (pool.stats.inline_jobs, pool.stats.descriptors, pool.stats.wire_descriptors) == (
        0,
        2,
        128,
    )


def _runs_on_its_queue(
    pool: TransferPool,
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    offset: int,
    length: int,
    count: int,
    inline: bool = True,
) -> None:
    """Submit one job to queue 0 and check it ran on that queue's thread, bytes exact."""
    done = Done()
    regions.expect(offset, count * length)
    pool.submit(0, _job(engines, offset, length, count, done), inline)
    assert done.event.wait(10)
    assert done.seen == [("tspd-transfer-0", None)]
    assert regions.exact()
    pool.close()


def test_a_job_behind_a_busy_queue_keeps_its_place(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
) -> None:
    pool = TransferPool(engines[0], queues=1, threads=1, max_run=128 << 10, inline_bytes=64 << 10)
    order: list[str] = []
    first, second = Done(order, "first"), Done(order, "second")
    regions.expect(0, 3 * (256 << 10))
    regions.expect(800 << 10, 4096)
    first_job = _job(engines, 0, 256 << 10, 3, first)  # 768 KiB: not inline
    pool.submit(0, first_job)
    pool.submit(0, _job(engines, 800 << 10, 4096, 1, second))  # small, but the queue is busy
    assert first.event.wait(10)
    assert second.event.wait(10)
    assert first.seen == [("tspd-transfer-0", None)]
    assert second.seen == [("tspd-transfer-0", None)]
    assert order == ["first", "second"]
    pool.close()
    assert regions.exact()
    assert (pool.stats.jobs, pool.stats.failed_jobs) == (2, 0)
    assert pool.stats.bytes == 3 * (256 << 10) + 4096
    # The 256 KiB runs were cut at max_run: 6 + 1 descriptors on the wire for 4 planned.
    assert (pool.stats.descriptors, pool.stats.wire_descriptors) == (4, 7)


def test_an_inline_job_not_done_in_time_is_finished_by_its_queue(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A peer slower than the inline wait: the submitted descriptors are left in flight and the
    # queue's thread waits for them (settle() reporting "still in flight" stands in for it).
    monkeypatch.setattr(write_stream.WriteStream, "settle", lambda self, timeout_s: False)
    pool = TransferPool(engines[0], queues=1, threads=1, inline_bytes=64 << 10)
    done = Done()
    regions.expect(4 << 10, 8 * 4096)
    pool.submit(0, _job(engines, 4 << 10, 4096, 8, done))
    assert done.event.wait(10)
    assert done.seen == [("tspd-transfer-0", None)]
    assert regions.exact()
    pool.close()
    assert (pool.stats.jobs, pool.stats.failed_jobs) == (1, 0)


def test_an_inline_failure_is_reported_like_any_other(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    patient: None,
) -> None:
    pool = TransferPool(engines[0], queues=1, threads=1, inline_bytes=64 << 10)
    done = Done()
    job = _job(engines, (1 << 20) - 1024, 4096, 1, done)  # runs past D's registration
    pool.submit(0, job)
    assert len(done.seen) == 1
    thread, error = done.seen[0]
    assert thread == "MainThread"
    assert error is not None
    assert "failed (rc -1) on descriptors 0..0 of 1" in error
    pool.close()
    assert regions.exact()  # the refused descriptor wrote nothing
    assert (pool.stats.jobs, pool.stats.failed_jobs, pool.stats.bytes) == (1, 1, 0)


def _faulty_run(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    seed: int,
) -> tuple[list[str | None], list[int]]:
    """Eight 4-descriptor jobs of room 1 through a pool that fails each with p = 0.5: each
    job's report, and the jobs whose bytes all landed / the first half of whose bytes landed."""
    pool = TransferPool(
        engines[0], queues=1, threads=1, fault_probability=0.5, fault_seed=seed, fault_rank=3
    )
    dones = [Done() for _ in range(8)]
    regions.untouched(0, 8 * 4 * 4096)
    for k, done in enumerate(dones):
        pool.submit(0, _job(engines, k * 4 * 4096, 4096, 4, done))
    pool.close()
    errors = [done.seen[0][1] for done in dones]
    assert [len(done.seen) for done in dones] == [1] * 8
    for k, error in enumerate(errors):  # a failed job wrote exactly its first two descriptors
        regions.landed(k * 4 * 4096, (4 if error is None else 2) * 4096)
    assert regions.exact()
    return errors, [k for k, e in enumerate(errors) if e is not None]


def test_injected_write_faults_are_replayed_by_their_seed(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    request: pytest.FixtureRequest,
) -> None:
    seed = 20240607
    errors, failed = _faulty_run(engines, regions, seed)
    # The draws are a pure function of (seed, rank, room, job index): which jobs fail is known.
    want = [k for k in range(8) if transfer.fault_draw(seed, 3, Room(1), k) < 0.5]
    assert failed == want, f"seed {seed}"
    assert 0 < len(want) < 8, f"seed {seed}: pick a seed that fails some jobs, not all"
    for k in want:
        assert errors[k] == (
            f"room 1: injected write failure (fault_write_probability 0.5, seed {seed}, "
            f"rank 3, job {k} of the room)"
        )
    again = Regions(regions.src, regions.dst, zlib.crc32(request.node.name.encode()) & 0x7F)
    assert _faulty_run(engines, again, seed) == (errors, failed)  # the same seed: the same run


# ---- staged jobs: one piece through a slot of D's staging memory -----------------------------

#: The test's "D staging memory": 2 slots of 128 KiB in the upper half of the destination (the
#: scatter itself is D's; here each scatter request is recorded instead).
SLOT_BYTES, SLOTS_AT = 128 << 10, 512 << 10
#: A stager's gather buffers stay registered with the module's engine until it closes, so each
#: stager (which holds them) lives as long: a freed buffer's address reused by the next
#: stager's would overlap.
_STAGERS: list[Stager] = []


class Scatters:
    """Records each scatter request with the thread that sent it; acknowledges it at once
    when ``ack`` (an unordered grant waits for acknowledgements before its job is done)."""

    def __init__(self, ack: bool = False) -> None:
        self.requests: list[tuple[str, ScatterRequest]] = []
        self.ack = ack
        self.link: StagingLink | None = None

    def __call__(self, req: ScatterRequest) -> None:
        self.requests.append((threading.current_thread().name, req))
        if self.ack:
            assert self.link is not None
            self.link.complete(ScatterAck("d", req.grant, req.slot, req.seq, True))


def _staged(
    engines: tuple,  # type: ignore[type-arg]
    ordered: bool = True,
    inline_bytes: int = 64 << 10,
) -> tuple[TransferPool, Stager, StagingLink, Scatters]:
    src, dst, a, b = engines
    offer = StageOffer(dst.session_id, 0, b.data_ptr() + SLOTS_AT, SLOT_BYTES, 2, ordered)
    link = StagingLink(offer, timeout_s=30.0)
    scatters = Scatters(ack=not ordered)
    scatters.link = link
    stager = Stager(src, a, inline_bytes=inline_bytes)
    _STAGERS.append(stager)
    pool = TransferPool(src, queues=2, threads=2, stager=stager, inline_bytes=64 << 10)
    return pool, stager, link, scatters


def _staged_job(
    engines: tuple,  # type: ignore[type-arg]
    starts: list[int],
    length: int,
    scatters: Scatters,
    link: StagingLink,
    done: Done,
) -> WriteJob:
    _, dst, a, b = engines
    src = np.array(starts, dtype=np.int64)
    d_offsets = np.arange(len(starts), dtype=np.int64) * 2 * length  # where D would scatter
    lengths = np.full(len(starts), length, dtype=np.int64)
    staged = StagedJob(link, scatters)
    return WriteJob(
        Room(5), dst.session_id, src, d_offsets, lengths, a.data_ptr(), b.data_ptr(), done,
        staged=staged,
    )  # fmt: skip


def _expect_slot(regions: Regions, slot: int, starts: list[int], length: int) -> None:
    """The piece's source runs land back to back in ``slot``, in descriptor order."""
    at = SLOTS_AT + slot * SLOT_BYTES
    for k, start in enumerate(starts):
        regions.want[at + k * length : at + (k + 1) * length] = regions.src[start : start + length]


def test_a_small_staged_job_gathers_and_writes_its_slot_on_the_submitting_thread(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    patient: None,
) -> None:
    pool, stager, link, scatters = _staged(engines)
    starts = [40_000, 8_192, 300_000, 12_288] * 4  # 16 short runs, out of order, some twice
    done = Done()
    regions.untouched(SLOTS_AT, 2 * SLOT_BYTES)
    pool.submit(0, _staged_job(engines, starts, 1024, scatters, link, done))
    assert done.seen == [("MainThread", None)]  # reported before submit returned
    assert [(t, r.slot, r.room) for t, r in scatters.requests] == [("MainThread", 0, 5)]
    req = scatters.requests[0][1]
    assert req.dst.tolist() == [k * 2048 for k in range(16)]
    assert req.lengths.tolist() == [1024] * 16
    _expect_slot(regions, 0, starts, 1024)
    assert regions.exact()
    assert pool.stats.inline_jobs == pool.stats.staged_jobs == 1
    assert stager.stats["gathered_bytes"] == 16 * 1024
    assert stager.stats["staged_wire_descriptors"] == 1  # the gathered runs: one write
    # Slot 0 stays D's until its acknowledgement; the next inline job takes slot 1.
    done2 = Done()
    pool.submit(1, _staged_job(engines, starts[:4], 1024, scatters, link, done2))
    assert done2.seen == [("MainThread", None)]
    assert [r.slot for _, r in scatters.requests] == [0, 1]
    _expect_slot(regions, 1, starts[:4], 1024)
    assert regions.exact()
    pool.close()


def test_staged_jobs_that_cannot_start_inline_go_through_their_queue(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    patient: None,
) -> None:
    # Larger than the stager's inline limit (96 KiB > 64 KiB): the transfer thread.
    pool, _, link, scatters = _staged(engines)
    starts = [k * 4096 for k in range(24)]
    done = Done()
    pool.submit(0, _staged_job(engines, starts, 4096, scatters, link, done))
    assert done.event.wait(10)
    assert done.seen == [("tspd-transfer-0", None)]
    assert [t for t, _ in scatters.requests] == ["tspd-transfer-0"]
    _expect_slot(regions, 0, starts, 4096)
    assert regions.exact()
    pool.close()
    assert pool.stats.inline_jobs == 0
    # An unordered grant (Success would wait for D's acknowledgements): the transfer thread.
    pool, _, link, scatters = _staged(engines, ordered=False)
    done = Done()
    pool.submit(0, _staged_job(engines, starts[:8], 1024, scatters, link, done))
    assert done.event.wait(10)
    assert done.seen == [("tspd-transfer-0", None)]
    pool.close()
    assert pool.stats.inline_jobs == 0
    _expect_slot(regions, 0, starts[:8], 1024)
    assert regions.exact()


def test_an_inline_staged_job_not_done_in_time_is_finished_by_its_queue(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(write_stream.WriteStream, "settle", lambda self, timeout_s: False)
    pool, stager, link, scatters = _staged(engines)
    starts = [k * 8192 for k in range(16)]
    done = Done()
    pool.submit(0, _staged_job(engines, starts, 1024, scatters, link, done))
    assert done.event.wait(10)
    # Started on the control thread; its scatter was requested by the queue's thread once the
    # piece landed there.
    assert done.seen == [("tspd-transfer-0", None)]
    assert [(t, r.slot) for t, r in scatters.requests] == [("tspd-transfer-0", 0)]
    assert pool.stats.inline_jobs == 1
    _expect_slot(regions, 0, starts, 1024)
    assert regions.exact()
    pool.close()
    # The inline gather buffer was given back with the write: the next one may start.
    write = stager.start_one(
        6, link.offer.session_id, np.array([0]), np.array([0]), np.array([64]),
        StagedJob(link, scatters),
    )  # fmt: skip
    assert write is not None
    write.finish()


def test_one_inline_staged_write_at_a_time_each_in_a_free_slot(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
) -> None:
    _, stager, link, scatters = _staged(engines)
    job = StagedJob(link, scatters)
    sid = link.offer.session_id

    def start(offset: int, length: int) -> StagedWrite | None:
        one = np.array([offset], dtype=np.int64)
        return stager.start_one(7, sid, one, one, np.array([length], dtype=np.int64), job)

    first = start(0, 4096)
    assert first is not None
    assert start(8192, 4096) is None  # the inline buffer is the first one's until it drained
    first.finish()
    assert [r.slot for _, r in scatters.requests] == [0]
    # Slot 0 is D's until acknowledged: the next write takes slot 1; then none is free.
    second = start(8192, 4096)
    assert second is not None
    second.finish()
    assert [r.slot for _, r in scatters.requests] == [0, 1]
    assert start(16384, 64) is None
    link.complete(ScatterAck(sid, 0, 0, 1, True))
    again = start(0, 64)
    assert again is not None
    again.finish()
    assert [r.slot for _, r in scatters.requests] == [0, 1, 0]
    _expect_slot(regions, 0, [0], 4096)
    _expect_slot(regions, 1, [8192], 4096)
    assert regions.exact()


def test_an_inline_staged_job_with_a_bad_range_fails_alone(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    patient: None,
) -> None:
    pool, _, link, scatters = _staged(engines)
    bad, good = Done(), Done()
    starts = [k * 4096 for k in range(15)] + [(1 << 20) - 512]  # the last run leaves the arena
    pool.submit(0, _staged_job(engines, starts, 1024, scatters, link, bad))
    assert len(bad.seen) == 1
    thread, error = bad.seen[0]
    assert thread == "MainThread"
    assert error is not None
    assert "byte ranges reach outside the 1048576-byte arena" in error
    assert scatters.requests == []  # nothing for D to scatter
    # Its slot and the inline buffer came back: the next job starts inline and lands.
    pool.submit(0, _staged_job(engines, starts[:15], 1024, scatters, link, good))
    assert good.seen == [("MainThread", None)]
    (slot,) = [r.slot for _, r in scatters.requests]
    _expect_slot(regions, slot, starts[:15], 1024)
    assert regions.exact()
    pool.close()
    assert (pool.stats.inline_jobs, pool.stats.failed_jobs) == (1, 1)  # the bad one never wrote


def test_a_small_job_not_allowed_inline_goes_through_its_queue(
    engines: tuple,  # type: ignore[type-arg]
    regions: Regions,
    patient: None,
) -> None:
    # Small and its queue idle, but the caller has other rooms to serve (inline=False).
    pool = TransferPool(engines[0], queues=1, threads=1, inline_bytes=64 << 10)
    _runs_on_its_queue(pool, engines, regions, 8192, 1024, 4, inline=False)
    assert (pool.stats.jobs, pool.stats.inline_jobs) == (1, 0)


def test_a_room_is_alone_only_while_every_other_room_has_ended() -> None:
    rooms = {Room(n): PRoom(Room(n), 0.0) for n in (1, 2, 3)}
    me = rooms[Room(1)]
    assert not alone(rooms, me)  # two others still bootstrapping
    rooms[Room(2)].status = TransferPoll.SUCCESS
    assert not alone(rooms, me)
    rooms[Room(3)].status = TransferPoll.FAILED
    assert alone(rooms, me)  # the others ended (kept until their release)
    assert alone({Room(1): me}, me)
    assert not alone(rooms, rooms[Room(2)])  # room 1 is live
