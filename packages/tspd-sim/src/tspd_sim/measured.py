"""A measured run's per-request table, and its comparison with a simulated replay.

The trace replay (``tspd-launch replay``, tspd_launch/replay.py) sends a trace's requests
to a real cluster at their arrival times and writes the simulator's own per-request table
(:mod:`tspd_sim.records`): the columns a client observes are filled in — :data:`MEASURED`:
the request's index, its arrival (when it was due, from the first arrival), its prompt and
output lengths, when its first token and its last arrived, and the error of a failed request
in ``reject_reason`` — and the columns only a simulation knows (engines, rooms, transfer
bytes, prefill start and end ...) are null. Its ``arrival_s``, ``input_len`` and ``output_len``
are the trace itself, so :func:`trace_of` replays exactly those requests in the simulator.

:func:`figures` computes the headline numbers the same way from either table, and
:func:`compare` puts them side by side (``tspd-sim fidelity --real FILE``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from tspd_sim.errors import SpecError
from tspd_sim.records import REQUEST_FIELDS, derive
from tspd_sim.traces import Trace

#: The columns a measured table must fill in (the rest of the simulator's may be null).
MEASURED = (
    "idx", "arrival_s", "input_len", "output_len", "first_token_s", "finish_s", "reject_reason",
)  # fmt: skip

#: The figures :func:`compare` reports, with the relative error each one's goal allows (issue
#: 19: p50 within 20 %, p90 within 35 %; throughput has none).
GOALS: dict[str, float | None] = {
    "ttft_p50_s": 0.20,
    "ttft_p90_s": 0.35,
    "tpot_p50_s": 0.20,
    "tpot_p90_s": 0.35,
    "throughput_rps": None,
    "output_tok_s": None,
}


def write_requests(path: str | Path, columns: Mapping[str, Sequence[Any]]) -> Path:
    """Write a measured run's per-request table to ``path`` (Parquet, or CSV by its suffix):
    every column of the simulator's (:data:`tspd_sim.records.REQUEST_FIELDS`, then the derived
    ones: ``ttft_s``, ``tpot_s`` ...), those ``columns`` names filled in — at least
    :data:`MEASURED` — and every other null, rows in ``columns``' order."""
    missing = [c for c in MEASURED if c not in columns]
    unknown = set(columns) - {name for name, _, _ in REQUEST_FIELDS}
    if missing or unknown:
        raise SpecError(f"measured columns: missing {missing}, unknown {sorted(unknown)}")
    n = len(columns["idx"])
    raw: dict[str, npt.NDArray[Any]] = {}
    arrays: dict[str, pa.Array] = {}
    for name, _, kind in REQUEST_FIELDS:
        given = columns.get(name)
        if given is not None and len(given) != n:
            raise SpecError(f"measured column {name}: {len(given)} values for {n} requests")
        arrays[name] = pa.array(given if given is not None else [None] * n, type=kind)
        float_col = kind == pa.float64()
        raw[name] = (
            arrays[name].to_numpy(zero_copy_only=False)
            if float_col or given is not None
            else np.zeros(n)
        )
    for name, values in derive(raw).items():
        arrays[name] = pa.array(values)
    table = pa.table(arrays)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".csv":
        table.to_pandas().to_csv(out, index=False)
    else:
        pq.write_table(table, out)
    return out


def read_requests(path: str | Path) -> pd.DataFrame:
    """A per-request table (Parquet, or CSV by its suffix), one row per request in index order;
    :class:`SpecError` when a :data:`MEASURED` column is missing."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"per-request table {p} does not exist")
    try:
        frame = pd.read_csv(p) if p.suffix == ".csv" else pd.read_parquet(p)
    except (ValueError, OSError) as exc:
        raise SpecError(f"per-request table {p}: cannot read it ({exc})") from exc
    missing = [c for c in MEASURED if c not in frame.columns]
    if missing:
        raise SpecError(f"per-request table {p}: missing column(s) {missing}")
    frame["reject_reason"] = frame["reject_reason"].fillna("").astype(str)
    frame = frame.sort_values("idx", kind="stable").reset_index(drop=True)
    if not len(frame) or (frame["idx"].to_numpy() != np.arange(len(frame))).any():
        raise SpecError(f"per-request table {p}: 'idx' must number the requests 0..n-1")
    return frame


def trace_of(frame: pd.DataFrame, name: str = "measured") -> Trace:
    """The requests of a per-request table as a trace (arrivals, prompt and output lengths;
    no prefix identities)."""
    n = len(frame)
    return Trace(
        name,
        frame["arrival_s"].to_numpy(dtype=np.float64),
        frame["input_len"].to_numpy(dtype=np.int64),
        frame["output_len"].to_numpy(dtype=np.int64),
        np.zeros(n + 1, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        0,
    )


def figures(frame: pd.DataFrame) -> dict[str, float]:
    """Headline numbers of a per-request table, measured or simulated alike: requests,
    completed, failed; span (first arrival to last finish), throughput in requests and output
    tokens per second; TTFT, TPOT and E2E medians and 90th percentiles (seconds) of the
    completed requests (TPOT of those with more than one token)."""
    done = frame["reject_reason"].fillna("").astype(str).to_numpy() == ""
    arrival = frame["arrival_s"].to_numpy(dtype=np.float64)
    first = frame["first_token_s"].to_numpy(dtype=np.float64)
    finish = frame["finish_s"].to_numpy(dtype=np.float64)
    out_len = frame["output_len"].to_numpy(dtype=np.int64)
    span = float(finish[done].max() - arrival.min()) if done.any() else 0.0
    out: dict[str, float] = {
        "requests": float(len(frame)),
        "completed": float(done.sum()),
        "failed": float((~done).sum()),
        "span_s": span,
        "throughput_rps": float(done.sum()) / span if span else 0.0,
        "output_tok_s": float(out_len[done].sum()) / span if span else 0.0,
    }
    decoded = done & (out_len > 1)
    values = {
        "ttft": (first - arrival)[done],
        "tpot": ((finish - first)[decoded] / (out_len[decoded] - 1)),
        "e2e": (finish - arrival)[done],
    }
    for name, v in values.items():
        for q in (50, 90):
            out[f"{name}_p{q}_s"] = float(np.percentile(v, q)) if len(v) else float("nan")
    return out


def compare(real: dict[str, float], simulated: dict[str, float]) -> pd.DataFrame:
    """One row per figure of :data:`GOALS`: the measured and simulated values, the relative
    error (simulated / measured − 1), the goal's bound and whether it was met (None where
    there is no goal)."""
    rows = []
    for name, bound in GOALS.items():
        r, s = real[name], simulated[name]
        error = s / r - 1 if r else float("nan")
        met = None if bound is None else bool(abs(error) <= bound)
        row = {"figure": name, "measured": r, "simulated": s, "error": error}
        rows.append(row | {"goal": bound, "met": met})
    return pd.DataFrame(rows)
