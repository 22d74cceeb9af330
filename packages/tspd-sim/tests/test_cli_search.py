"""The tspd-sim CLI end to end (files written, errors reported) and the capacity search."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pandas as pd
import pytest

from tspd_sim.cli import main
from tspd_sim.metrics import Slo
from tspd_sim.search import capacity_search, run_grid, vary
from tspd_sim.testing import small_config
from tspd_sim.traces import synthetic

TINY = [
    "--trace",
    "synthetic",
    "--requests",
    "60",
    "--rate",
    "4",
    "--input-len",
    "fixed:600",
    "--output-len",
    "fixed:20",
    "--quiet",
]


def test_run_writes_tables_summary_timelines_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                *TINY,
                "--prefill",
                "2x1",
                "--decode",
                "1x2",
                "--format",
                "csv",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    names = {p.name for p in out.iterdir()}
    assert names == {
        "requests.csv",
        "summary.json",
        "links.csv",
        "pools.csv",
        "held.csv",
        "in_system.csv",
        "ttft_tpot_cdf.png",
        "links.png",
        "pools.png",
    }
    df = pd.read_csv(out / "requests.csv")
    assert len(df) == 60
    assert (df["output_len"] == 20).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["summary"]["requests"] == 60
    # The figures are named for what they are: a replay's SLO-met rate, not a capacity.
    assert {"slo_met_rps", "slo_met_rps_per_gpu"} <= set(summary["summary"])
    assert not [k for k in summary["summary"] if "goodput" in k or "capacity" in k]
    assert summary["cluster"] == "llama-3-8b P[2xtp1@h100] D[1xtp2@h100]"
    links = pd.read_csv(out / "links.csv")
    # Two P egress NICs and two D ingress NICs (one D engine of TP 2).
    assert [c for c in links.columns if c != "t_s"] == [
        "P0.gpu0 egress",
        "P1.gpu0 egress",
        "D0.gpu0 ingress",
        "D0.gpu1 ingress",
    ]


def test_run_parquet_round_trips(tmp_path: Path) -> None:
    assert main(["run", *TINY, "--no-plots", "--out", str(tmp_path)]) == 0
    df = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(df) == 60
    assert {"ttft_s", "tpot_s", "e2e_s", "queue_s", "transfer_bytes"} <= set(df.columns)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill", "four"], "bad instance group 'four'"),
        (["--model", "llama-3-70b", "--prefill", "1x1@a100"], "does not fit"),
        (["--trace", "nope.jsonl"], "neither a bundled trace"),
        (["--calibration", "missing.toml"], "does not exist"),
        (["--nic-gbps", "0"], "must be > 0"),
        (["--duration", "0.0001"], "no request to replay"),
    ],
)
def test_bad_input_is_a_clear_error(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = TINY[2:] if "--trace" in args else TINY  # a --trace replaces the synthetic one
    assert main(["run", *base, *args, "--no-plots", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_help_and_list(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("run", "search", "compare"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
    assert "--prefill COUNTxTP[dpDP][@GPU]" in capsys.readouterr().out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "trace mooncake: 12,031 requests" in out
    assert "llama-3-8b" in out


def test_compare_runs_each_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "compare",
                *TINY,
                "--out",
                str(tmp_path),
                "--workers",
                "1",
                "--variant",
                "rr: --routing round_robin",
                "--variant",
                "tp2: --decode 1x2 --no-layerwise",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rr" in out
    assert "tp2" in out
    rr = json.loads((tmp_path / "rr" / "summary.json").read_text())
    tp2 = json.loads((tmp_path / "tp2" / "summary.json").read_text())
    assert rr["routing"] == "round_robin"
    assert tp2["cluster"].endswith("D[1xtp2@h100]")
    assert (tmp_path / "ttft_tpot_cdf.png").exists()


def test_capacity_search_brackets_the_target() -> None:
    trace = synthetic(150, 2.0, "fixed:3000", "fixed:40", seed=2)
    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    cap = capacity_search(trace, small_config(), slo, target=0.9, iters=3)
    passing = [p for p in cap.probes if p.attainment >= 0.9]
    failing = [p for p in cap.probes if p.attainment < 0.9]
    assert passing
    assert failing
    assert cap.scale == max(p.scale for p in passing)
    assert cap.scale < min(p.scale for p in failing)
    assert cap.capacity_rps == pytest.approx(trace.rate * cap.scale)
    assert cap.capacity_rps_per_gpu == pytest.approx(cap.capacity_rps / 2)  # 1 P + 1 D GPU
    assert list(cap.frame()["rate_rps"]) == sorted(p.rate_rps for p in cap.probes)
    # A probe's SLO-met rate is what its replay delivered, never above its offered rate.
    assert all(p.slo_met_rps <= p.rate_rps * 1.05 for p in cap.probes)


def test_grid_results_do_not_depend_on_the_worker_count() -> None:
    trace = synthetic(80, 3.0, "fixed:1000", "fixed:30", seed=3)
    points = vary(
        small_config(),
        routing=["round_robin", "least_load"],
        decode=[(small_config().cluster.decode[0],)],
    )
    slo = Slo()
    one = run_grid(points, trace, slo, workers=1)
    two = run_grid(points, trace, slo, workers=2)
    keep = [c for c in one.columns if "wall" not in c]
    pd.testing.assert_frame_equal(one[keep], two[keep], check_exact=True)
    assert one["config"].tolist() == [
        "routing=round_robin decode=1xtp1@h100",
        "routing=least_load decode=1xtp1@h100",
    ]


def test_search_grid_writes_a_row_and_a_capacity_curve_per_point(tmp_path: Path) -> None:
    args = [
        "search",
        *TINY,
        "--slo-ttft",
        "0.5",
        "--grid-routing",
        "round_robin",
        "least_load",
        "--workers",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    df = pd.read_csv(tmp_path / "search.csv")
    assert df["config"].tolist() == ["routing=round_robin", "routing=least_load"]
    assert (df["capacity_rps"] > 0).all()
    assert df["capacity_rps_per_gpu"].tolist() == (df["capacity_rps"] / 8).tolist()  # 4 P + 4 D
    assert (tmp_path / "slo_vs_rate.png").exists()


def test_a_grid_shows_its_progress_on_stderr_as_points_finish(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = synthetic(40, 3.0, "fixed:500", "fixed:10", seed=4)
    points = vary(small_config(), routing=["round_robin", "least_load"])
    rows: list[str] = []
    run_grid(points, trace, Slo(), workers=1, progress=True,
             on_done=lambda row: rows.append(str(row["config"])))  # fmt: skip
    err = capsys.readouterr().err
    # tqdm redraws one line: 0 of 2, 1 of 2 after the first point, 2 of 2 at the end.
    assert [f"| {n}/2 " in err for n in range(3)] == [True] * 3
    assert err.index("| 1/2 ") < err.index("| 2/2 ")
    assert rows == ["routing=round_robin", "routing=least_load"]
    run_grid(points, trace, Slo(), workers=1)
    assert capsys.readouterr().err == ""  # no bar unless asked


def test_an_unreachable_ray_head_is_a_clear_error_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A bound socket that does not listen: connecting to it is refused, and nothing else can
    # take its port meanwhile.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        args = ["search", *TINY, "--grid-routing", "round_robin", "--ray", address]
        assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tspd-sim: error: cannot reach the Ray cluster at {address}: ")
    assert "Connection refused" in err
    assert main(["compare", *TINY, "--variant", "a: --routing round_robin", "--ray", "nohost"]) == 2
    assert "--ray 'nohost': give the head's HOST:PORT, or auto" in capsys.readouterr().err
