"""Layerwise streaming pieces without processes: the wrap-safe counter, the producer schedule,
the pacer that turns "the counter passed t" into callbacks, and the engine <-> worker messages."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tspd_core.ids import Room
from tspd_core.layout import ArenaSpec, AttentionKind, CacheContract, build_contract
from tspd_core.pd.errors import ConfigError, UsageError
from tspd_core.pd.layerwise.schedule import LayerwiseSpec, ProducerSchedule, interval_target
from tspd_core.pd.layerwise.step_counter import (
    HALF,
    MASK,
    PACE_SHARE,
    PACE_SLEEP_MAX_S,
    CounterReader,
    M,
    Pacer,
    StepCounter,
    _Pace,
    behind,
    ready,
    steps_to_pass,
)
from tspd_core.pd.prefill.peer import PrefillOutbox
from tspd_core.pd.wire import ipc


def test_ready_is_wire_7s_rule_across_the_wrap() -> None:
    t = 100
    assert [ready(c, t) for c in (99, 100, 101, 102)] == [False, False, True, True]
    assert ready(t + HALF - 1, t)
    assert not ready(t + HALF, t)  # (t - c) mod M == M/2 is not "more than half": not passed
    assert ready(t + HALF + 1, t) is False  # ... and beyond that the counter is "behind" t
    # Across the wrap: M-1 then 0, 1, ...
    assert ready(0, M - 1)
    assert ready(5, M - 3)
    assert not ready(M - 3, 5)
    assert not ready(M - 1, 0)
    assert ready(M + 7, 6)  # values are taken mod M
    assert [behind(M - 2, 1), behind(1, M - 2), behind(5, 5)] == [3, -3, 0]


def test_interval_targets_wrap() -> None:
    assert interval_target(10, 3) == 12
    assert interval_target(M - 1, 1) == M - 1
    assert interval_target(M - 1, 2) == 0
    assert interval_target(M - 2, 5) == 2


def _contract(layers: int, draft: int = 0) -> CacheContract:
    spec = ArenaSpec(
        layers=layers,
        attention=AttentionKind.GQA,
        kv_heads=2,
        head_dim=4,
        page_size=4,
        draft_layers=draft,
        num_pages=8,
    )
    return build_contract(spec)


def test_producer_schedule_counts_draft_layers_as_one_final_step() -> None:
    plain = ProducerSchedule.for_contract(_contract(4))
    assert (plain.target_layers, plain.total_layers, plain.steps) == (4, 4, 4)
    assert plain.intervals(3) == [(0, 3), (3, 4)]
    assert [plain.layers(b, e) for b, e in plain.intervals(1)] == [(0, 1), (1, 2), (2, 3), (3, 4)]

    mtp = ProducerSchedule.for_contract(_contract(3, draft=2), draft_layers=2)
    assert (mtp.target_layers, mtp.total_layers, mtp.steps) == (3, 5, 4)
    assert mtp.intervals(2) == [(0, 2), (2, 4)]
    assert mtp.layers(0, 2) == (0, 2)
    assert mtp.layers(2, 4) == (2, 5)  # the draft step carries both draft layers
    assert mtp.layers(3, 4) == (3, 5)
    assert mtp.intervals(10) == [(0, 4)]
    with pytest.raises(ValueError, match="outside"):
        mtp.layers(3, 5)
    with pytest.raises(ValueError, match="at least one step"):
        mtp.intervals(0)
    with pytest.raises(ConfigError, match="draft_layers"):
        ProducerSchedule.for_contract(_contract(2), draft_layers=2)
    with pytest.raises(ConfigError, match=">= 0"):
        ProducerSchedule.for_contract(_contract(2), draft_layers=-1)
    with pytest.raises(ConfigError, match=">= 1"):
        LayerwiseSpec(0, 0, torch.zeros(1, dtype=torch.int64))


def test_step_counter_on_cpu_is_shared_and_wraps() -> None:
    c = StepCounter("cpu", start=M - 2)
    reader = CounterReader(c.host)
    assert c.host.is_shared()  # type: ignore[no-untyped-call]
    assert (c.value(), reader.value(), c.issued, c.reserved) == (M - 2, M - 2, M - 2, M - 2)
    c.advance()
    c.advance(2)
    assert (c.value(), reader.value(), c.issued) == (1, 1, 1)
    assert int(c.host[0]) == 1  # the stored word itself is reduced mod M
    with pytest.raises(UsageError, match="only moves forward"):
        c.advance(-1)
    with pytest.raises(ConfigError, match="cpu or cuda"):
        StepCounter("meta")
    with pytest.raises(ConfigError, match="one int64"):
        CounterReader(torch.zeros(2, dtype=torch.int64))


def test_reserve_catches_a_forward_that_steps_unarmed_and_resyncs() -> None:
    c = StepCounter(start=M - 3)
    assert c.reserve(4) == M - 3  # forward A: steps M-3 .. 0
    assert c.reserve(4) == 1  # forward B armed while A still runs (reservations stack)
    c.advance(8)  # A and B ran
    c.check()
    assert c.reserve(4) == 5
    c.advance(4)
    c.advance(2)  # a forward nobody armed
    with pytest.raises(UsageError, match="advanced 2 step"):
        c.check()
    with pytest.raises(UsageError, match="call arm_layerwise before every forward"):
        c.reserve(4)
    assert c.reserve(4) == 11  # resynced: the next forward begins where the counter is


def _fired(q: queue.SimpleQueue[str], timeout: float = 10.0) -> list[str]:
    """Everything the pacer fires within ``timeout``, waiting only while it keeps firing."""
    out = [q.get(timeout=timeout)]
    time.sleep(0.02)  # room for a wrong extra callback to show up
    while not q.empty():
        out.append(q.get_nowait())
    return out


def _putter(q: queue.SimpleQueue[str], name: str) -> Callable[[], None]:
    return lambda: q.put(name)


def test_pacer_fires_each_target_once_the_counter_passes_it() -> None:
    c = StepCounter(start=M - 2)
    pacer = Pacer(CounterReader(c.host))
    fired: queue.SimpleQueue[str] = queue.SimpleQueue()
    try:
        # Targets as arm_layerwise would set them: begin M-2, 4 steps, interval 1.
        for e in range(1, 5):
            name = f"step{e - 1}"
            pacer.wait(name, interval_target(M - 2, e), _putter(fired, name))
        pacer.wait("dropped", interval_target(M - 2, 2), lambda: fired.put("dropped"))
        pacer.discard("dropped")
        time.sleep(0.02)
        assert fired.empty()  # nothing passed yet
        assert pacer.waiting() == 4
        c.advance()
        assert _fired(fired) == ["step0"]
        c.advance(2)  # across the wrap: M-1 -> 0 -> 1
        assert sorted(_fired(fired)) == ["step1", "step2"]
        c.advance()
        assert _fired(fired) == ["step3"]
        assert pacer.waiting() == 0
    finally:
        pacer.close()


def test_steps_to_pass_counts_across_the_wrap() -> None:
    assert [steps_to_pass(M - 1, t) for t in (M - 2, M - 1, 0, 1)] == [0, 1, 2, 3]
    assert [steps_to_pass(5, 5), steps_to_pass(6, 5)] == [1, 0]


def test_the_pace_sleeps_towards_a_far_target_and_polls_the_last_step() -> None:
    pace = _Pace()
    assert pace.sleep_for(30) == 0.0  # no pace seen yet: poll
    pace.saw(M - 1, 10.0)
    pace.saw(M - 1, 10.001)  # no move, no pace
    assert pace.per_step is None
    pace.saw(1, 10.004)  # two steps (across the wrap) in 4 ms
    assert pace.per_step == pytest.approx(0.002, rel=1e-9)
    pace.saw(2, 10.008)  # one step in 4 ms: averaged
    assert pace.per_step == pytest.approx(0.003, rel=1e-9)
    assert pace.sleep_for(1) == 0.0  # the last step is polled
    assert pace.sleep_for(3) == pytest.approx(PACE_SHARE * 2 * 0.003, rel=1e-9)
    assert pace.sleep_for(1000) == PACE_SLEEP_MAX_S
    pace.idle()  # between forwards: the next move is no pace
    pace.saw(2, 20.0)
    pace.saw(3, 25.0)  # a gap, not a pace (slower than PACE_GAP_S per step)
    assert pace.per_step == pytest.approx(0.003, rel=1e-9)


def test_a_paced_pacer_still_fires_when_the_counter_passes() -> None:
    c = StepCounter(start=0)
    pacer = Pacer(CounterReader(c.host))
    fired: queue.SimpleQueue[str] = queue.SimpleQueue()
    try:
        pacer.wait("first", interval_target(0, 2), _putter(fired, "first"))
        c.advance(2)
        assert _fired(fired) == ["first"]
        pacer.wait("far", interval_target(2, 40), _putter(fired, "far"))
        for _ in range(39):
            c.advance()
        time.sleep(0.02)
        assert fired.empty()  # one step short
        c.advance()
        assert _fired(fired) == ["far"]
    finally:
        pacer.close()


MSGS = [
    ipc.ArmChunk(Room(2**63 - 1), 16, 4096, True, (np.arange(5, dtype=np.int64),), M - 1),
    ipc.BootstrapToken(Room(3), 17, (4, 5), 32, -0.25),
    ipc.BootstrapToken(Room(3), 0),
]


@pytest.mark.parametrize("msg", MSGS, ids=lambda m: type(m).__name__)
def test_layerwise_messages_round_trip(msg: ipc.Message) -> None:
    back = ipc.decode(ipc.encode(msg))
    if isinstance(msg, ipc.ArmChunk):
        assert isinstance(back, ipc.ArmChunk)
        assert (back.room, back.start, back.end, back.final, back.begin) == (
            msg.room,
            16,
            4096,
            True,
            MASK,
        )
        assert [a.tolist() for a in back.block_ids] == [[0, 1, 2, 3, 4]]
    else:
        assert back == msg


def test_an_outbox_without_layerwise_refuses_to_arm() -> None:
    # A test double of the peer: only what the outbox reads when layerwise is off.
    box = PrefillOutbox(SimpleNamespace(layerwise=None), None)  # type: ignore[arg-type]
    assert not box.streams_layerwise()
    with pytest.raises(UsageError, match="layerwise streaming is off"):
        box.arm_layerwise([])
    with pytest.raises(UsageError, match="layerwise streaming is off"):
        _ = box.step_counter
