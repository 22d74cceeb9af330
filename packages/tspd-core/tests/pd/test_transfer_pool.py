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
from tspd_core.pd.transfer import pool as transfer
from tspd_core.pd.transfer import write_stream
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs
from tspd_core.pd.transfer.pool import TransferPool, WriteJob

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
    pool = TransferPool(engines[0], queues=2, threads=2, inline_bytes=64 << 10)
    small, large = Done(), Done()
    regions.expect(0, 4 * 4096)
    pool.submit(0, _job(engines, 0, 4096, 4, small))
    assert small.seen == [("MainThread", None)]  # reported before submit returned
    assert regions.exact()
    regions.expect(65536, 17 * 4096)
    pool.submit(1, _job(engines, 65536, 4096, 17, large))  # 17 descriptors: too many
    assert large.event.wait(10)
    assert large.seen == [("tspd-transfer-1", None)]
    assert regions.exact()
    pool.close()
    assert pool.stats.jobs == 2
    assert pool.stats.bytes == 21 * 4096
    assert pool.stats.wire_descriptors == pool.stats.descriptors == 21


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
