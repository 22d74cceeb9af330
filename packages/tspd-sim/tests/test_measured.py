"""Calibrating on a node's step log, and a measured run against its simulated replay.

The real nodes' logs and the real replay are exercised end to end in
tests/e2e/test_replay.py; here the same code runs on tables written by hand, so every
number is known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tspd_sim.cli import main
from tspd_sim.cluster import EngineTuning, GroupSpec, pages_for
from tspd_sim.cost.calibration import (
    STEP_LOG_COLUMNS,
    collect_steps,
    load_calibration,
    read_step_log,
)
from tspd_sim.cost.fitted import (
    DecodeCoeffs,
    FittedCost,
    PrefillCoeffs,
    StepSample,
    fit_phase,
)
from tspd_sim.cost.roofline import RooflineCost
from tspd_sim.errors import SpecError
from tspd_sim.measured import compare, figures, read_requests, trace_of
from tspd_sim.spec_files import load_model_file
from tspd_sim.specs import model_spec
from tspd_sim.testing import fields_close
from tspd_sim.traces import load_trace

PRE = PrefillCoeffs(const_s=0.05, per_token_s=0.007, per_pair_s=2e-7, per_seq_s=0.003)
DEC = DecodeCoeffs(const_s=0.09, per_seq_s=0.004, per_ctx_token_s=3e-6)
HEADER = ",".join(STEP_LOG_COLUMNS)


def _prefill_line(tp: int, chunks: list[tuple[int, int]], scale: float = 1.0) -> str:
    n = sum(k for k, _ in chunks)
    c = sum(c for _, c in chunks)
    pairs = sum(k * c + k * (k + 1) // 2 for k, c in chunks)
    t = PRE.const_s + PRE.per_token_s * n + PRE.per_pair_s * pairs + PRE.per_seq_s * len(chunks)
    return f"1.0,{t * scale:.9f},{tp},{len(chunks)},{n},{c},{pairs},0,0"


def _decode_line(tp: int, batch: int, keys: int, scale: float = 1.0) -> str:
    t = DEC.const_s + DEC.per_seq_s * batch + DEC.per_ctx_token_s * keys
    return f"2.0,{t * scale:.9f},{tp},0,0,0,0,{batch},{keys}"


def _prefill_log(tp: int, outlier: bool = False) -> str:
    shapes = [[(16, 0)], [(64, 0)], [(200, 0)], [(48, 32)], [(8, 0), (30, 0)], [(128, 64)],
              [(90, 0), (20, 16), (5, 0)], [(300, 0)]]  # fmt: skip
    lines = [_prefill_line(tp, s) for s in shapes]
    if outlier:  # a round another process held up five times as long
        lines.append(_prefill_line(tp, [(64, 0)], scale=5.0))
    return "\n".join([HEADER, *lines]) + "\n"


def _decode_log(tp: int) -> str:
    shapes = [(1, 80), (2, 200), (4, 300), (8, 900), (3, 150), (6, 1200), (1, 500), (5, 640)]
    return "\n".join([HEADER, *(_decode_line(tp, b, k) for b, k in shapes)]) + "\n"


def test_a_step_log_fit_recovers_the_coefficients_that_made_it() -> None:
    log = read_step_log(_prefill_log(3) + _decode_log(3).split("\n", 1)[1])
    assert log.mixed == 0
    assert [s.tp for s in log.samples] == [3] * 16
    assert log.samples[4] == StepSample("prefill", 2, 38, 36 + 465, 0, log.samples[4].seconds, 3)
    pre, dec = fit_phase(log.samples, "prefill"), fit_phase(log.samples, "decode")
    assert fields_close(pre.coeffs, PRE, rel=1e-6) == []
    assert fields_close(dec.coeffs, DEC, rel=1e-6) == []
    assert (pre.rows, pre.trimmed, dec.rows) == (8, 0, 8)
    assert pre.ratio_p50 == pytest.approx(1.0, abs=1e-6)


def test_trimming_leaves_out_a_stalled_round() -> None:
    samples = read_step_log(_prefill_log(1, outlier=True)).samples
    plain = fit_phase(samples, "prefill")
    assert fields_close(plain.coeffs, PRE, rel=0.01) != []  # one stall moves a plain fit
    trimmed = fit_phase(samples, "prefill", trim=True)
    assert (trimmed.rows, trimmed.trimmed) == (8, 1)
    assert fields_close(trimmed.coeffs, PRE, rel=1e-6) == []


def test_a_fit_in_seconds_predicts_the_mean_round_and_a_relative_one_the_fast_ones() -> None:
    # One decode shape whose rounds scatter as a shared machine's do (lognormal, sigma 0.5):
    # the simulator must reproduce the mean round. Relative least squares minimises
    # sum((c / y - 1)^2): c = sum(1/y) / sum(1/y^2), well below the mean.
    seconds = 0.1 * np.random.default_rng(0).lognormal(0.0, 0.5, 400)
    rows = [StepSample("decode", 2, 2, 0.0, 300.0, float(t), 1) for t in seconds]
    plain = fit_phase(rows, "decode", relative=False)
    c = plain.coeffs
    assert isinstance(c, DecodeCoeffs)
    assert c.const_s + 2 * c.per_seq_s + 300 * c.per_ctx_token_s == pytest.approx(seconds.mean())
    assert plain.total_ratio == pytest.approx(1.0)
    rel = fit_phase(rows, "decode", relative=True)
    inv = 1 / seconds
    assert rel.ratio_p50 < 0.8
    assert rel.total_ratio == pytest.approx(inv.sum() / (inv**2).sum() / seconds.mean())


def test_mixed_rounds_are_counted_and_left_out() -> None:
    text = HEADER + "\n1.0,0.5,1,1,20,0,210,1,21\n" + _decode_line(1, 2, 40) + "\n"
    log = read_step_log(text)
    assert log.mixed == 1
    assert [s.phase for s in log.samples] == ["decode"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("1.0,0.5,1,1,20\n", r"^log line 2: 5 fields$"),
        ("1.0,-0.5,1,1,20,0,210,0,0\n", r"^log line 2: seconds must be > 0 and tp ≥ 1$"),
        ("1.0,0.5,0,1,20,0,210,0,0\n", r"^log line 2: seconds must be > 0 and tp ≥ 1$"),
        ("1.0,0.5,1,0,0,0,0,0,0\n", r"^log line 2: counts must be ≥ 0 and the round must"),
        ("1.0,0.5,1,1,x,0,210,0,0\n", r"^log line 2: invalid literal for int"),
        ("1.0,nan,1,1,20,0,210,0,0\n", r"^log line 2: seconds must be > 0"),
    ],
)
def test_bad_step_log_lines_are_named(body: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        read_step_log(HEADER + "\n" + body, "log")


def test_a_file_that_is_no_step_log_is_refused() -> None:
    with pytest.raises(SpecError, match=r"^x\.csv: not a step log \(its header must be end_s,"):
        read_step_log("a,b\n1,2\n", "x.csv")


def test_calibrate_fits_one_engine_per_tp_from_a_prefill_and_a_decode_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # P at TP 3 logs prefill rounds only, D at TP 1 decode rounds only: each engine gets the
    # phase its node measured, and the roofline prices the other.
    (tmp_path / "prefill.csv").write_text(_prefill_log(3, outlier=True))
    (tmp_path / "decode.csv").write_text(_decode_log(1))
    out = tmp_path / "cal.json"
    argv = ["calibrate", str(tmp_path / "prefill.csv"), str(tmp_path / "decode.csv"),
            "--model", "llama-3-8b", "--gpu", "h100", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "engine llama-3-8b @ h100 TP 1:\n  prefill: fewer than 2 measured steps" in printed
    assert (
        "(8 steps, 1 trimmed; predicted/measured p10 1.00, p50 1.00, p90 1.00, in total 1.00)"
        in printed
    )
    doc = json.loads(out.read_text())
    assert [(e["tp"], sorted(e["fitted"])) for e in doc["engines"]] == [
        (1, ["decode"]),
        (3, ["prefill"]),
    ]
    cal = load_calibration(out)
    model, gpu = model_spec("llama-3-8b"), GroupSpec(1).gpu_spec
    p_cost, d_cost = cal.cost_model(model, gpu, 3), cal.cost_model(model, gpu, 1)
    assert isinstance(p_cost, FittedCost)
    assert isinstance(d_cost, FittedCost)
    assert fields_close(p_cost.prefill, PRE, rel=1e-6) == []
    assert fields_close(d_cost.decode, DEC, rel=1e-6) == []
    roofline = RooflineCost(model, gpu, 3)
    assert p_cost.decode_time(4, 4000) == roofline.decode_time(4, 4000)
    assert (cal.describe(model, gpu, 3), cal.describe(model, gpu, 1)) == (
        "fitted prefill",
        "fitted decode",
    )
    assert cal.describe(model, gpu, 2) == "roofline"


def test_calibrate_needs_the_tp_of_a_measurements_csv(tmp_path: Path) -> None:
    csv = tmp_path / "m.csv"
    csv.write_text("phase,batch,new_tokens,context,seconds\nprefill,1,128,0,0.1\n")
    with pytest.raises(SpecError, match=r"m\.csv: a measurements CSV does not say its engine's TP"):
        collect_steps([csv])
    rows, logged, mixed = collect_steps([csv], tp=2)
    assert (list(rows), logged, mixed) == ([2], set(), 0)


def test_calibrate_with_tp_keeps_only_that_engines_rounds(tmp_path: Path) -> None:
    log = tmp_path / "both.csv"
    log.write_text(_prefill_log(3) + _decode_log(1).split("\n", 1)[1])
    rows, logged, _ = collect_steps([log], tp=1)
    assert (list(rows), logged, {s.phase for s in rows[1]}) == ([1], {1}, {"decode"})


def _measured(tmp_path: Path) -> Path:
    frame = pd.DataFrame(
        {
            "idx": [2, 0, 1, 3],  # in the order they finished
            "arrival_s": [2.0, 0.0, 1.0, 3.0],
            "input_len": [30, 10, 20, 40],
            "output_len": [5, 3, 1, 4],
            "first_token_s": [2.5, 0.2, 1.4, np.nan],
            "finish_s": [3.3, 0.6, 1.4, 3.1],
            "reject_reason": ["", "", "", "502 prefill node failed"],
            "p_engine": [None, None, None, None],  # what only a simulation knows: null
        }
    )
    path = tmp_path / "requests.parquet"
    frame.to_parquet(path, index=False)
    return path


def test_figures_of_a_measured_table(tmp_path: Path) -> None:
    real = read_requests(_measured(tmp_path))
    assert real["idx"].tolist() == [0, 1, 2, 3]
    got = figures(real)
    # Completed: 0 (TTFT 0.2, TPOT 0.2, E2E 0.6), 1 (0.4, one token, 0.4), 2 (0.5, 0.2, 1.3);
    # 3 failed. Span 0 -> 3.3. np.percentile interpolates linearly: p90 of 3 = 0.8 of the top gap.
    want = {
        "requests": 4,
        "completed": 3,
        "failed": 1,
        "span_s": 3.3,
        "throughput_rps": 3 / 3.3,
        "output_tok_s": 9 / 3.3,
        "ttft_p50_s": 0.4,
        "ttft_p90_s": 0.4 + 0.8 * 0.1,
        "tpot_p50_s": 0.2,
        "tpot_p90_s": 0.2,
        "e2e_p50_s": 0.6,
        "e2e_p90_s": 0.6 + 0.8 * 0.7,
    }
    assert got == pytest.approx(want, rel=1e-12)
    trace = trace_of(real, "run")
    assert (trace.name, trace.input_len.tolist(), trace.output_len.tolist()) == (
        "run",
        [10, 20, 30, 40],
        [3, 1, 5, 4],
    )
    assert trace.arrival_s.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_compare_states_each_error_and_goal() -> None:
    real = {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "tpot_p50_s": 0.1, "tpot_p90_s": 0.2,
            "throughput_rps": 0.5, "output_tok_s": 10.0}  # fmt: skip
    sim = {"ttft_p50_s": 1.25, "ttft_p90_s": 1.4, "tpot_p50_s": 0.09, "tpot_p90_s": 0.2,
           "throughput_rps": 0.5, "output_tok_s": 12.0}  # fmt: skip
    table = compare(real, sim)
    assert table["figure"].tolist() == list(real)
    assert table["error"].to_numpy() == pytest.approx([0.25, -0.3, -0.1, 0.0, 0.0, 0.2])
    assert table["met"].tolist() == [False, True, True, True, None, None]
    assert table["goal"].tolist()[:4] == [0.2, 0.35, 0.2, 0.35]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.drop(columns=["finish_s"]), r"missing column\(s\) \['finish_s'\]"),
        (lambda f: f.assign(idx=[0, 1, 2, 5]), r"'idx' must number the requests 0\.\.n-1"),
    ],
)
def test_a_bad_measured_table_is_refused(tmp_path: Path, change: object, message: str) -> None:
    path = tmp_path / "bad.csv"
    change(pd.read_parquet(_measured(tmp_path))).to_csv(path, index=False)  # type: ignore[operator]
    with pytest.raises(SpecError, match=message):
        read_requests(path)
    with pytest.raises(SpecError, match="does not exist"):
        read_requests(tmp_path / "none.parquet")


def test_fidelity_replays_the_measured_requests_in_the_simulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = _measured(tmp_path)
    out = tmp_path / "fid"
    argv = ["fidelity", "--real", str(real), "--prefill", "1xtp1", "--decode", "1xtp1",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("4 requests of ")
    table = pd.read_csv(out / "fidelity.csv")
    assert table["figure"].tolist()[:2] == ["ttft_p50_s", "ttft_p90_s"]
    sim = pd.read_parquet(out / "requests.parquet")
    # The same four requests, every one completed in the simulation.
    assert sorted(sim["input_len"].tolist()) == [10, 20, 30, 40]
    assert (sim["reject_reason"] == "").all()
    assert table.loc[table["figure"] == "throughput_rps", "measured"].item() == pytest.approx(
        3 / 3.3
    )


def test_scale_lengths_keeps_the_shape_and_drops_prefix_ids() -> None:
    t = load_trace("azure-conv").head(5)
    assert (t.input_len.tolist(), t.output_len.tolist()) == ([374, 396, 879, 91, 91],
                                                             [44, 109, 55, 16, 16])  # fmt: skip
    s = t.scale_lengths(1 / 16, 1 / 8)
    assert (s.input_len.tolist(), s.output_len.tolist()) == ([23, 25, 55, 6, 6], [6, 14, 7, 2, 2])
    assert s.arrival_s.tolist() == t.arrival_s.tolist()
    assert t.scale_lengths(1 / 1000, 1 / 1000).input_len.tolist() == [1] * 5
    m = load_trace("mooncake").head(3)
    assert m.has_prefixes
    assert not m.scale_lengths(0.5).has_prefixes
    assert m.scale_lengths(1.0, 0.5).has_prefixes
    with pytest.raises(ValueError, match=r"^output length factor 0\.0: must be a finite number"):
        t.scale_lengths(1.0, 0.0)


def test_pages_can_be_fixed_as_an_engine_fixes_them(tmp_path: Path) -> None:
    spec = tmp_path / "m.toml"
    spec.write_text(
        '[model]\nname = "small"\nlayers = 2\nhidden = 64\nheads = 4\nkv_heads = 2\n'
        'intermediate = 128\nvocab = 100\nmax_context = 512\nweight_dtype = "float32"\n'
        'kv_dtype = "float32"\n'
    )
    model = load_model_file(spec)
    assert model.kv_bytes_per_token(1) == 2 * 2 * 2 * 16 * 4  # layers, K+V, heads, dim, fp32
    group = GroupSpec(1)
    assert pages_for(model, group, EngineTuning(num_pages=300)) == 300
    assert pages_for(model, group, EngineTuning()) > 300
    with pytest.raises(SpecError, match=r"^num_pages -1: must be ≥ 0"):
        EngineTuning(num_pages=-1)
