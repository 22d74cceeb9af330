# mypy: disable-error-code="no-untyped-call"
# (nbformat's builders carry no annotations)
"""Tests of the notebooks' helpers (``experiments/common.py``) and runner (``run.py``).

Run with ``python -m pytest experiments -q``. The helpers decide what the notebooks report
(capacities, offered loads, per-link traffic), so their arithmetic is checked exactly here;
the notebooks themselves are executed by ``nox -s experiments``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import nbformat
import numpy as np
import pandas as pd
import pytest

from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.testing import mooncake_trace, small_config
from tspd_sim.traces import Trace

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    """Import ``experiments/<name>.py`` by path (experiments/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # sweep's worker processes unpickle jobs by module name
    spec.loader.exec_module(module)
    return module


common = _load("common")
runner = _load("run")


# ---- capacity --------------------------------------------------------------------------------


def _frame(rates: list[float], att: list[float], label: str = "a", gpus: int = 4) -> pd.DataFrame:
    return pd.DataFrame(
        {"label": label, "rate_rps": rates, "slo_attainment": att, "gpus": float(gpus)}
    )


def test_capacity_interpolates_the_first_crossing() -> None:
    # Rows out of order on purpose: capacity sorts by rate. The crossing of 0.9 lies between
    # rate 2 (0.95) and rate 3 (0.85): exactly half way.
    frame = _frame([3.0, 1.0, 4.0, 2.0], [0.85, 1.0, 0.5, 0.95])
    row = common.capacity(frame, 0.9).iloc[0]
    assert row["label"] == "a"
    assert row["capacity_rps"] == pytest.approx(2.5, abs=1e-12)
    assert row["capacity_rps_per_gpu"] == pytest.approx(2.5 / 4, abs=1e-12)
    assert row["bound"] == "in range"


def test_capacity_uses_the_first_crossing_when_attainment_recovers() -> None:
    frame = _frame([1.0, 2.0, 3.0, 4.0], [1.0, 0.8, 0.95, 0.5])
    row = common.capacity(frame, 0.9).iloc[0]
    assert row["capacity_rps"] == pytest.approx(1.5, abs=1e-12)


def test_capacity_outside_the_swept_rates_is_flagged() -> None:
    frame = pd.concat(
        [_frame([1.0, 2.0], [0.95, 0.92], "up"), _frame([1.0, 2.0], [0.5, 0.2], "down")]
    )
    caps = common.capacity(frame, 0.9).set_index("label")
    assert caps.loc["up", "capacity_rps"] == 2.0
    assert caps.loc["up", "bound"] == "above"
    assert caps.loc["down", "capacity_rps"] == 0.0
    assert caps.loc["down", "bound"] == "below"


def test_capacity_at_exactly_the_target_passes() -> None:
    frame = _frame([1.0, 2.0, 3.0], [0.9, 0.9, 0.7])
    row = common.capacity(frame, 0.9).iloc[0]
    assert row["capacity_rps"] == 2.0
    assert row["bound"] == "in range"


# ---- offered loads ---------------------------------------------------------------------------


def _ties() -> Trace:
    # Slots at 0, 3 and 6 s holding 3, 1 and 2 requests (Mooncake-style rounded stamps).
    stamps = [0.0, 0.0, 0.0, 3.0, 6.0, 6.0]
    rows: list[tuple[float, int, int, list[int]]] = [
        (t, 100 + i, 10, []) for i, t in enumerate(stamps)
    ]
    return mooncake_trace(rows)


def test_spread_ties_places_each_slot_inside_its_slot() -> None:
    trace = _ties()
    out = common.spread_ties(trace, seed=7)
    a = out.arrival_s
    assert len(out) == 6
    assert np.all(np.diff(a) >= 0)
    assert np.all((a[:3] >= 0.0) & (a[:3] < 3.0))
    assert a[3] == 3.0  # a lone request keeps its stamp
    # The last slot is as wide as the median gap between stamps (3 s).
    assert np.all((a[4:] >= 6.0) & (a[4:] < 9.0))
    assert np.array_equal(out.input_len, trace.input_len)
    assert np.array_equal(out.output_len, trace.output_len)
    assert np.array_equal(common.spread_ties(trace, seed=7).arrival_s, a)  # seeded
    assert not np.array_equal(common.spread_ties(trace, seed=8).arrival_s, a)


def test_spread_ties_leaves_distinct_stamps_alone() -> None:
    trace = mooncake_trace([(0.0, 10, 1, []), (1.0, 10, 1, []), (2.5, 10, 1, [])])
    assert common.spread_ties(trace) is trace


def _even(n: int, gap: float) -> Trace:
    return mooncake_trace([(i * gap, 64 + i, 5, []) for i in range(n)])


def test_offered_fit_keeps_relative_timing_and_hits_the_rate() -> None:
    # Mean rate 2/s (gaps of 0.5 s except one burst); fit 10 s at 1.5x = 3 req/s: 31 requests.
    stamps = np.r_[0.0, 0.1, 0.2, np.arange(1, 60)]
    rows: list[tuple[float, int, int, list[int]]] = [
        (float(t), 100 + i, 5, []) for i, t in enumerate(stamps)
    ]
    trace = mooncake_trace(rows)
    out = common.offered(trace, 3.0 / trace.rate, duration_s=10.0, fit=True)
    assert len(out) == 31
    assert out.arrival_s[0] == 0.0
    assert out.arrival_s[-1] == pytest.approx(10.0, abs=1e-9)
    assert out.rate == pytest.approx(3.0, abs=1e-9)
    src = trace.arrival_s[:31]
    assert np.allclose(out.arrival_s, src * (10.0 / src[-1]))  # bursts keep their shape
    assert np.array_equal(out.input_len, trace.input_len[:31])


def test_offered_fit_refuses_more_requests_than_the_trace_has() -> None:
    with pytest.raises(ValueError, match="requests"):
        common.offered(_even(10, 1.0), 5.0, duration_s=10.0, fit=True)
    with pytest.raises(ValueError, match="duration_s"):
        common.offered(_even(10, 1.0), 1.0, fit=True)


def test_offered_window_scales_the_trace_own_times() -> None:
    trace = _even(20, 1.0)  # arrivals 0..19 s
    out = common.offered(trace, 2.0, duration_s=5.0)  # 10 s of the trace, twice as fast
    assert np.allclose(out.arrival_s, np.arange(10) / 2.0)
    assert common.offered(trace, 1.0) is trace


# ---- per-link tally --------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "runs_per_page"), [("hnd", 1), ("nhd", 64)])
def test_link_tally_counts_exactly_what_the_simulator_sent(layout: str, runs_per_page: int) -> None:
    # Two 3,000-token prompts from P TP 2 to D TP 1 (Llama-3-8B, 64-token pages): 47 pages
    # each; each P rank holds 4 of the 8 KV heads, 64 KiB of each page per layer and K/V field
    # (32 layers x 2 = 64 fields). In D's head-major page that is one contiguous half: one
    # descriptor per page per field per link, never coalesced across pages; in a token-major
    # page it is one 1 KiB run per token (4 heads x 128 x bf16): 64 per page per field.
    trace = mooncake_trace([(0.0, 3000, 4, []), (5.0, 3000, 4, [])])
    config = small_config("1x2", "1x1", page_layout=layout)
    result, links = common.replay_with_links(trace, config)
    assert list(links[["p_tp", "d_tp", "p_rank", "d_rank"]].itertuples(index=False)) == [
        (2, 1, 0, 0),
        (2, 1, 1, 0),
    ]
    per_link = 2 * 47 * 64
    assert links["descriptors"].tolist() == [per_link * runs_per_page] * 2
    assert links["bytes"].tolist() == [per_link * 64 * 1024] * 2
    assert links["bytes"].sum() == result.requests["transfer_bytes"].sum()
    assert links["descriptors"].sum() == result.requests["transfer_descriptors"].sum()


def test_link_tally_does_not_change_the_replay() -> None:
    trace = mooncake_trace([(0.0, 2000, 8, []), (0.2, 5000, 3, []), (0.4, 700, 20, [])])
    cfg: SimConfig = small_config("1x4", "2x2")
    plain = Simulation(trace, cfg).run().requests
    tallied, _ = common.replay_with_links(trace, cfg)
    cols = ["ttft_s", "e2e_s", "transfer_bytes", "transfer_descriptors", "d_engine"]
    pd.testing.assert_frame_equal(plain[cols], tallied.requests[cols])


def test_nic_balance_is_the_busiest_nic_over_the_mean() -> None:
    # One request on a 2 P + 3 D cluster: one P NIC and one D NIC carry everything, each for
    # exactly the request's work (bytes + descriptors at the per-descriptor cost) over the run.
    trace = mooncake_trace([(0.0, 3000, 4, [])])
    cfg = small_config("2x1", "3x1")
    result = Simulation(trace, cfg).run()
    got = common.nic_balance(result)
    assert got["p_nic_spread"] == 2.0
    assert got["d_nic_spread"] == 3.0
    req = result.requests.iloc[0]
    net = cfg.net
    cap = 50e9 * net.efficiency  # H100 NIC, RDMA profile
    work = req["transfer_bytes"] + req["transfer_descriptors"] * net.per_descriptor_s * cap
    span = result.timelines["edges"][-1]
    assert got["p_nic_busiest"] == pytest.approx(work / cap / span, rel=1e-9)
    assert got["d_nic_busiest"] == pytest.approx(work / cap / span, rel=1e-9)
    # Four spaced-out identical requests on 2 P + 2 D are spread evenly (round robin ties).
    trace = mooncake_trace([(1.0 * i, 3000, 4, []) for i in range(4)])
    even = common.nic_balance(
        Simulation(trace, small_config("2x1", "2x1", "llama-3-8b", "least_load")).run()
    )
    assert even["p_nic_spread"] == pytest.approx(1.0, rel=1e-9)
    assert even["d_nic_spread"] == pytest.approx(1.0, rel=1e-9)


@pytest.mark.multiproc
def test_sweep_rows_do_not_depend_on_the_worker_count() -> None:
    trace = mooncake_trace([(i * 0.5, 500 + 100 * i, 6, []) for i in range(8)])
    points = [
        common.Point("tp1", small_config("1x1", "1x1"), (("p_tp", 1),)),
        common.Point("tp2", small_config("1x2", "1x1"), (("p_tp", 2),)),
    ]
    slo = common.Slo(1.0, 0.05)
    one, links_one = common.sweep(points, trace, [1.0, 2.0], slo, workers=1)
    two, links_two = common.sweep(points, trace, [1.0, 2.0], slo, workers=2)
    drop = ["wall_s"]
    pd.testing.assert_frame_equal(one.drop(columns=drop), two.drop(columns=drop))
    pd.testing.assert_frame_equal(links_one, links_two)
    assert one[["label", "scale", "p_tp"]].values.tolist() == [
        ["tp1", 1.0, 1],
        ["tp1", 2.0, 1],
        ["tp2", 1.0, 2],
        ["tp2", 2.0, 2],
    ]
    assert one["rate_rps"].tolist() == pytest.approx([2.0, 4.0, 2.0, 4.0])


def test_sweep_refuses_duplicate_labels_and_bad_scales() -> None:
    trace = _even(3, 1.0)
    point = common.Point("x", small_config())
    with pytest.raises(ValueError, match="unique"):
        common.sweep([point, point], trace, [1.0], common.Slo())
    with pytest.raises(ValueError, match="positive"):
        common.sweep([point], trace, [0.0], common.Slo())


# ---- figures ---------------------------------------------------------------------------------


def test_save_writes_a_png_and_refuses_oversized_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    monkeypatch.setattr(common, "FIGURES", tmp_path / "figures")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = common.save(fig, "tiny")
    assert path == tmp_path / "figures" / "tiny.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(common, "MAX_PNG_BYTES", 100)
    with pytest.raises(ValueError, match=r"tiny2\.png"):
        common.save(fig, "tiny2")
    common.close(fig)


# ---- runner ----------------------------------------------------------------------------------


def test_runner_finds_notebooks_by_name() -> None:
    every = runner.notebooks([])
    assert every == sorted(HERE.glob("*.ipynb"))
    assert len(every) >= 3
    first = every[0]
    assert runner.notebooks([first.stem]) == [first]
    assert runner.notebooks([first.name]) == [first]
    with pytest.raises(SystemExit, match="unknown notebook"):
        runner.notebooks(["no-such-notebook"])


def test_runner_strip_removes_outputs() -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1 + 1")
    cell.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"})]
    cell.execution_count = 3
    nb.cells = [cell, nbformat.v4.new_markdown_cell("text")]
    out = runner.strip(nb)
    assert out.cells[0].outputs == []
    assert out.cells[0].execution_count is None
    assert out.cells[1].source == "text"


@pytest.mark.multiproc
def test_runner_executes_in_this_interpreter_and_reports_the_failing_cell(
    tmp_path: Path,
) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import os, sys\nprint(sys.executable)\nprint(os.getcwd())"),
        nbformat.v4.new_code_cell("raise ValueError('boom from cell 2')"),
        nbformat.v4.new_code_cell("print('never')"),
    ]
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    done, error = runner.execute(path, tmp_path / "spec", timeout=120)
    first = "".join(o.get("text", "") for o in done.cells[0].outputs)
    assert first.splitlines() == [sys.executable, str(HERE)]
    assert "ValueError" in error
    assert "boom from cell 2" in error
    assert "\x1b[" not in error  # colour codes stripped for CI logs
    assert done.cells[2].outputs == []
