"""Cost models: roofline arithmetic, fidelity against SplitwiseSim, calibration overrides."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tspd_sim.cost.calibration import (
    Calibration,
    bundled_measurements,
    load_calibration,
    parse_calibration,
)
from tspd_sim.cost.fitted import DecodeCoeffs, FittedCost, PrefillCoeffs, fit_step_model
from tspd_sim.cost.roofline import RooflineCost, RooflineKnobs
from tspd_sim.errors import SpecError
from tspd_sim.specs import gpu_spec, model_spec
from tspd_sim.testing import fields_close

# SplitwiseSim (Patel et al., ISCA 2024), data/perf_model.csv, Llama-2-70B on DGX-H100 at TP 8,
# medians of five runs: (what, measured seconds).
SPLITWISE = {
    "prefill 1k": 0.0779,
    "prefill 4k": 0.3903,
    "decode batch 1": 0.02976,
    "decode batch 64": 0.05016,
}


def _predict(cost: RooflineCost | FittedCost) -> dict[str, float]:
    one = np.zeros(1, dtype=np.int64)
    return {
        "prefill 1k": cost.prefill_time(np.array([1024]), one),
        "prefill 4k": cost.prefill_time(np.array([4096]), one),
        # SplitwiseSim's decode rows: 512-token prompts, 128 generated -> mean context 576.
        "decode batch 1": cost.decode_time(1, 576),
        "decode batch 64": cost.decode_time(64, 64 * 576),
    }


def test_roofline_defaults_within_2x_of_splitwise_measurements() -> None:
    cost = Calibration().cost_model(model_spec("llama-2-70b"), gpu_spec("h100"), 8)
    assert isinstance(cost, RooflineCost)
    pred = _predict(cost)
    ratios = {k: pred[k] / SPLITWISE[k] for k in SPLITWISE}
    # The report of docs/simulator.md: the roofline is optimistic against 2023 vLLM numbers.
    assert all(0.5 <= r <= 2.0 for r in ratios.values()), ratios


def test_bundled_calibration_overrides_defaults_and_fits_within_25pct() -> None:
    cal = load_calibration("splitwise")
    cost = cal.cost_model(model_spec("llama-2-70b"), gpu_spec("h100"), 8)
    assert isinstance(cost, FittedCost)
    assert cal.describe(model_spec("llama-2-70b"), gpu_spec("h100"), 8) == "fitted"
    # Other engines keep the roofline.
    assert isinstance(cal.cost_model(model_spec("llama-3-8b"), gpu_spec("h100"), 1), RooflineCost)
    pred = _predict(cost)
    for key, measured in SPLITWISE.items():
        assert pred[key] == pytest.approx(measured, rel=0.25), key


def test_fit_reproduces_the_bundled_calibration_file() -> None:
    fitted = fit_step_model(bundled_measurements())
    bundled = load_calibration("splitwise").engines[0].fitted
    assert bundled is not None
    # A fit's last bits depend on the OpenBLAS kernel; 1e-9 relative is far below any effect.
    assert fields_close(fitted.prefill, bundled.prefill, rel=1e-9) == []
    assert fields_close(fitted.decode, bundled.decode, rel=1e-9) == []


def test_fields_close_names_each_field_past_the_tolerance() -> None:
    a = DecodeCoeffs(const_s=1.0, per_seq_s=2.0, per_ctx_token_s=3.0)
    b = DecodeCoeffs(const_s=1.0 + 1e-12, per_seq_s=2.0 * (1 + 1e-6), per_ctx_token_s=3.0)
    assert fields_close(a, b, rel=1e-9) == [f"per_seq_s: 2.0 != {2.0 * (1 + 1e-6)!r}"]
    assert fields_close(a, b, rel=1e-5) == []
    with pytest.raises(TypeError, match="not two dataclasses of one type"):
        fields_close(a, PrefillCoeffs(1.0, 2.0, 3.0, 4.0))


def test_roofline_arithmetic_for_a_memory_bound_decode_step() -> None:
    knobs = RooflineKnobs(
        mfu=1.0,
        attn_mfu=1.0,
        mbu=1.0,
        step_overhead_s=0,
        layer_overhead_s=0,
        seq_overhead_s=0,
        allreduce_latency_s=0,
    )
    m, g = model_spec("llama-3-8b"), gpu_spec("h100")
    cost = RooflineCost(m, g, 1, knobs)
    # Batch 1 at TP 1: all weights plus 1000 tokens of KV, once, at HBM rate (memory-bound).
    weights = (m.shared_params + m.lm_head_params) * 2
    expect = weights / g.hbm_bw + 1000 * m.kv_bytes_per_token(1) / g.hbm_bw
    assert cost.decode_time(1, 1000) == pytest.approx(expect, rel=1e-12)
    steps = cost.decode_times(4, 4000, 3)
    assert steps[2] - steps[1] == pytest.approx(4 * m.kv_bytes_per_token(1) / g.hbm_bw)


def test_calibration_overrides_knobs_globally_and_per_engine(tmp_path: Path) -> None:
    doc = {
        "roofline": {"mfu": 0.2},
        "engines": [
            {"model": "llama-3-8b", "gpu": "h100", "tp": 2, "roofline": {"step_overhead_s": 0.5}}
        ],
    }
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    cal = load_calibration(path)
    one = cal.cost_model(model_spec("llama-3-8b"), gpu_spec("h100"), 1)
    two = cal.cost_model(model_spec("llama-3-8b"), gpu_spec("h100"), 2)
    assert isinstance(one, RooflineCost)
    assert isinstance(two, RooflineCost)
    assert (one.knobs.mfu, one.knobs.step_overhead_s) == (0.2, RooflineKnobs().step_overhead_s)
    assert (two.knobs.mfu, two.knobs.step_overhead_s) == (0.2, 0.5)
    toml = tmp_path / "cal.toml"
    toml.write_text("[roofline]\nmbu = 0.5\n")
    assert load_calibration(toml).knobs == {"mbu": 0.5}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"rooflin": {}}, "unknown key"),
        ({"roofline": {"mfu": 2.0}}, "must be in"),
        ({"roofline": {"speed": 1}}, "unknown roofline knob"),
        ({"engines": [{"model": "x"}]}, "needs model, gpu, tp"),
        (
            {"engines": [{"model": "x", "gpu": "h100", "tp": 1, "fitted": {}}]},
            "needs 'prefill', 'decode' or both",
        ),
        (
            {"engines": [{"model": "x", "gpu": "h100", "tp": 1, "fitted": {"prefil": {}}}]},
            "needs 'prefill', 'decode' or both",
        ),
        (
            {"engines": [{"model": "x", "gpu": "h100", "tp": 1, "fitted": {"prefill": {}}}]},
            r"fitted\.prefill: needs exactly the keys",
        ),
    ],
)
def test_calibration_rejections(doc: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_calibration(doc)


def test_unknown_names_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="unknown model 'gpt-5'"):
        model_spec("gpt-5")
    with pytest.raises(SpecError, match="unknown GPU"):
        gpu_spec("tpu")
    with pytest.raises(SpecError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")


def test_model_parameter_counts_match_published_sizes() -> None:
    assert model_spec("llama-3-8b").total_params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert model_spec("llama-3-70b").total_params / 1e9 == pytest.approx(70.55, abs=0.01)
    dsv3 = model_spec("deepseek-v3")
    assert dsv3.total_params / 1e9 == pytest.approx(671, abs=1)
    assert dsv3.active_params / 1e9 == pytest.approx(37, abs=1)
    # MLA latent (512 + 64) x 2 bytes x 61 layers, identical on every TP rank.
    assert dsv3.kv_bytes_per_token(1) == dsv3.kv_bytes_per_token(8) == 61 * 576 * 2
    # GQA: 8 KV heads split over TP, replicated beyond 8 ranks.
    assert model_spec("llama-3-8b").kv_bytes_per_token(4) == 32 * 2 * 2 * 128 * 2


def test_fidelity_table_reports_the_headline_points() -> None:
    from tspd_sim.cost.fidelity import fidelity_table

    table = fidelity_table(headline_only=True)
    assert table[["phase", "batch", "tokens"]].values.tolist() == [
        ["prefill", 1, 1024],
        ["prefill", 1, 4096],
        ["decode", 1, 1],
        ["decode", 64, 1],
    ]
    assert table["ratio"].between(0.5, 2.0).all()
    assert table["measured_s"].tolist() == list(SPLITWISE.values())
    fitted = fidelity_table(load_calibration("splitwise"))
    assert len(fitted) == 26
    assert fitted["ratio"].between(0.75, 1.35).all()


def test_calibrate_and_fidelity_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import resources

    from tspd_sim.cli import main
    from tspd_sim.cost.calibration import BUNDLED_MEASUREMENTS

    csv = tmp_path / "m.csv"
    csv.write_text(
        resources.files("tspd_sim.data.calibration").joinpath(BUNDLED_MEASUREMENTS).read_text()
    )
    out = tmp_path / "cal.json"
    assert (
        main(
            [
                "calibrate",
                str(csv),
                "--model",
                "llama-2-70b",
                "--gpu",
                "h100",
                "--tp",
                "8",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    cal = load_calibration(out)
    assert cal.engines[0].fitted is not None
    bundled = load_calibration("splitwise").engines[0].fitted
    assert bundled is not None
    assert fields_close(cal.engines[0].fitted.decode, bundled.decode, rel=1e-9) == []
    capsys.readouterr()
    assert main(["fidelity", "--calibration", str(out)]) == 0
    assert "geometric mean 0.98" in capsys.readouterr().out
