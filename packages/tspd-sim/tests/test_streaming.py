"""Results streamed while the run goes: Parquet row groups, spilled step logs, timelines per
bin, exact percentiles from the stream — and the same numbers as a result held in memory."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tspd_sim import quantiles, records, steplog
from tspd_sim.bins import BinGrid, StepIntegral
from tspd_sim.metrics import QUANTILES, SimResult
from tspd_sim.quantiles import weighted_quantiles
from tspd_sim.sim import Simulation
from tspd_sim.testing import small_config
from tspd_sim.traces import synthetic


def _run(out: Path | None = None) -> SimResult:
    """300 requests on D pools of ~9k tokens without the output reservation: 63 preemptions."""
    trace = synthetic(300, 12.0, "lognormal:1200:0.8", "lognormal:300:0.8", seed=9)
    cfg = small_config("1x1", "2x1", routing="least_load", reserve_output=False, mem_fraction=0.215)
    return Simulation(trace, cfg).run(out=out)


def test_rows_and_steps_stream_in_small_pieces_and_read_back_the_same(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    whole = _run()
    monkeypatch.setattr(records, "GROUP_ROWS", 32)
    monkeypatch.setattr(steplog, "SPILL_STEPS", 100)
    streamed = _run(out=tmp_path)
    assert streamed.requests_path == tmp_path / "requests.parquet"
    assert pq.ParquetFile(streamed.requests_path).num_row_groups == -(-300 // 32)
    pd.testing.assert_frame_equal(streamed.requests, whole.requests, check_exact=True)
    pd.testing.assert_frame_equal(streamed.segments, whole.segments, check_exact=True)
    assert whole.summary()["preemptions"] == 63  # so segments were streamed too
    for a, b in zip(streamed.logs, whole.logs, strict=True):
        assert np.array_equal(a.ends, b.ends)
        assert np.array_equal(a.gap_weights, b.gap_weights)
    for i in (0, 17, 299, *whole.segments["request"].unique()[:3].tolist()):
        assert np.array_equal(streamed.token_times(int(i)), whole.token_times(int(i)))
    assert streamed.summary() == whole.summary() | {"wall_s": streamed.info["wall_s"]} | {
        "sim_requests_per_wall_s": streamed.info["sim_requests_per_wall_s"]
    }


def test_the_summary_percentiles_are_those_of_the_full_columns() -> None:
    res = _run()
    s = res.summary()
    df = res.requests
    done = df[~df["rejected"]]
    for name in ("ttft", "tpot", "e2e", "queue"):
        values = done[f"{name}_s"].dropna().to_numpy()
        for q in QUANTILES:
            assert s[f"{name}_p{round(q * 100)}"] == np.quantile(values, q)
    itl = res.itl()
    every = [np.diff(res.token_times(int(i))) for i in done.index]
    assert np.array_equal(np.sort(itl), np.sort(np.concatenate(every)))
    # The ITL quantiles come from (gap, count) blocks read twice, never expanded; they equal
    # np.quantile of the expanded array up to the interpolation's rounding (1e-12).
    for q in QUANTILES:
        assert s[f"itl_p{round(q * 100)}"] == pytest.approx(np.quantile(itl, q), rel=1e-12)
    assert s["itl_mean"] == pytest.approx(itl.mean(), rel=1e-12)


def test_a_pickled_result_carries_its_rows_and_outlives_the_files() -> None:
    res = _run()
    copy = pickle.loads(pickle.dumps(res))
    assert copy.requests_path is None
    pd.testing.assert_frame_equal(copy.requests, res.requests)
    assert copy.summary() == res.summary()
    assert np.array_equal(copy.token_times(5), res.token_times(5))
    tmp = res.requests_path.parent  # type: ignore[union-attr]
    del res
    gc.collect()
    assert not tmp.exists()  # the private folder went with the result
    assert len(copy.itl()) == int((copy.requests["output_len"] - 1).sum())


def test_request_state_is_freed_when_a_request_finishes() -> None:
    trace = synthetic(200, 8.0, "fixed:800", "fixed:40", seed=1)
    sim = Simulation(trace, small_config("1x1", "1x1"))
    peak = 0
    inner = sim._finished

    def finished(req):  # type: ignore[no-untyped-def]
        nonlocal peak
        peak = max(peak, len(sim.live))
        inner(req)

    for d in sim.d_engines:
        d._on_finished = finished
    df = sim.run().requests
    assert sim.live == {}
    # Never more requests held than were in the system at once (far fewer than 200).
    events = sorted([(t, 1) for t in df["arrival_s"]] + [(t, -1) for t in df["finish_s"]])
    most = int(np.cumsum([e for _, e in events]).max())
    assert 0 < peak <= most < 20


# ---- the pieces ---------------------------------------------------------------------------


def test_step_integrals_are_exact_per_bin_and_survive_widening() -> None:
    grid = BinGrid(4.0, bins=4)  # 1 s bins, widened past 8 edges
    series = StepIntegral(grid, 2)
    series.set(0.5, [2.0, 1.0])
    series.set(1.5, [0.0, 3.0])
    means = series.bin_means(3.5)
    assert grid.edges(3.5).tolist() == [0.0, 1.0, 2.0, 3.0, 3.5]
    assert means.tolist() == [[1.0, 0.5], [1.0, 2.0], [0.0, 3.0], [0.0, 3.0]]
    series.set(9.0, [4.0, 0.0])  # past 8 edges: bins become 2 s wide
    means = series.bin_means(10.0)
    assert grid.width == 2.0
    assert grid.edges(10.0).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert means[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 2.0]
    assert means[:, 1].tolist() == [1.25, 3.0, 3.0, 3.0, 1.5]


def test_the_grid_widens_for_the_end_of_a_quiet_run() -> None:
    # The last change is long before the end: the edges asked for first must already be the
    # widened ones the series report (a run's timelines are built in that order).
    grid = BinGrid(4.0, bins=4)  # 1 s bins, 8 edges at most
    series = StepIntegral(grid, 1)
    series.set(1.0, [2.0])
    assert grid.edges(20.0).tolist() == [0.0, 4.0, 8.0, 12.0, 16.0, 20.0]
    assert series.bin_means(20.0)[:, 0].tolist() == [1.5, 2.0, 2.0, 2.0, 2.0]


@settings(max_examples=60)
@given(
    values=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=60),
    counts=st.lists(st.integers(0, 5), min_size=90, max_size=90),
    split=st.integers(1, 20),
    collect=st.sampled_from([1, 3, quantiles.COLLECT]),
)
def test_weighted_quantiles_equal_those_of_the_expanded_values(
    values: list[float], counts: list[int], split: int, collect: int
) -> None:
    # ``collect`` 1 or 3: crowded bins are split, down to single bit patterns for ties.
    quantiles.COLLECT, saved = collect, quantiles.COLLECT
    v = np.array(values + values[: len(values) // 2])  # with ties
    w = np.array(counts[: len(v)], dtype=np.int64)

    def blocks():  # type: ignore[no-untyped-def]
        for lo in range(0, len(v), split):
            yield v[lo : lo + split], w[lo : lo + split]

    try:
        mean, qs = weighted_quantiles(blocks, (0.0, 0.5, 0.9, 0.99, 1.0))
    finally:
        quantiles.COLLECT = saved
    full = np.repeat(v, w)
    if not len(full):
        assert np.isnan(mean)
        return
    expect = np.quantile(full, [0.0, 0.5, 0.9, 0.99, 1.0])
    np.testing.assert_allclose(qs, expect, rtol=1e-12)
    assert mean == pytest.approx(full.mean(), rel=1e-12)
