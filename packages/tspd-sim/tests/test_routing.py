"""Routing policies, DP group selection by room, and rejections."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import numpy as np
import pytest

from tspd_sim.errors import SpecError
from tspd_sim.metrics import Slo
from tspd_sim.network import NetKnobs
from tspd_sim.sim.request import SimRequest
from tspd_sim.sim.router import Routable, RoutingSpec, SideRouter
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


@pytest.mark.parametrize("policy", ["least_load", "prefix_aware"])
def test_an_idle_cluster_is_served_round_robin_not_by_the_first_instance(policy: str) -> None:
    # Spaced-out identical requests: each has finished before the next arrives, so every
    # load is zero and there are no prefix hits — a pure tie each time. Ties go round robin
    # (they used to go to instance 0, which then carried every transfer on one NIC).
    trace = mooncake_trace([(1.0 * i, 300, 3, []) for i in range(10)])
    df = Simulation(trace, small_config("4x1", "4x1", routing=policy)).run().requests
    assert (df["finish_s"].iloc[:-1].to_numpy() < df["arrival_s"].iloc[1:].to_numpy()).all()
    assert df["p_engine"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert df["d_engine"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("policy", ["least_load", "prefix_aware"])
def test_a_p_instance_with_a_transfer_in_flight_is_not_picked_while_one_is_idle(
    policy: str,
) -> None:
    # 1 Gb/s NICs: request 0's 1 GB of KV takes ~8 s to drain, long after its prefill. When
    # request 2 arrives P0 has nothing left to prefill but still owes the transfer (and holds
    # the pages); P1 is idle. The tie-break cursor points at P0 (P1 took request 1), so only
    # a load that counts the transfer sends request 2 to P1.
    rows = [(0.0, 8000, 2, []), (0.001, 100, 2, []), (2.0, 100, 2, [])]
    cfg = small_config("2x1", "2x1", routing=policy, net=NetKnobs(nic_bw=1.25e8))
    df = Simulation(mooncake_trace(rows), cfg).run().requests
    assert df.loc[0, "prefill_end_s"] < 2.0 < df.loc[0, "kv_arrived_s"]
    assert df.loc[1, "finish_s"] < 2.0
    assert df["p_engine"].tolist() == [0, 1, 1]
    # D0 still has request 0 (awaiting its KV), D1 has finished request 1.
    assert df["d_engine"].tolist() == [0, 1, 1]


class _Engine:
    """A test double with a settable load and prefix hit (beside the real-engine tests)."""

    def __init__(self) -> None:
        self.load, self.hit = 0.0, 0
        self.kv = self

    def route_load(self) -> float:
        return self.load

    def match_tokens(self, keys: list[int], limit: int) -> int:
        return self.hit


_NO_KEYS = np.zeros(0, dtype=np.uint64)


def _router(engines: list[_Engine], policy: str, balance_abs: float, rel: float) -> SideRouter:
    return SideRouter([[cast(Routable, e)] for e in engines], policy, balance_abs, rel)


def _picks(
    router: SideRouter, engines: list[_Engine], script: Sequence[Sequence[float]]
) -> list[int]:
    """Set the loads, route one request; the index picked, per script row."""
    out = []
    for i, loads in enumerate(script):
        for e, load in zip(engines, loads, strict=True):
            e.load = load
        picked = router.pick(SimRequest(i, 0, 0.0, 64, 2, _NO_KEYS))
        out.append(next(j for j, e in enumerate(engines) if picked is e))
    return out


def test_ties_go_to_the_first_candidate_after_the_last_pick() -> None:
    engines = [_Engine() for _ in range(4)]
    router = _router(engines, "least_load", 0, 1.0)
    script = [[0, 0, 0, 0]] * 5 + [[1, 0, 0, 1]] * 3 + [[0, 2, 0, 2], [5, 5, 5, 5]]
    # Cursor after each pick: 1 2 3 0 1 | 2 3 2 | 3 0
    assert _picks(router, engines, script) == [0, 1, 2, 3, 0, 1, 2, 1, 2, 3]


def test_prefix_aware_prefers_hits_then_load_then_the_cursor() -> None:
    engines = [_Engine() for _ in range(3)]
    router = _router(engines, "prefix_aware", 100, 2.0)
    engines[1].hit = engines[2].hit = 512
    # Equal hits on 1 and 2: the lower load, then the cursor; a large imbalance overrides
    # the hits (least load wins: engine 0, which has none).
    script = [[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 9, 0], [0, 500, 500]]
    assert _picks(router, engines, script) == [1, 2, 1, 2, 0]


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


def test_prefix_aware_does_not_pin_traffic_to_a_prefix_every_request_shares() -> None:
    # Every request starts with block 0 (like the Mooncake trace's shared first block), which
    # is 512 of its 2,000 tokens: below the cache threshold (half the prompt), so it routes by
    # load (round robin here, all idle) and the engines that cached block 0 first do not keep
    # all the traffic; from the second round on each engine has block 0 and hits it.
    rows = [(1.0 * i, 2000, 2, [0, 100 + i, 200 + i, 300 + i]) for i in range(8)]
    cfg = small_config("4x1", "4x1", routing="prefix_aware")
    df = Simulation(mooncake_trace(rows), cfg).run().requests
    assert df["p_engine"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert df["d_engine"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert df["p_hit_tokens"].tolist() == [0] * 4 + [512] * 4
    assert df["d_hit_tokens"].tolist() == [0] * 4 + [512] * 4
    # Without the threshold any hit wins: all traffic stays on the first engines.
    pinned = replace(cfg, routing=RoutingSpec("prefix_aware", cache_threshold=0.0))
    df = Simulation(mooncake_trace(rows), pinned).run().requests
    assert df["p_engine"].tolist() == [0] * 8
    assert df["d_engine"].tolist() == [0] * 8


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
    with pytest.raises(SpecError, match=r"cache_threshold 1\.5: must be in \[0, 1\]"):
        RoutingSpec(cache_threshold=1.5)
    with pytest.raises(SpecError, match="does not fit on 1xtp1@a100"):
        small_config("1x1@a100", model="llama-3-70b")
    with pytest.raises(SpecError, match="bad instance group"):
        small_config("four")
    with pytest.raises(SpecError, match=r"TP 1\.\.8"):
        small_config("1x16")
