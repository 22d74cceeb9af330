"""Fidelity of a cost model against published measurements.

The reference points are SplitwiseSim's measured Llama-2-70B step times on a DGX-H100 at TP 8
(``data/calibration/splitwise_llama2_70b_h100_tp8.csv``, medians of five runs; Patel et al.,
ISCA 2024). :func:`fidelity_table` prices every point with a calibration's cost model and
reports the ratio predicted / measured.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tspd_sim.cost.calibration import Calibration, bundled_measurements
from tspd_sim.cost.fitted import Measurement
from tspd_sim.specs import gpu_spec, model_spec

#: The four headline points the issue names: prefill 1k and 4k tokens, decode batch 1 and 64.
HEADLINE = (("prefill", 1, 1024), ("prefill", 1, 4096), ("decode", 1, 576), ("decode", 64, 576))


def predict(cost: object, m: Measurement) -> float:
    """Seconds the cost model gives for one measured step."""
    if m.phase == "prefill":
        new = np.full(m.batch, m.new_tokens, dtype=np.int64)
        return float(cost.prefill_time(new, np.zeros(m.batch, dtype=np.int64)))  # type: ignore[attr-defined]
    return float(cost.decode_time(m.batch, round(m.batch * m.context)))  # type: ignore[attr-defined]


def fidelity_table(
    calibration: Calibration | None = None, headline_only: bool = False
) -> pd.DataFrame:
    """Predicted vs measured step time for every SplitwiseSim point (or the four headline
    ones): columns phase, batch, tokens, context, measured_s, predicted_s, ratio."""
    cal = calibration or Calibration()
    cost = cal.cost_model(model_spec("llama-2-70b"), gpu_spec("h100"), 8)
    rows = []
    for m in bundled_measurements():
        key = (m.phase, m.batch, m.new_tokens if m.phase == "prefill" else round(m.context))
        if headline_only and key not in HEADLINE:
            continue
        pred = predict(cost, m)
        rows.append(
            {
                "phase": m.phase,
                "batch": m.batch,
                "tokens": m.new_tokens,
                "context": m.context,
                "measured_s": m.seconds,
                "predicted_s": pred,
                "ratio": pred / m.seconds,
            }
        )
    return pd.DataFrame(rows)
