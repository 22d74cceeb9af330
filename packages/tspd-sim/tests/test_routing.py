"""Routing policies, DP group selection by room, and rejections."""

from __future__ import annotations

import pytest

from tspd_sim.errors import SpecError
from tspd_sim.metrics import Slo
from tspd_sim.sim.router import RoutingSpec
from tspd_sim.sim.simulation import Simulation
from tspd_sim.testing import mooncake_trace, small_config


def test_round_robin_alternates_instances_on_both_sides() -> None:
    trace = mooncake_trace([(0.1 * i, 300, 3, []) for i in range(6)])
    df = Simulation(trace, small_config("2x1", "3x1", routing="round_robin")).run().requests
    assert df["p_engine"].tolist() == [0, 1, 0, 1, 0, 1]
    assert df["d_engine"].tolist() == [0, 1, 2, 0, 1, 2]


def test_least_load_avoids_the_engine_with_queued_work() -> None:
    # A long prompt lands on P0 first; while it is still prefilling, the next requests go to P1
    # (fewest queued prompt tokens), and P0 only gets work once its queue drains.
    rows = [(0.0, 30000, 2, []), (0.001, 200, 2, []), (0.002, 200, 2, [])]
    df = Simulation(mooncake_trace(rows), small_config("2x1", "2x1", routing="least_load")).run()
    assert df.requests["p_engine"].tolist() == [0, 1, 1]


def test_prefix_aware_routes_to_the_engine_holding_the_prefix() -> None:
    rows = [
        (0.0, 1500, 2, [1, 2, 3]),
        (0.0, 1500, 2, [7, 8, 9]),
        (30.0, 1500, 2, [7, 8, 4]),  # shares two blocks with request 1 (on P1 and D1)
        (31.0, 1500, 2, [1, 2, 5]),  # shares two blocks with request 0 (on P0 and D0)
    ]
    res = Simulation(mooncake_trace(rows), small_config("2x1", "2x1", routing="prefix_aware")).run()
    df = res.requests
    assert df["p_engine"].tolist() == [0, 1, 1, 0]
    assert df["d_engine"].tolist() == [0, 1, 1, 0]
    assert df["p_hit_tokens"].tolist() == [0, 0, 1024, 1024]
    assert df["d_hit_tokens"].tolist() == [0, 0, 1024, 1024]
    # Round robin sends them elsewhere and loses the hits.
    rr = Simulation(mooncake_trace(rows), small_config("2x1", "2x1")).run().requests
    assert rr["p_hit_tokens"].tolist() == [0, 0, 0, 0]


def test_dp_group_is_the_room_modulo_dp() -> None:
    trace = mooncake_trace([(0.05 * i, 500, 3, []) for i in range(12)])
    sim = Simulation(trace, small_config("2x1dp2", "1x2dp4", routing="round_robin"))
    df = sim.run().requests
    p_inst = [0, 1] * 6
    assert df["p_engine"].tolist() == [
        i * 2 + r % 2 for i, r in zip(p_inst, df["room"], strict=True)
    ]
    assert df["d_engine"].tolist() == [r % 4 for r in df["room"]]
    # GPU numbering: P engines of TP 1, D engines of TP 2 (two NICs each).
    assert [i.gpu_base for i in sim.d_info] == [0, 2, 4, 6]


def test_requests_beyond_the_context_are_rejected_with_a_reason() -> None:
    rows = [(0.0, 130000, 2000, []), (0.1, 1000, 5, [])]
    res = Simulation(mooncake_trace(rows), small_config()).run()
    df = res.requests
    assert df["rejected"].tolist() == [True, False]
    assert df.loc[0, "reject_reason"] == "context 131999 > max 131072"
    s = res.summary(Slo(10.0, 1.0))
    assert (s["requests"], s["completed"], s["rejected"]) == (2, 1, 1)
    assert s["slo_attainment"] == 0.5


def test_bad_configs_are_clear_errors() -> None:
    with pytest.raises(SpecError, match="unknown routing policy"):
        RoutingSpec("random")
    with pytest.raises(SpecError, match="does not fit on 1xtp1@a100"):
        small_config("1x1@a100", model="llama-3-70b")
    with pytest.raises(SpecError, match="bad instance group"):
        small_config("four")
    with pytest.raises(SpecError, match=r"TP 1\.\.8"):
        small_config("1x16")
