"""The fair-share network: exact completion instants and utilisation."""

from __future__ import annotations

import pytest
import simpy

from tspd_sim.bins import BinGrid
from tspd_sim.network import NetKnobs, Network

IDEAL = NetKnobs(latency_s=0.0, per_descriptor_s=0.0, efficiency=1.0)


def _run(
    starts: list[tuple[float, int, int, float, int]],
    knobs: NetKnobs = IDEAL,
    egress: int = 2,
    ingress: int = 2,
) -> tuple[list[tuple[str, float]], Network]:
    env = simpy.Environment()
    # Bins of 0.5 s (4 over 2 s), widened if a run goes past 4 s.
    net = Network(env, [1e9] * egress, [1e9] * ingress, knobs, grid=BinGrid(2.0, bins=4))
    log: list[tuple[str, float]] = []
    for i, (at, src, dst, nbytes, desc) in enumerate(starts):

        def go(
            _e: object,
            i: int = i,
            src: int = src,
            dst: int = dst,
            nbytes: float = nbytes,
            desc: int = desc,
        ) -> None:
            net.start(src, dst, nbytes, desc, lambda: log.append((f"f{i}", env.now)))

        env.timeout(at).callbacks.append(go)
    env.run()
    return log, net


def test_one_flow_costs_latency_plus_bytes_plus_descriptors() -> None:
    knobs = NetKnobs(latency_s=1e-3, per_descriptor_s=1e-6, efficiency=0.5)
    log, net = _run([(0.0, 0, 0, 1e9, 1000)], knobs)
    assert log == [("f0", pytest.approx(1e-3 + 1e9 / 0.5e9 + 1000 * 1e-6))]
    assert net.ideal_time(0, 0, 1e9, 1000) == pytest.approx(log[0][1])


def test_shared_egress_splits_fairly_and_recomputes_on_finish() -> None:
    # f1 joins at 0.5 s: both get 0.5 GB/s until f0 ends at 1.5 s, then f1 alone.
    log, net = _run([(0.0, 0, 0, 1e9, 0), (0.5, 0, 1, 1e9, 0)])
    assert log == [("f0", pytest.approx(1.5)), ("f1", pytest.approx(2.0))]
    assert net.utilisation_edges(2.0).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    util = net.utilisation(2.0)
    assert util[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])  # P GPU 0 egress, busy
    assert util[2].tolist() == pytest.approx([1.0, 0.5, 0.5, 0.0])  # D GPU 0 ingress
    assert util[3].tolist() == pytest.approx([0.0, 0.5, 0.5, 1.0])  # D GPU 1 ingress


def test_max_min_fairness_gives_spare_capacity_to_the_unconstrained_flow() -> None:
    # f0, f1 share D ingress 0; f2 shares P egress 1 with f1. Max-min: all three get 0.5 GB/s.
    log, _ = _run([(0.0, 0, 0, 1e9, 0), (0.0, 1, 0, 1e9, 0), (0.0, 1, 1, 0.25e9, 0)])
    # f2 ends at 0.5 s (0.25 GB at 0.5 GB/s); then f0 and f1 each get 0.5 GB/s until 2 s.
    assert log == [
        ("f2", pytest.approx(0.5)),
        ("f0", pytest.approx(2.0)),
        ("f1", pytest.approx(2.0)),
    ]


def test_disjoint_paths_do_not_interact() -> None:
    log, _ = _run([(0.0, 0, 0, 1e9, 0), (0.0, 1, 1, 2e9, 0)])
    assert log == [("f0", pytest.approx(1.0)), ("f1", pytest.approx(2.0))]
