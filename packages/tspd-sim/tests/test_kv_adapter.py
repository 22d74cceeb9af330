"""The scheduler adapter's bookkeeping agrees with the real scheduler's own state."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tspd_core.ids import RequestId
from tspd_sim.sim.kv import EngineKv


@settings(max_examples=80, deadline=None)
@given(
    prompt=st.integers(1, 700),
    output=st.integers(2, 600),
    steps=st.lists(st.integers(1, 90), min_size=1, max_size=30),
)
def test_lazy_records_allocate_exactly_the_pages_a_step_by_step_engine_holds(
    prompt: int, output: int, steps: list[int]
) -> None:
    kv = EngineKv(num_pages=128, max_running=4, page_size=16, max_context=4096)
    keys = np.zeros(0, dtype=np.uint64)
    assert kv.try_admit("r", keys, prompt, remote=True, growth_tokens=output - 1) == 0
    reserved = kv.pages_for(prompt + output - 1) - kv.pages_for(prompt)
    assert kv.pool.free_count() >= reserved  # the reservation is backed by free pages
    kv.kv_arrived("r", prompt)
    done = 0
    for n in steps:
        n = min(n, output - 1 - done)
        if n == 0:
            break
        kv.advance("r", n)
        done += n
        view = kv.sched.view(RequestId("r"))
        # The pages held are exactly those a step-by-step engine would hold after `done`
        # steps: the KV of prompt + done tokens (the last step's page included).
        assert view.num_pages == kv.pages_for(prompt + done)
        lag, room = kv.decoding["r"]
        assert view.num_tokens + lag == prompt + done
        assert room == view.num_pages * 16 - view.num_tokens
    kv.finish("r")
    assert kv.pool.used_count() == 0
    assert kv.sched.active_count() == 0


def test_admission_waits_when_the_output_reservation_cannot_be_backed() -> None:
    kv = EngineKv(num_pages=20, max_running=4, page_size=16, max_context=4096)
    none = np.zeros(0, dtype=np.uint64)
    # 200 prompt tokens (13 pages) + 199 output tokens (12 more pages) > 20 pages.
    assert kv.try_admit("a", none, 200, remote=True, growth_tokens=199) is None
    assert kv.sched.active_count() == 0
    assert kv.try_admit("a", none, 200, remote=True, growth_tokens=120) == 0  # 13 + 7 = 20
    # Nothing is left for a second request, even a one-page one, while "a" holds its reserve.
    assert kv.try_admit("b", none, 10, remote=True, growth_tokens=0) is None
    kv.finish("a")
    assert kv.try_admit("b", none, 10, remote=True, growth_tokens=0) == 0
