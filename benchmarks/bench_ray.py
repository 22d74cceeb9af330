"""The simulator's capacity sweep on Ray: wall time of a fixed grid on a Ray cluster of one
node and of two (tspd_testing.raycluster: each node a `ray start` with one CPU, on loopback
addresses of its own), against the same grid in this process (the baseline), every table
checked identical to the baseline's.

The grid: 6 configurations (3 routing policies x 2 decode sizes) of a 1,500-request synthetic
trace, each capacity-searched (4 bisection steps after bracketing). On one machine the nodes
share its cores: two nodes of one CPU each can at best halve the sweep on a machine with two
free cores. ``--quick``: 4 configurations of 400 requests. Needs tspd-sim's ``ray`` extra.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import pandas as pd
from common import table

from tspd_sim.metrics import Slo
from tspd_sim.search import GridPoint, run_grid, vary
from tspd_sim.sim.router import POLICIES
from tspd_sim.testing import small_config
from tspd_sim.traces import Trace, synthetic
from tspd_testing.raycluster import RayCluster

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
ITERS = 4


def _grid(quick: bool) -> tuple[list[GridPoint], Trace]:
    base = small_config()
    policies = ["round_robin", "least_load"] if quick else list(POLICIES)
    decodes = [base.cluster.decode, (small_config(decode="2x1").cluster.decode[0],)]
    points = vary(base, routing=policies, decode=decodes)
    return points, synthetic(400 if quick else 1500, 3.0, "fixed:2000", "fixed:40", seed=5)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    keep = [c for c in a.columns if "wall" not in c]
    return bool(a[keep].equals(b[keep]))


def run(args: list[str]) -> dict[str, Any]:
    quick = "--quick" in args
    points, trace = _grid(quick)
    t = time.monotonic()
    local = run_grid(points, trace, SLO, search=True, iters=ITERS, workers=1)
    base = time.monotonic() - t
    rows: list[list[object]] = [["this process (baseline)", 1, base, 1.0, True]]
    results: dict[str, Any] = {"points": len(points), "requests": len(trace), "local_s": base}
    for workers in (0, 1):
        cluster = RayCluster.start(workers=workers)
        try:
            t = time.monotonic()
            on_ray = run_grid(points, trace, SLO, search=True, iters=ITERS,
                              ray_address=cluster.address)  # fmt: skip
            wall = time.monotonic() - t
        finally:
            cluster.stop()
        nodes = workers + 1
        same = _same(local, on_ray)
        rows.append([f"Ray, {nodes} node{'s' * (nodes > 1)}", nodes, wall, base / wall, same])
        results[f"ray_{nodes}_nodes_s"] = wall
        results[f"ray_{nodes}_nodes_identical"] = same
    results["speedup_2_over_1_node"] = results["ray_1_nodes_s"] / results["ray_2_nodes_s"]
    print(f"{len(points)} configurations, {len(trace)} requests each, capacity search")
    print(table(["where", "CPUs", "wall s", "x baseline", "table identical"], rows))
    print(f"2 nodes over 1: x{results['speedup_2_over_1_node']:.2f}")
    return results
