"""Shared helpers for the trace-replay notebooks in ``experiments/``.

Each notebook asks one sizing question of tspd-sim. They share four things, kept here so the
notebooks stay short and say only what is specific to their question:

* :func:`sweep` — replay a list of configurations at several rate scales of one trace, in a
  small process pool (at most 2 workers: the development machine has 2 cores). Every job is a
  pure function of (trace, config, scale), so the table does not depend on the worker count.
* :func:`capacity` — from a sweep, the highest offered rate that still meets an SLO-attainment
  target (linear interpolation between the two swept rates that bracket the target).
* :class:`LinkTally` and :func:`replay_with_links` — one replay whose every KV transfer is also
  tallied per (P rank, D rank) link, from the layout planner's own per-link counts (the numbers
  the simulator prices on the network).
* :func:`nic_balance` — how evenly a replay's KV traffic spread over the P and D NICs (every
  sweep row carries it, so a router that piles work on one instance shows up in the tables).
* :func:`save` — write a figure as a modest PNG under ``experiments/figures/``.

Ownership and threading: everything here runs in the notebook's kernel process, except the
sweep jobs, which run in worker processes (forked, so they see this module) and return plain
rows; nothing is shared between jobs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import numpy.typing as npt
import pandas as pd

from tspd_core.layout import BlockManifest
from tspd_sim.metrics import SimResult, Slo
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.sim.kv import EngineLayout, KvPlanner
from tspd_sim.traces import Trace

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "figures"
#: Most worker processes a sweep uses (the development and CI machines have 2 cores).
MAX_WORKERS = 2
#: Largest PNG a notebook may write; figures are committed, so they stay small.
MAX_PNG_BYTES = 150_000

#: Summary numbers a sweep keeps per replay (see ``SimResult.summary``).
KEEP = (
    "requests",
    "completed",
    "rejected",
    "slo_attainment",
    "slo_met_rps",
    "slo_met_rps_per_gpu",
    "throughput_rps",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "tpot_p50",
    "tpot_p90",
    "queue_p90",
    "xfer_exposed_p50",
    "xfer_exposed_p90",
    "transfer_mean_s",
    "transfer_bytes",
    "transfer_descriptors",
    "p_prefix_hit_frac",
    "d_prefix_hit_frac",
    "gpus",
    "wall_s",
)


@dataclass(frozen=True, slots=True)
class Point:
    """One configuration of a sweep: ``label`` names it in tables and legends; ``tags`` are
    extra columns copied into its rows (e.g. the P group, the ratio, a layerwise flag)."""

    label: str
    config: SimConfig
    tags: tuple[tuple[str, object], ...] = ()


def offered(
    trace: Trace, scale: float, duration_s: float | None = None, fit: bool = False
) -> Trace:
    """The requests of one replay at ``scale`` times ``trace``'s mean rate.

    * default: the trace's own arrival times divided by ``scale``; with ``duration_s``, only
      the requests arriving in the first ``duration_s`` seconds after scaling (the same
      stretch of load at every rate rather than the same request count). The realised rate
      is the trace's *local* rate in that stretch, which may stray from ``scale`` times the
      mean on a bursty trace.
    * ``fit`` (needs ``duration_s``): the first ``rate · duration_s + 1`` requests of the
      trace, ``rate = scale · trace.rate``, with their real relative arrival times stretched
      or compressed to span exactly ``duration_s`` — the realised mean rate is the nominal
      one, and the trace's bursts keep their shape.
    """
    if fit:
        if duration_s is None:
            raise ValueError("fit=True needs a duration_s")
        n = round(scale * trace.rate * duration_s) + 1
        if n > len(trace):
            raise ValueError(f"{trace.name!r} has {len(trace)} requests; {n} needed")
        sub = trace.head(n)
        rel = sub.arrival_s - sub.arrival_s[0]
        if rel[-1] <= 0:
            raise ValueError(f"the first {n} requests of {trace.name!r} arrive at one instant")
        return sub.retime(rel * (duration_s / rel[-1]), f"{trace.name}@fit")
    if duration_s is not None:
        trace = trace.window(0.0, duration_s * scale)
    return trace.scale_rate(scale) if scale != 1.0 else trace


def _job(
    args: tuple[Point, Trace, float, float | None, bool, Slo],
) -> tuple[dict[str, object], pd.DataFrame]:
    """One replay of a sweep (runs in a worker process): its row and its per-link table."""
    point, trace, scale, duration_s, fit, slo = args
    scaled = offered(trace, scale, duration_s, fit)
    result, links = replay_with_links(scaled, point.config)
    summary = result.summary(slo)
    row: dict[str, object] = {"label": point.label, **dict(point.tags), "scale": scale}
    row["rate_rps"] = scaled.rate
    row.update({key: summary[key] for key in KEEP})
    row.update(nic_balance(result))
    links.insert(0, "scale", scale)
    links.insert(0, "label", point.label)
    return row, links


def sweep(
    points: Sequence[Point],
    trace: Trace,
    scales: Sequence[float],
    slo: Slo,
    duration_s: float | None = None,
    fit: bool = False,
    workers: int = MAX_WORKERS,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Replay every point at every rate scale of ``trace`` (see :func:`offered` for
    ``duration_s`` and ``fit``); one row per (point, scale), in the order of ``points``
    then ``scales``, with the summary columns in :data:`KEEP`.

    Returns ``(runs, links)``: that table, and every replay's per-link table
    (:meth:`LinkTally.frame` with ``label`` and ``scale`` columns). Prints one line when
    done (replays, wall time); jobs run in at most ``workers`` processes.
    """
    labels = [p.label for p in points]
    if len(set(labels)) != len(labels):
        raise ValueError(f"sweep labels must be unique, got {labels}")
    if not scales or any(not (s > 0 and math.isfinite(s)) for s in scales):
        raise ValueError(f"rate scales must be positive numbers, got {list(scales)}")
    jobs = [(p, trace, float(s), duration_s, fit, slo) for p in points for s in scales]
    started = time.perf_counter()
    n = max(1, min(workers, MAX_WORKERS, len(jobs), os.cpu_count() or 1))
    if n == 1:
        outputs = [_job(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=n) as pool:
            outputs = list(pool.map(_job, jobs))
    wall = time.perf_counter() - started
    print(f"{len(jobs)} replays of {trace.name!r} in {wall:.0f} s ({n} workers)")
    runs = pd.DataFrame([row for row, _ in outputs])
    return runs, pd.concat([links for _, links in outputs], ignore_index=True)


def capacity(frame: pd.DataFrame, target: float, by: str = "label") -> pd.DataFrame:
    """Per configuration: the highest rate meeting ``target`` SLO attainment.

    Along each configuration's rows (sorted by rate) the capacity is the first crossing of the
    target, linearly interpolated between the last rate at or above it and the next rate
    below it. ``bound`` says whether the crossing was found (``"in range"``), or lies below
    the lowest swept rate (capacity reported as 0) or above the highest (reported as the
    highest). ``capacity_rps_per_gpu`` divides by the configuration's GPUs.
    """
    rows = []
    for key, grp in frame.groupby(by, sort=False):
        g = grp.sort_values("rate_rps")
        rate, att = g["rate_rps"].to_numpy(), g["slo_attainment"].to_numpy()
        cap, bound = _crossing(rate, att, target)
        gpus = float(g["gpus"].iloc[0])
        per_gpu = cap / gpus
        rows.append({by: key, "capacity_rps": cap, "capacity_rps_per_gpu": per_gpu, "bound": bound})
    return pd.DataFrame(rows)


def _crossing(
    rate: npt.NDArray[np.float64], att: npt.NDArray[np.float64], target: float
) -> tuple[float, str]:
    if att[0] < target:
        return 0.0, "below"
    below = np.flatnonzero(att < target)
    if not len(below):
        return float(rate[-1]), "above"
    j = int(below[0])
    r0, r1, a0, a1 = rate[j - 1], rate[j], att[j - 1], att[j]
    return float(r0 + (a0 - target) / (a0 - a1) * (r1 - r0)), "in range"


# ---- traces ------------------------------------------------------------------------------------


def spread_ties(trace: Trace, seed: int = 0) -> Trace:
    """The same requests with arrivals that share a timestamp spread over their time slot.

    The Mooncake release rounds timestamps to 3 s slots (up to 28 requests share one), so a
    replay would see bursts that no rate scaling thins out. Given n arrivals in a slot, a
    Poisson process places them as n sorted uniform draws over the slot; that is what this
    does (seeded), slot = the gap to the next distinct timestamp (the median gap for the last
    one). Order is preserved and traces with distinct timestamps are returned unchanged.
    """
    a = trace.arrival_s
    stamps, first, counts = np.unique(a, return_index=True, return_counts=True)
    if len(stamps) == len(a):
        return trace
    gaps = np.diff(stamps)
    slot = np.append(gaps, np.median(gaps) if len(gaps) else 1.0)
    rng = np.random.Generator(np.random.PCG64(seed))
    out = a.copy()
    for start, n, width in zip(first, counts, slot, strict=True):
        if n > 1:
            out[start : start + n] = a[start] + np.sort(rng.uniform(0.0, width, n))
    return trace.retime(out, f"{trace.name}~spread")


# ---- per-link accounting ---------------------------------------------------------------------


class LinkTally(KvPlanner):
    """The simulator's planner, also summing every link's bytes and descriptors.

    Keyed by (P TP, D TP, P rank, D rank): the sum over all instance pairs of that TP pair.
    The counts are the planner's own (``KvPlanner.links``, from the real layout planner's
    per-link profiles), taken at the moment the simulator prices them; every flow it returns
    is sent, so after a run the tally's total equals the requests' ``transfer_bytes``.
    """

    def __init__(self, inner: KvPlanner) -> None:
        super().__init__(inner.model, inner.tuning)
        self.totals: dict[tuple[int, int, int, int], list[int]] = {}

    def links(
        self,
        p: EngineLayout,
        d: EngineLayout,
        src: BlockManifest,
        dst: BlockManifest,
        positions: dict[str, tuple[int, int]] | None,
    ) -> list[tuple[int, int, int, int]]:
        out = super().links(p, d, src, dst, positions)
        for p_rank, d_rank, nbytes, ndesc in out:
            acc = self.totals.setdefault((p.tp, d.tp, p_rank, d_rank), [0, 0, 0])
            acc[0] += nbytes
            acc[1] += ndesc
            acc[2] += 1
        return out

    def frame(self) -> pd.DataFrame:
        """One row per link: p_tp, d_tp, p_rank, d_rank, bytes, descriptors, flows."""
        rows = [
            {"p_tp": k[0], "d_tp": k[1], "p_rank": k[2], "d_rank": k[3]}
            | {"bytes": v[0], "descriptors": v[1], "flows": v[2]}
            for k, v in sorted(self.totals.items())
        ]
        return pd.DataFrame(rows)


def replay_with_links(trace: Trace, config: SimConfig) -> tuple[SimResult, pd.DataFrame]:
    """One replay, plus its per-link table (:meth:`LinkTally.frame`)."""
    sim = Simulation(trace, config)
    tally = LinkTally(sim.planner)
    sim.transfers.planner = tally
    result = sim.run()
    return result, tally.frame()


def nic_balance(result: SimResult) -> dict[str, float]:
    """How evenly one replay spread its KV traffic over the NICs, per side.

    ``p_nic_busiest`` / ``d_nic_busiest``: the mean utilisation, over the whole replay, of the
    busiest P egress / D ingress NIC (1.0 = its effective rate all the time).
    ``p_nic_spread`` / ``d_nic_spread``: that NIC's mean over the mean of all NICs of its side
    (1.0 = perfectly even; n = one of n NICs carried everything; NaN without traffic).
    """
    links = result.timelines["links"]
    out: dict[str, float] = {}
    for side, suffix in (("p", " egress"), ("d", " ingress")):
        util = links[[c for c in links.columns if c.endswith(suffix)]].mean().to_numpy()
        mean = float(util.mean())
        out[f"{side}_nic_busiest"] = float(util.max())
        out[f"{side}_nic_spread"] = float(util.max()) / mean if mean > 0 else math.nan
    return out


# ---- figures and checks ----------------------------------------------------------------------


def save(fig: Any, name: str, dpi: int = 90) -> Path:
    """Write ``fig`` as ``experiments/figures/<name>.png`` (fails if it is over the size cap)."""
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    size = path.stat().st_size
    if size > MAX_PNG_BYTES:
        raise ValueError(f"{path.name} is {size:,} bytes; keep figures ≤ {MAX_PNG_BYTES:,}")
    shown = path.relative_to(HERE.parent) if path.is_relative_to(HERE.parent) else path
    print(f"saved {shown} ({size / 1e3:.0f} kB)")
    return path


def close(fig: Any) -> None:
    """Release a figure after it was shown (keeps the kernel's memory flat)."""
    plt.close(fig)


def table(frame: pd.DataFrame, columns: Iterable[str], digits: int = 3) -> pd.DataFrame:
    """The given columns, rounded, for a compact printed table."""
    return frame[list(columns)].round(digits)
