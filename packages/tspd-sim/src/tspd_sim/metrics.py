"""Results of one run: the per-request table, token timing, percentiles, SLOs, timelines.

The per-request rows were streamed to Parquet during the run (:mod:`tspd_sim.records`); a
:class:`SimResult` reads the columns it needs from there (``requests`` loads the whole table
as a DataFrame, on first use), the token times from the decode engines' step logs, and
computes every percentile exactly, the inter-token latencies' too (:mod:`tspd_sim.quantiles`).

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

import shutil
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from tspd_sim.errors import SpecError
from tspd_sim.quantiles import weighted_quantiles
from tspd_sim.steplog import StepLog
from tspd_sim.timeline import build_timelines

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tspd_sim.sim.finished import FinishedRun

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives (defaults: an interactive chat service on long prompts)."""

    ttft_s: float = 3.0
    tpot_s: float = 0.05

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise SpecError(f"SLO {self}: both targets must be > 0 seconds")


class EngineLog:
    """One D engine's committed decode steps: end times, batch size per step, and per step
    the number of requests that also took the step before (the weight of the gap ending at
    it in the inter-token latency distribution). The arrays are read on first use."""

    def __init__(self, log: StepLog) -> None:
        self.log = log

    @cached_property
    def ends(self) -> F64:
        return self.log.ends()

    @cached_property
    def sizes(self) -> I64:
        return self.log.sizes()

    @cached_property
    def gap_weights(self) -> I64:
        return self.log.gap_weights()


class SimResult:
    """Everything a run measured. The per-request rows live in ``requests_path`` (Parquet, in
    the order requests finished) and are read on demand; a result that is pickled (to or from
    a worker process) carries them in memory instead. ``tmp`` is the run's private folder
    (step logs, segments, and the rows when no output folder was given): removed when the
    result is garbage-collected."""

    def __init__(
        self,
        requests_path: Path,
        segments_path: Path,
        logs: list[StepLog],
        timelines: dict[str, Any],
        info: dict[str, Any],
        tmp: Path | None = None,
    ) -> None:
        self.requests_path: Path | None = requests_path
        self._segments_path: Path | None = segments_path
        self.logs = [EngineLog(log) for log in logs]
        self.timelines = timelines
        self.info = info
        self._frame: pd.DataFrame | None = None
        self._segments: pd.DataFrame | None = None
        self._columns: dict[str, npt.NDArray[Any]] = {}
        if tmp is not None:
            weakref.finalize(self, shutil.rmtree, tmp, True)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "segments": self.segments,
            "logs": [e.log.in_memory() for e in self.logs],
            "timelines": self.timelines,
            "info": self.info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.requests_path = self._segments_path = None
        self._frame, self._segments = state["requests"], state["segments"]
        self.logs = [EngineLog(log) for log in state["logs"]]
        self.timelines, self.info = state["timelines"], state["info"]
        self._columns = {}

    # ---- the tables ------------------------------------------------------------------------------

    @property
    def requests(self) -> pd.DataFrame:
        """One row per request, indexed by its index in the trace (loaded on first use)."""
        if self._frame is None:
            assert self.requests_path is not None
            df = pd.read_parquet(self.requests_path).sort_values("idx", kind="stable")
            df = df.set_index("idx", drop=False)
            df.index.name = None
            self._frame = df
        return self._frame

    @property
    def segments(self) -> pd.DataFrame:
        """Runs of decode steps of preempted requests: request, d_engine, seg, start_step,
        steps, gap_s (from the previous run's last token; NaN for the first run)."""
        if self._segments is None:
            assert self._segments_path is not None
            self._segments = pd.read_parquet(self._segments_path)
        return self._segments

    def column(self, name: str) -> npt.NDArray[Any]:
        """A request column as a numpy array indexed by request index (read once, cached)."""
        got = self._columns.get(name)
        if got is None:
            got = self._columns[name] = self._read(name)
        return got

    def _read(self, name: str) -> npt.NDArray[Any]:
        """A request column by request index, cached or read anew (not cached: summaries of
        long runs read each column once and drop it)."""
        got = self._columns.get(name)
        if got is not None:
            return got
        if self._frame is not None or self.requests_path is None:
            frame: npt.NDArray[Any] = self.requests[name].to_numpy()
            return frame
        raw = pq.read_table(self.requests_path, columns=[name]).column(0).to_numpy()
        out: npt.NDArray[Any] = np.empty_like(raw)
        out[self._order] = raw
        return out

    @cached_property
    def _order(self) -> I64:
        assert self.requests_path is not None
        idx = pq.read_table(self.requests_path, columns=["idx"]).column(0).to_numpy()
        return np.asarray(idx, dtype=np.int64)

    # ---- tokens ----------------------------------------------------------------------------------

    def token_times(self, idx: int) -> F64:
        """Simulated times of every output token of request ``idx`` (token 1 arrives with the
        KV; token k ≥ 2 at the end of the request's (k−1)-th decode step)."""
        col = self.column
        if col("rejected")[idx]:
            return np.zeros(0)
        first = float(col("first_token_s")[idx])
        n = int(col("output_len")[idx])
        if n == 1:
            return np.array([first])
        log = self.logs[int(col("d_engine")[idx])].log
        runs = [(int(col("join_step")[idx]), n - 1)]
        if col("preemptions")[idx]:
            seg = self.segments[self.segments["request"] == idx]
            runs = list(zip(seg["start_step"].tolist(), seg["steps"].tolist(), strict=True))
        return np.concatenate([[first], *(log.slice(j, k) for j, k in runs)])

    def _itl_blocks(self) -> Iterator[tuple[F64, I64]]:
        """The inter-token latencies as (value, count) blocks: every decode step's gap with the
        requests that saw it, each request's first gap, and the gaps across preemptions."""
        col = self._read
        decoded = ~col("rejected").astype(bool) & (col("output_len") > 1)
        first = (col("first_step_end_s") - col("first_token_s"))[decoded]
        yield first, np.ones(len(first), dtype=np.int64)
        across = self.segments["gap_s"].dropna().to_numpy()
        yield across, np.ones(len(across), dtype=np.int64)
        for e in self.logs:
            yield from e.log.blocks()

    def itl(self) -> F64:
        """Every inter-token latency of every request (expanded: large on long runs)."""
        parts = [np.repeat(v, w) for v, w in self._itl_blocks()]
        return np.concatenate(parts) if parts else np.zeros(0)

    def token_frame(self) -> pd.DataFrame:
        """Long table of every token: request, token index (1-based), time. Large."""
        rows = [(i, self.token_times(i)) for i in self.requests.index]
        idx = np.concatenate([np.full(len(t), i) for i, t in rows]) if rows else np.zeros(0)
        tok = np.concatenate([np.arange(1, len(t) + 1) for _, t in rows]) if rows else idx
        times = np.concatenate([t for _, t in rows]) if rows else np.zeros(0)
        return pd.DataFrame({"request": idx, "token": tok, "time_s": times})

    # ---- summaries -------------------------------------------------------------------------------

    def _met(self, slo: Slo) -> npt.NDArray[np.bool_]:
        col = self._read
        tpot = col("tpot_s")
        ok_tpot = np.isnan(tpot) | (tpot <= slo.tpot_s)
        met = ~col("rejected").astype(bool) & (col("ttft_s") <= slo.ttft_s) & ok_tpot
        return np.asarray(met, dtype=np.bool_)

    def attainment(self, slo: Slo) -> pd.Series:
        """Per request: whether it met ``slo`` (rejected requests never do)."""
        return pd.Series(self._met(slo), index=self.requests.index)

    def summary(self, slo: Slo | None = None) -> dict[str, float]:
        """Headline numbers: counts, throughput, percentiles, SLO attainment, SLO-met rate."""
        slo = slo or Slo()
        col = self._read
        done = ~col("rejected").astype(bool)
        n = len(done)
        span = float(col("finish_s")[done].max() - col("arrival_s").min()) if done.any() else 0.0
        met = self._met(slo)
        gpus = float(self.info["gpus"])
        preempted = col("preemptions")
        out: dict[str, float] = {
            "requests": float(n),
            "completed": float(done.sum()),
            "rejected": float(n - done.sum()),
            "span_s": span,
            "throughput_rps": float(done.sum()) / span if span else 0.0,
            "output_tok_s": float(col("output_len")[done].sum()) / span if span else 0.0,
            "slo_attainment": float(met.mean()) if n else 0.0,
            "slo_met_rps": float(met.sum()) / span if span else 0.0,
            "preemptions": float(preempted.sum()),
            "preempted_requests": float((preempted > 0).sum()),
            "recomputed_tokens": float(col("recomputed_tokens").sum()),
            "swap_bytes": float(col("swap_bytes").sum()),
        }
        out["slo_met_rps_per_gpu"] = out["slo_met_rps"] / gpus
        for name in ("ttft_s", "tpot_s", "e2e_s", "queue_s", "xfer_exposed_s"):
            values = col(name)[done]
            _percentiles(out, name.removesuffix("_s"), values[~np.isnan(values)])
        out.update(self._itl_summary)
        out.update(self._transfer_summary(done))
        out.update({k: float(v) for k, v in self.info.items() if isinstance(v, int | float)})
        return out

    @cached_property
    def _itl_summary(self) -> dict[str, float]:
        """ITL mean and percentiles (two passes over the step logs: computed once)."""
        mean, qs = weighted_quantiles(self._itl_blocks, QUANTILES)
        out = {"itl_mean": mean}
        out.update({f"itl_p{round(q * 100)}": v for q, v in zip(QUANTILES, qs, strict=True)})
        return out

    def _transfer_summary(self, done: npt.NDArray[np.bool_]) -> dict[str, float]:
        col = self._read
        inp = float(col("input_len")[done].sum()) or 1.0
        transfer = col("transfer_s")[done]
        transfer = transfer[~np.isnan(transfer)]
        return {
            "transfer_bytes": float(col("transfer_bytes")[done].sum()),
            "transfer_descriptors": float(col("transfer_descriptors")[done].sum()),
            "transfer_mean_s": (
                float(transfer.mean()) if len(transfer) else (np.nan if done.any() else 0.0)
            ),
            "p_prefix_hit_frac": float(col("p_hit_tokens")[done].sum()) / inp,
            "d_prefix_hit_frac": float(col("d_hit_tokens")[done].sum()) / inp,
        }


def _percentiles(out: dict[str, float], name: str, values: F64) -> None:
    out[f"{name}_mean"] = float(values.mean()) if len(values) else float("nan")
    for q in QUANTILES:
        value = float(np.quantile(values, q)) if len(values) else float("nan")
        out[f"{name}_p{round(q * 100)}"] = value


# ---- building a result from a finished simulation ----------------------------------------------


def build_result(sim: FinishedRun, wall_s: float) -> SimResult:
    """Collect a finished simulation (its files closed) into a :class:`SimResult`."""
    for d in sim.d_engines:
        d.log.flush()
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
    files = sim.files
    assert files is not None, "a finished run wrote its files"
    return SimResult(
        files.requests_path,
        files.segments_path,
        [d.log for d in sim.d_engines],
        build_timelines(sim),
        info,
        files.tmp,
    )
