"""`tspd-sim search` and `compare` on a real Ray cluster started here (a head and a worker
node, two `ray start` on loopback addresses: tspd_testing.raycluster): the same tables as the
local run, and a worker node killed mid-sweep has its points run again elsewhere, the sweep
complete and identical. Marked deploy (minutes; `nox -s deploy`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from tspd_sim.cli import main
from tspd_sim.metrics import Slo
from tspd_sim.search import Capacity, GridPoint, run_grid, vary
from tspd_sim.testing import small_config
from tspd_sim.traces import Trace, synthetic
from tspd_testing.raycluster import RayCluster

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

TINY = ["--trace", "synthetic", "--requests", "60", "--rate", "4", "--input-len", "fixed:600",
        "--output-len", "fixed:20", "--quiet", "--no-plots"]  # fmt: skip
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    """A grid's table without what the machine's speed decides (wall times)."""
    return frame[[c for c in frame.columns if "wall" not in c]]


def probes(caps: list[Capacity]) -> list[list[tuple[Any, ...]]]:
    """Each capacity search's probes, their summaries without wall times."""
    return [
        [
            (p.scale, p.rate_rps, p.attainment, p.slo_met_rps,
             sorted((k, v) for k, v in p.summary.items() if "wall" not in k))
            for p in cap.probes
        ]
        for cap in caps
    ]  # fmt: skip


def grid(requests: int) -> tuple[list[GridPoint], Trace]:
    """Six configurations (three policies, two decode sizes) and a synthetic trace."""
    base = small_config()
    points = vary(
        base,
        routing=["round_robin", "least_load", "prefix_aware"],
        decode=[base.cluster.decode, (small_config(decode="2x1").cluster.decode[0],)],
    )
    return points, synthetic(requests, 3.0, "fixed:2000", "fixed:40", seed=5)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    cluster = RayCluster.start(workers=1)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_grid_on_ray_is_the_local_grid(ray_cluster: RayCluster) -> None:
    points, trace = grid(200)
    local = run_grid(points, trace, SLO, search=True, iters=3, workers=1)
    done: list[str] = []
    on_ray = run_grid(points, trace, SLO, search=True, iters=3, ray_address=ray_cluster.address,
                      on_done=lambda row: done.append(str(row["config"])))  # fmt: skip
    pd.testing.assert_frame_equal(comparable(local), comparable(on_ray), check_exact=True)
    assert probes(local.attrs["capacities"]) == probes(on_ray.attrs["capacities"])
    assert sorted(done) == sorted(p.label for p in points)  # each point reported once


def test_the_cli_on_ray_writes_what_it_writes_locally(
    ray_cluster: RayCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(*args: str) -> str:
        assert main(list(args)) == 0
        return capsys.readouterr().out

    ray = ["--ray", ray_cluster.address]
    search = ["search", *TINY, "--slo-ttft", "0.5", "--grid-routing", "round_robin", "least_load"]
    here = run(*search, "--workers", "1", "--out", str(tmp_path / "here"))
    there = run(*search, *ray, "--out", str(tmp_path / "ray"))
    assert here == there.replace(str(tmp_path / "ray"), str(tmp_path / "here"))
    assert (tmp_path / "here" / "search.csv").read_text() == (
        tmp_path / "ray" / "search.csv"
    ).read_text()
    # One configuration, no grid: its search is one task on the cluster, the same answer.
    one = ["search", *TINY, "--slo-ttft", "0.5", "--iters", "3"]
    here = run(*one, "--out", str(tmp_path / "one"))
    there = run(*one, *ray, "--out", str(tmp_path / "one-ray"))
    assert here.startswith("capacity of llama-3-8b P[4xtp1@h100] D[4xtp1@h100]: ")
    assert here == there.replace(str(tmp_path / "one-ray"), str(tmp_path / "one"))
    compare = ["compare", *TINY, "--variant", "rr: --routing round_robin",
               "--variant", "tp2: --decode 1x2 --no-layerwise"]  # fmt: skip
    run(*compare, "--workers", "1", "--out", str(tmp_path / "cmp"))
    run(*compare, *ray, "--out", str(tmp_path / "cmp-ray"))
    for variant in ("rr", "tp2"):
        a, b = (json.loads((tmp_path / d / variant / "summary.json").read_text())
                for d in ("cmp", "cmp-ray"))  # fmt: skip
        assert {k: v for k, v in a["summary"].items() if "wall" not in k} == {
            k: v for k, v in b["summary"].items() if "wall" not in k
        }
        pd.testing.assert_frame_equal(
            *(
                pd.read_parquet(tmp_path / d / variant / "requests.parquet")
                for d in ("cmp", "cmp-ray")
            ),
            check_exact=True,
        )


def test_a_worker_node_killed_mid_sweep_has_its_points_run_again(
    ray_cluster: RayCluster,
) -> None:
    # Its own cluster: this one loses a node. Points of several seconds each, so that the
    # worker node is caught running one.
    del ray_cluster
    points, trace = grid(1500)
    local = run_grid(points, trace, SLO, search=True, iters=4, workers=2)
    cluster = RayCluster.start(workers=1)
    try:
        finished = threading.Semaphore(0)
        out: list[pd.DataFrame] = []
        errors: list[BaseException] = []

        def sweep() -> None:
            try:
                out.append(run_grid(points, trace, SLO, search=True, iters=4,
                                    ray_address=cluster.address,
                                    on_done=lambda _: finished.release()))  # fmt: skip
            except BaseException as exc:
                errors.append(exc)

        driver = threading.Thread(target=sweep, daemon=True)
        driver.start()
        assert finished.acquire(timeout=300), errors  # a first point is done
        killed_busy = False
        for _ in range(3000):  # the worker node takes its next point within a moment
            if cluster.busy(1, "_point_worker"):
                cluster.kill_node(1)
                killed_busy = True
                break
            threading.Event().wait(0.02)
        assert killed_busy, "the worker node never ran a point"
        assert cluster.raylet(1) == 0
        driver.join(600)
        assert not driver.is_alive()
        assert errors == []
        [on_ray] = out
        pd.testing.assert_frame_equal(comparable(local), comparable(on_ray), check_exact=True)
        assert probes(local.attrs["capacities"]) == probes(on_ray.attrs["capacities"])
        cluster.wait_nodes(1, 120)  # the head saw the worker node die
    finally:
        cluster.stop()
