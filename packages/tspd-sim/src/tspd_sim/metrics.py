"""Results of one run: the per-request DataFrame, token timing, percentiles, SLOs, timelines.

Timing definitions (seconds; see :mod:`tspd_sim.sim.request` for the life of a request):

==================  ===========================================================================
``queue_s``         arrival → prefill start: waiting for D's pages, then in P's queue
``prefill_s``       first chunk's step start → last chunk's step end on P
``transfer_s``      first byte leaves P → last byte lands on D (overlaps the prefill when
                    layerwise)
``xfer_exposed_s``  prefill end → first token on D: the transfer time *not* hidden
``ttft_s``          arrival → first token on D (= queue + prefill + exposed transfer)
``tpot_s``          (E2E − TTFT) / (output − 1), NaN for one-token outputs
``itl``             gaps between consecutive tokens of a request (token 2 − token 1, ...)
``e2e_s``           arrival → last token
==================  ===========================================================================

A request meets the SLO when ``ttft_s ≤ slo.ttft_s`` and ``tpot_s ≤ slo.tpot_s`` (one-token
outputs meet the TPOT part); rejected requests never do. The **SLO-met rate**
(``slo_met_rps``) counts requests meeting the SLO per second of the run (first arrival to last
finish), in total and per GPU (``slo_met_rps_per_gpu``). It is what this replay delivered at
its offered rate, not a capacity: the *capacity* (DistServe's per-GPU goodput) is the highest
offered rate at which a configuration still meets the SLO for a target share of requests,
found by :func:`tspd_sim.search.capacity_search` (``capacity_rps``, ``capacity_rps_per_gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tspd_sim.errors import SpecError
from tspd_sim.timeline import build_timelines

if TYPE_CHECKING:
    from tspd_sim.sim.finished import FinishedRun
    from tspd_sim.sim.request import SimRequest

F64 = npt.NDArray[np.float64]
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives (defaults: an interactive chat service on long prompts)."""

    ttft_s: float = 3.0
    tpot_s: float = 0.05

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise SpecError(f"SLO {self}: both targets must be > 0 seconds")


@dataclass(frozen=True, slots=True)
class EngineLog:
    """One D engine's committed decode steps: end times, batch size per step, and per step
    the number of requests that also took the step before (the weight of the gap ending at
    it in the inter-token latency distribution)."""

    ends: F64
    sizes: npt.NDArray[np.int64]
    gap_weights: npt.NDArray[np.int64]


class SimResult:
    """Everything a run measured. Pure data: picklable, cheap to summarise repeatedly."""

    def __init__(
        self,
        requests: pd.DataFrame,
        logs: list[EngineLog],
        timelines: dict[str, Any],
        info: dict[str, Any],
        segments: pd.DataFrame | None = None,
    ) -> None:
        self.requests = requests
        #: Runs of decode steps of preempted requests: request, seg, start_step, steps.
        self.segments = segments if segments is not None else _segment_frame([])
        self._columns: dict[str, npt.NDArray[Any]] = {}
        self.logs = logs
        self.timelines = timelines
        self.info = info

    # ---- tokens ----------------------------------------------------------------------------------

    def token_times(self, idx: int) -> F64:
        """Simulated times of every output token of request ``idx`` (token 1 arrives with the
        KV; token k ≥ 2 at the end of the request's (k−1)-th decode step)."""
        col = self._column
        if col("rejected")[idx]:
            return np.zeros(0)
        first = float(col("first_token_s")[idx])
        n = int(col("output_len")[idx])
        if n == 1:
            return np.array([first])
        log = self.logs[int(col("d_engine")[idx])]
        runs = [(int(col("join_step")[idx]), n - 1)]
        if col("preemptions")[idx]:
            seg = self.segments[self.segments["request"] == idx]
            runs = list(zip(seg["start_step"].tolist(), seg["steps"].tolist(), strict=True))
        return np.concatenate([[first], *(log.ends[j : j + k] for j, k in runs)])

    def _column(self, name: str) -> npt.NDArray[Any]:
        """A request column as a numpy array indexed by request index (cached)."""
        got = self._columns.get(name)
        if got is None:
            got = self._columns[name] = self.requests[name].to_numpy()
        return got

    def itl(self) -> F64:
        """Every inter-token latency of every request (vectorised over the step logs; requests
        that were preempted one by one)."""
        df = self.requests[~self.requests["rejected"] & (self.requests["output_len"] > 1)]
        moved = df["preemptions"] > 0
        parts = [np.diff(self.token_times(int(i))) for i in df.index[moved]]
        df = df[~moved]
        parts.append((df["first_step_end_s"] - df["first_token_s"]).to_numpy())
        for e, log in enumerate(self.logs):
            mine = df[df["d_engine"] == e]
            if len(log.ends) < 2 or mine.empty:
                continue
            gaps = np.diff(log.ends)  # gaps[k-1] = end of step k − end of step k−1
            # A request uses gap k for k in (join, join + output − 2]: count per k by a
            # difference array instead of expanding every request's token range.
            start = mine["join_step"].to_numpy() + 1
            stop = mine["join_step"].to_numpy() + mine["output_len"].to_numpy() - 1
            weight = np.zeros(len(log.ends) + 1, dtype=np.int64)
            np.add.at(weight, start, 1)
            np.add.at(weight, stop, -1)
            use = np.cumsum(weight)[1 : len(log.ends)]
            parts.append(np.repeat(gaps, use))
        return np.concatenate(parts)

    def token_frame(self) -> pd.DataFrame:
        """Long table of every token: request, token index (1-based), time. Large."""
        rows = [(i, self.token_times(i)) for i in self.requests.index]
        idx = np.concatenate([np.full(len(t), i) for i, t in rows]) if rows else np.zeros(0)
        tok = np.concatenate([np.arange(1, len(t) + 1) for _, t in rows]) if rows else idx
        times = np.concatenate([t for _, t in rows]) if rows else np.zeros(0)
        return pd.DataFrame({"request": idx, "token": tok, "time_s": times})

    # ---- summaries -------------------------------------------------------------------------------

    def attainment(self, slo: Slo) -> pd.Series:
        """Per request: whether it met ``slo`` (rejected requests never do)."""
        df = self.requests
        ok_tpot = df["tpot_s"].isna() | (df["tpot_s"] <= slo.tpot_s)
        return (~df["rejected"]) & (df["ttft_s"] <= slo.ttft_s) & ok_tpot

    def summary(self, slo: Slo | None = None) -> dict[str, float]:
        """Headline numbers: counts, throughput, percentiles, SLO attainment, SLO-met rate."""
        slo = slo or Slo()
        df = self.requests
        done = df[~df["rejected"]]
        span = float(done["finish_s"].max() - df["arrival_s"].min()) if len(done) else 0.0
        met = self.attainment(slo)
        gpus = float(self.info["gpus"])
        out: dict[str, float] = {
            "requests": float(len(df)),
            "completed": float(len(done)),
            "rejected": float(df["rejected"].sum()),
            "span_s": span,
            "throughput_rps": len(done) / span if span else 0.0,
            "output_tok_s": float(done["output_len"].sum()) / span if span else 0.0,
            "slo_attainment": float(met.mean()) if len(df) else 0.0,
            "slo_met_rps": float(met.sum()) / span if span else 0.0,
            "preemptions": float(df["preemptions"].sum()),
            "preempted_requests": float((df["preemptions"] > 0).sum()),
            "recomputed_tokens": float(df["recomputed_tokens"].sum()),
            "swap_bytes": float(df["swap_bytes"].sum()),
        }
        out["slo_met_rps_per_gpu"] = out["slo_met_rps"] / gpus
        for col in ("ttft_s", "tpot_s", "e2e_s", "queue_s", "xfer_exposed_s"):
            _percentiles(out, col.removesuffix("_s"), done[col].dropna().to_numpy())
        _percentiles(out, "itl", self.itl())
        out.update(self._transfer_summary(done))
        out.update({k: float(v) for k, v in self.info.items() if isinstance(v, int | float)})
        return out

    def _transfer_summary(self, done: pd.DataFrame) -> dict[str, float]:
        inp = float(done["input_len"].sum()) or 1.0
        return {
            "transfer_bytes": float(done["transfer_bytes"].sum()),
            "transfer_descriptors": float(done["transfer_descriptors"].sum()),
            "transfer_mean_s": float(done["transfer_s"].mean()) if len(done) else 0.0,
            "p_prefix_hit_frac": float(done["p_hit_tokens"].sum()) / inp,
            "d_prefix_hit_frac": float(done["d_hit_tokens"].sum()) / inp,
        }


def _percentiles(out: dict[str, float], name: str, values: F64) -> None:
    out[f"{name}_mean"] = float(values.mean()) if len(values) else float("nan")
    for q in QUANTILES:
        value = float(np.quantile(values, q)) if len(values) else float("nan")
        out[f"{name}_p{round(q * 100)}"] = value


# ---- building a result from a finished simulation ----------------------------------------------


def build_result(sim: FinishedRun, wall_s: float) -> SimResult:
    """Collect a finished simulation into a :class:`SimResult`."""
    logs = [EngineLog(d.log.ends(), d.log.sizes(), d.log.gap_weights()) for d in sim.d_engines]
    df = _request_frame(sim)
    info: dict[str, Any] = {
        "gpus": sim.config.cluster.gpus,
        "wall_s": wall_s,
        "sim_requests_per_wall_s": len(sim.trace) / wall_s if wall_s > 0 else 0.0,
        "prefill_steps": sum(p.steps for p in sim.p_engines),
        "decode_steps": sum(d.n_steps for d in sim.d_engines),
        "cluster": sim.config.cluster.label(),
        "trace": sim.trace.name,
        "routing": sim.config.routing.policy,
        "preemptions_by_engine": {
            f"D{i}": d.preempt.count for i, d in enumerate(sim.d_engines) if d.preempt
        },
    }
    segments = _segment_frame([r for r in sim.requests if r.segments])
    return SimResult(df, logs, build_timelines(sim), info, segments)


def _segment_frame(reqs: list[SimRequest]) -> pd.DataFrame:
    rows = [
        (r.idx, k, start, steps) for r in reqs for k, (start, steps) in enumerate(r.segments or [])
    ]
    return pd.DataFrame(rows, columns=["request", "seg", "start_step", "steps"], dtype=np.int64)


def _request_frame(sim: FinishedRun) -> pd.DataFrame:
    reqs = sim.requests
    col = {name: [getattr(r, attr) for r in reqs] for name, attr in _COLUMNS}
    df = pd.DataFrame(col).set_index("idx", drop=False)
    df.index.name = None
    df["rejected"] = df["reject_reason"] != ""
    df["queue_s"] = df["prefill_start_s"] - df["arrival_s"]
    df["prefill_s"] = df["prefill_end_s"] - df["prefill_start_s"]
    df["transfer_s"] = df["first_token_s"] - df["transfer_start_s"]
    df["xfer_exposed_s"] = df["first_token_s"] - df["prefill_end_s"]
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]
    decoded = df["output_len"] - 1
    df["tpot_s"] = (df["finish_s"] - df["first_token_s"]).where(decoded > 0) / decoded.where(
        decoded > 0
    )
    return df


_COLUMNS = (
    ("idx", "idx"),
    ("room", "room"),
    ("p_engine", "p_engine"),
    ("d_engine", "d_engine"),
    ("arrival_s", "arrival"),
    ("input_len", "input_len"),
    ("output_len", "output_len"),
    ("p_hit_tokens", "p_hit"),
    ("d_hit_tokens", "d_hit"),
    ("prefill_tokens", "computed"),
    ("chunks", "chunks"),
    ("d_admit_s", "t_d_admit"),
    ("prefill_start_s", "t_prefill_start"),
    ("prefill_end_s", "t_prefill_end"),
    ("transfer_start_s", "t_xfer_start"),
    ("first_token_s", "t_first_token"),
    ("finish_s", "t_finish"),
    ("transfer_bytes", "xfer_bytes"),
    ("transfer_descriptors", "xfer_desc"),
    ("join_step", "join_step"),
    ("first_step_end_s", "t_first_step"),
    ("preemptions", "preemptions"),
    ("recomputed_tokens", "recomputed"),
    ("swap_bytes", "swap_bytes"),
    ("reject_reason", "reject"),
)
