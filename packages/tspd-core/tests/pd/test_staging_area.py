"""D's staging area: ordered offers, and callbacks that wait for the scatters before them."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tspd_core.ids import Room
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs
from tspd_core.pd.transfer.scatter import StagingArea
from tspd_core.pd.wire.frames import ScatterRequest

quiet_mooncake_logs(debug=False)


@pytest.fixture
def area() -> Iterator[tuple[StagingArea, torch.Tensor]]:
    engine = MooncakeEngine("127.0.0.1")
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    staging = StagingArea(engine, arena, total=8 << 20, slots=8)
    yield staging, arena
    staging.close()
    engine.close()


def test_offers_promise_ordered_status_frames(area: tuple[StagingArea, torch.Tensor]) -> None:
    staging, _ = area
    offer = staging.grant("127.0.0.1:1", ("127.0.0.1", 5000), 2)
    assert offer is not None
    assert (offer.grant, offer.slots, offer.slot_bytes, offer.ordered) == (0, 2, 1 << 20, True)


def test_a_callback_runs_only_after_the_scatters_submitted_before_it(
    area: tuple[StagingArea, torch.Tensor],
) -> None:
    staging, arena = area
    assert staging.grant("127.0.0.1:1", ("127.0.0.1", 5000), 2) is not None
    assert not staging.after_scatters(lambda: None)  # nothing pending: go on at once
    staging.buffer[:4096] = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    gate, entered, log = threading.Event(), threading.Event(), []

    def ack(req: ScatterRequest, endpoint: object, ok: bool) -> None:
        log.append(("scattered", ok, endpoint))
        entered.set()
        gate.wait(10)  # hold the scatter thread: the callback must wait behind it

    dst = np.array([8192, 0], np.int64)
    staging.submit(ScatterRequest(Room(5), 0, 0, 1, dst, np.array([1024, 3072], np.int64)), ack)
    assert entered.wait(10)  # the scatter thread is held inside the acknowledgement
    ran = threading.Event()

    def callback() -> None:  # records whether the held scatter had been let go when it ran
        log.append(("callback", bool(arena[8192 + 5] == 5), gate.is_set()))
        ran.set()

    assert staging.after_scatters(callback)
    assert not ran.wait(0.2)
    gate.set()
    assert ran.wait(10)
    assert log == [("scattered", True, ("127.0.0.1", 5000)), ("callback", True, True)]
    assert torch.equal(arena[8192 : 8192 + 1024], staging.buffer[:1024])
    assert torch.equal(arena[:3072], staging.buffer[1024:4096])


def test_a_small_scatter_on_an_idle_thread_runs_inline_and_a_queued_one_keeps_its_place() -> None:
    """Within ``inline_bytes`` and with nothing queued, a scatter runs on the submitting
    thread and is acknowledged before ``submit`` returns (a status frame after it goes on at
    once); with a scatter queued before it, a small one waits its turn on the scatter thread."""
    engine = MooncakeEngine("127.0.0.1")
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    staging = StagingArea(engine, arena, total=8 << 20, slots=8, inline_bytes=4096)
    try:
        assert staging.grant("127.0.0.1:1", ("127.0.0.1", 5000), 2) is not None
        staging.buffer[: 1 << 20] = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        me, log = threading.get_ident(), []
        gate, entered = threading.Event(), threading.Event()

        def ack(req: ScatterRequest, endpoint: object, ok: bool) -> None:
            log.append((req.seq, ok, threading.get_ident() == me))
            if req.seq == 2:
                entered.set()
                gate.wait(10)  # hold the scatter thread inside the large one's ack

        def request(seq: int, dst: int, length: int) -> ScatterRequest:
            lengths = np.array([length], np.int64)
            return ScatterRequest(Room(7), 0, 0, seq, np.array([dst], np.int64), lengths)

        staging.submit(request(1, 0, 4096), ack)  # inline: done when submit returns
        assert log == [(1, True, True)]
        assert torch.equal(arena[:4096], staging.buffer[:4096])
        assert not staging.after_scatters(lambda: None)
        staging.submit(request(2, 65536, 8192), ack)  # over inline_bytes: the thread's
        assert entered.wait(10)
        staging.submit(request(3, 4096, 1024), ack)  # small, but one is queued: behind it
        assert log == [(1, True, True), (2, True, False)]
        done = threading.Event()
        assert staging.after_scatters(done.set)
        gate.set()
        assert done.wait(10)
        assert log == [(1, True, True), (2, True, False), (3, True, False)]
        assert torch.equal(arena[65536 : 65536 + 8192], staging.buffer[:8192])
        assert torch.equal(arena[4096 : 4096 + 1024], staging.buffer[:1024])
        counters = staging.counters()
        assert (counters["scatters"], counters["inline_scatters"]) == (3, 1)
        assert counters["scattered_bytes"] == 4096 + 8192 + 1024
    finally:
        gate.set()
        staging.close()
        engine.close()


def test_a_small_scatter_the_caller_keeps_off_its_thread_goes_to_the_scatter_thread() -> None:
    """``inline=False`` (D: other rooms are live on the rank): even small and with nothing
    queued, the scatter runs on the scatter thread, after ``submit`` returned."""
    engine = MooncakeEngine("127.0.0.1")
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    staging = StagingArea(engine, arena, total=8 << 20, slots=8, inline_bytes=4096)
    try:
        assert staging.grant("127.0.0.1:1", ("127.0.0.1", 5000), 2) is not None
        staging.buffer[:4096] = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        me, log = threading.get_ident(), []

        def ack(req: ScatterRequest, endpoint: object, ok: bool) -> None:
            log.append((req.seq, ok, threading.get_ident() == me))

        lengths = np.array([2048], np.int64)
        req = ScatterRequest(Room(8), 0, 0, 1, np.array([16384], np.int64), lengths)
        staging.submit(req, ack, inline=False)
        done = threading.Event()
        if staging.after_scatters(done.set):
            assert done.wait(10)
        assert log == [(1, True, False)]
        assert torch.equal(arena[16384 : 16384 + 2048], staging.buffer[:2048])
        assert staging.counters()["inline_scatters"] == 0
    finally:
        staging.close()
        engine.close()
