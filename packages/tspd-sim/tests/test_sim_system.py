"""Whole-run properties: conservation, Little's law, back-pressure, repeatability, decode steps."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from tspd_sim.metrics import SimResult
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.testing import mooncake_trace, small_config
from tspd_sim.traces import Trace, load_trace, synthetic


def _steady() -> tuple[Trace, SimConfig]:
    trace = synthetic(1500, 6.0, "lognormal:1500:0.6", "lognormal:120:0.6", seed=11)
    return trace, small_config("2x1", "2x1", routing="least_load")


def test_every_request_is_conserved_and_nothing_leaks() -> None:
    trace = load_trace("mooncake").head(150)
    sim = Simulation(trace, small_config("2x1", "2x1", routing="prefix_aware"))
    res = sim.run()
    df = res.requests
    assert len(df) == 150
    assert not df["rejected"].any()
    assert df["finish_s"].notna().all()
    # Per-request order of events.
    for a, b in [
        ("arrival_s", "d_admit_s"),
        ("d_admit_s", "prefill_start_s"),
        ("prefill_start_s", "prefill_end_s"),
        ("transfer_start_s", "first_token_s"),
        ("prefill_end_s", "first_token_s"),
        ("first_token_s", "finish_s"),
    ]:
        assert (df[a] <= df[b]).all(), (a, b)
    # Every request ran exactly output − 1 decode steps on its engine, none elsewhere.
    steps = sum(len(log.ends) for log in res.logs)
    assert sum(int(log.sizes.sum()) for log in res.logs) == int((df["output_len"] - 1).sum())
    assert steps == res.info["decode_steps"]
    assert df["prefill_tokens"].sum() + df["p_hit_tokens"].sum() == df["input_len"].sum()
    for eng in (*sim.p_engines, *sim.d_engines):
        kv = eng.kv
        assert kv.active == 0
        assert kv.pool.used_count() == len(kv.store)  # only prefix-cache pages remain
        assert kv.store.evictable_count() == len(kv.store)


def test_littles_law_holds_on_a_steady_poisson_run() -> None:
    trace, cfg = _steady()
    res = Simulation(trace, cfg).run()
    df = res.requests
    series = res.timelines["in_system"]
    t0, t1 = 0.2 * trace.duration_s, 0.8 * trace.duration_s
    inside = series[(series.index >= t0) & (series.index < t1)]
    measured = inside.mean()  # L: engines' own count of requests present, sampled each second
    window = df[(df["arrival_s"] >= t0) & (df["arrival_s"] < t1)]
    predicted = 6.0 * window["e2e_s"].mean()  # λ (configured) × W
    assert measured == pytest.approx(predicted, rel=0.08)


def test_decode_back_pressure_holds_prefill_until_d_has_pages() -> None:
    # A small D pool (mem_fraction tuned down): each request reserves its prompt and output
    # pages, ceil((4000 + 49) / 64) = 64, so only pages // 64 fit at once.
    trace = mooncake_trace([(0.01 * i, 4000, 50, []) for i in range(40)])
    sim = Simulation(trace, small_config("1x1", "1x1", mem_fraction=0.2226))
    fit = sim.d_info[0].num_pages // 64
    assert fit == 3
    df = sim.run().requests
    events = sorted([(t, 1) for t in df["d_admit_s"]] + [(t, -1) for t in df["finish_s"]])
    held = np.cumsum([e for _, e in events])
    assert held.max() == fit
    assert ((df["d_admit_s"] - df["arrival_s"]) > 0.05).sum() >= 30
    # P never starts a request D has not admitted: its prefill waits for D's pages.
    assert (df["prefill_start_s"] >= df["d_admit_s"]).all()
    assert not df["rejected"].any()


def _run_frame(trace: Trace, cfg: SimConfig) -> pd.DataFrame:
    return Simulation(trace, cfg).run().requests


@pytest.mark.parametrize("policy", ["least_load", "prefix_aware"])
def test_seeded_runs_are_bit_for_bit_repeatable_across_processes(policy: str) -> None:
    # The routers' tie-break cursors are part of the run's state: repeatable too.
    trace = load_trace("mooncake").head(120)
    cfg = small_config("2x1", "2x1", routing=policy)
    first = _run_frame(trace, cfg)
    second = _run_frame(trace, cfg)
    pd.testing.assert_frame_equal(first, second, check_exact=True)
    with ProcessPoolExecutor(max_workers=1) as pool:
        third = pool.submit(_run_frame, trace, cfg).result()
    pd.testing.assert_frame_equal(first, third, check_exact=True)
    other = _run_frame(trace, replace(cfg, seed=5))
    assert not first["room"].equals(other["room"])


def _reference_decode(res: SimResult, cfg: SimConfig, engine: int) -> dict[int, np.ndarray]:
    """Token times of one D engine by stepping one decode step at a time in plain Python.

    Steps run back to back while any request is running; a request whose KV lands at t joins
    the first step that starts at or after t (at once if the engine is idle).
    """
    from tspd_sim.specs import gpu_spec, model_spec

    cost = cfg.calibration.cost_model(model_spec(cfg.cluster.model), gpu_spec("h100"), 1)
    df = res.requests[res.requests["d_engine"] == engine].sort_values("kv_arrived_s")
    pending = [
        (float(r.kv_arrived_s), int(i), int(r.input_len), int(r.output_len) - 1)
        for i, r in df.iterrows()
        if r.output_len > 1
    ]
    running: list[list[int]] = []  # [idx, ctx, left]
    times: dict[int, list[float]] = {i: [] for _, i, _, _ in pending}
    now = 0.0
    while pending or running:
        if not running:
            now = max(now, pending[0][0])
        while pending and pending[0][0] <= now:
            _, i, inp, left = pending.pop(0)
            running.append([i, inp + 1, left])
        now += cost.decode_time(len(running), sum(r[1] for r in running))
        for r in running:
            times[r[0]].append(now)
            r[1] += 1
            r[2] -= 1
        running = [r for r in running if r[2] > 0]
    return {i: np.array(t) for i, t in times.items()}


def test_macro_steps_match_a_step_by_step_reference() -> None:
    trace = synthetic(200, 3.0, "lognormal:800:0.5", "uniform:1:300", seed=4)
    cfg = small_config("2x1", "1x1", routing="round_robin")
    res = Simulation(trace, cfg).run()
    ref = _reference_decode(res, cfg, 0)
    assert len(ref) == int((res.requests["output_len"] > 1).sum())
    for i, expect in ref.items():
        got = res.token_times(i)[1:]
        np.testing.assert_allclose(got, expect, rtol=1e-9, atol=1e-9)
    itl = res.itl()
    assert len(itl) == int((res.requests["output_len"] - 1).sum())
    every = np.concatenate([np.diff(res.token_times(i)) for i in res.requests.index])
    np.testing.assert_allclose(np.sort(itl), np.sort(every), rtol=1e-12)


def test_one_event_per_step_baseline_gives_the_same_run() -> None:
    trace = load_trace("mooncake").head(60)
    cfg = small_config("2x1", "2x1", routing="prefix_aware")
    fast = Simulation(trace, cfg).run()
    slow = Simulation(trace, replace(cfg, decode_horizon=1)).run()
    assert slow.info["decode_steps"] == fast.info["decode_steps"]
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=False, rtol=1e-12)
    for a, b in zip(fast.logs, slow.logs, strict=True):
        np.testing.assert_allclose(a.ends, b.ends, rtol=1e-12)
        assert np.array_equal(a.sizes, b.sizes)
