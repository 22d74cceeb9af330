"""``decode_rounds``: a D engine that works in rounds admits between steps and sends a first
token on with the end of the request's first decode step — exact times on a constructed case
(1.05 s prefill steps, 0.1 s decode steps, a network that costs nothing but a tiny transfer,
eps: so no landing coincides with a step boundary). The first token leaves D only behind a
router holding it (``early_first_token=False``); with the default router it leaves P."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tspd_sim.cost.calibration import Calibration, EngineCalibration
from tspd_sim.cost.fitted import DecodeCoeffs, FittedCost, PrefillCoeffs
from tspd_sim.network import NetKnobs
from tspd_sim.sim import Simulation
from tspd_sim.testing import mooncake_trace, small_config

STEPS = Calibration(
    engines=(
        EngineCalibration(
            "llama-3-8b", "h100", 1,
            fitted=FittedCost(PrefillCoeffs(1.05, 0.0, 0.0, 0.0), DecodeCoeffs(0.1, 0.0, 0.0)),
        ),
    )
)  # fmt: skip
FAST = NetKnobs(latency_s=0.0, per_descriptor_s=0.0, efficiency=1.0, nic_bw=1e15)
# A: 12 decode steps from its KV on; B: 2, its prompt prefilled after A's; C arrives while
# D steps A's batch.
TRACE = mooncake_trace([(0.0, 64, 13, []), (0.25, 64, 3, []), (1.6, 64, 2, [])])


def _run(rounds: bool) -> dict[str, list[float]]:
    """The trace behind a router that holds the first token for D's."""
    cfg = small_config(layerwise=False, decode_rounds=rounds, early_first_token=False)
    cfg = replace(cfg, calibration=STEPS, net=FAST)
    frame = Simulation(TRACE, cfg).run().requests
    return {c: frame[c].tolist() for c in frame.columns}


def test_without_rounds_the_first_token_leaves_with_the_kv() -> None:
    r = _run(False)
    eps = r["kv_arrived_s"][0] - r["prefill_end_s"][0]  # one 1-page transfer on 1e15 B/s
    assert 0 < eps < 1e-6
    assert r["d_admit_s"] == [0.0, 0.25, 1.6]  # at once
    assert r["first_token_s"] == r["kv_arrived_s"]
    assert r["first_token_s"][0] == pytest.approx(1.05 + eps, abs=1e-12)
    assert r["first_token_s"][1] == pytest.approx(2.10 + eps, abs=1e-12)
    # B joins A's batch at its next boundary (A steps from 1.05 + eps, every 0.1 s).
    assert r["first_step_end_s"][1] == pytest.approx(2.25 + eps, abs=1e-9)


def test_in_rounds_d_admits_between_steps_and_the_first_token_waits_for_a_step() -> None:
    r = _run(True)
    eps = r["kv_arrived_s"][0] - r["prefill_end_s"][0]
    # A reaches an idle D (admitted at once); its first token leaves with its first step.
    assert r["d_admit_s"][:2] == [0.0, 0.25]
    assert r["first_token_s"][0] == pytest.approx(1.15 + eps, abs=1e-9)
    assert r["first_token_s"][0] == r["first_step_end_s"][0]
    # B's KV lands at 2.10 + eps, inside A's step 2.05 + eps .. 2.15 + eps: B joins at
    # 2.15 + eps and its first token leaves at the end of its first step.
    assert r["kv_arrived_s"][1] == pytest.approx(2.10 + eps, abs=1e-12)
    assert r["first_token_s"][1] == pytest.approx(2.25 + eps, abs=1e-9)
    assert r["ttft_s"][1] == pytest.approx(2.25 + eps - 0.25, abs=1e-9)
    # C arrives at 1.6, inside A's step 1.55 + eps .. 1.65 + eps: admitted at its end.
    assert r["d_admit_s"][2] == pytest.approx(1.65 + eps, abs=1e-9)
    # The transfer itself is the same as without rounds; only when the token leaves moved.
    assert r["transfer_s"] == pytest.approx(_run(False)["transfer_s"], abs=1e-12)
    # The last token is where it was: rounds move the first token, not the decode steps.
    assert r["finish_s"][0] == pytest.approx(1.05 + eps + 12 * 0.1, abs=1e-9)


@pytest.mark.parametrize("rounds", [False, True])
def test_an_early_first_token_leaves_as_the_prefill_ends(rounds: bool) -> None:
    # tspd's router passes P's first token on as P answers: TTFT is then the prefill's end,
    # whatever D does; the KV, D's admission and the decode steps are where they were.
    cfg = small_config(layerwise=False, decode_rounds=rounds, early_first_token=True)
    frame = Simulation(TRACE, replace(cfg, calibration=STEPS, net=FAST)).run().requests
    r = {c: frame[c].tolist() for c in frame.columns}
    assert r["first_token_s"] == r["prefill_end_s"] == pytest.approx([1.05, 2.10, 3.15])
    assert r["ttft_s"] == pytest.approx([1.05, 2.10 - 0.25, 3.15 - 1.6])
    held = _run(rounds)
    for column in ("kv_arrived_s", "d_admit_s", "first_step_end_s", "finish_s"):
        assert r[column] == pytest.approx(held[column], abs=1e-12)
