"""Plots of one or several runs (matplotlib, headless Agg backend; PNG files).

* ``ttft_tpot_cdf.png`` — TTFT and TPOT CDFs, one line per run, the SLO as a dashed line
* ``links.png``         — NIC utilisation over time (P egress and D ingress: mean and busiest)
* ``pools.png``         — block-pool occupancy over time per engine, and requests in system
* ``slo_vs_rate.png``   — SLO-met rate and SLO attainment against the offered rate, with each
                          configuration's capacity marked (capacity search)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

from tspd_sim.metrics import SimResult, Slo
from tspd_sim.search import Capacity


def _cdf(ax: object, values: np.ndarray, label: str, scale: float) -> None:
    v = np.sort(values[np.isfinite(values)]) * scale
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)  # type: ignore[attr-defined]


def plot_cdfs(runs: Mapping[str, SimResult], slo: Slo, path: Path) -> Path:
    """TTFT (s) and TPOT (ms) CDFs of every run."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, res in runs.items():
        done = ~res.column("rejected").astype(bool)
        _cdf(left, res.column("ttft_s")[done], label, 1.0)
        _cdf(right, res.column("tpot_s")[done], label, 1e3)
    left.axvline(slo.ttft_s, ls="--", c="gray", lw=1)
    right.axvline(slo.tpot_s * 1e3, ls="--", c="gray", lw=1)
    left.set(
        xlabel="TTFT (s)", ylabel="fraction of requests", title="Time to first token", xscale="log"
    )
    right.set(xlabel="TPOT (ms)", title="Time per output token")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_links(res: SimResult, path: Path) -> Path:
    """Mean and busiest NIC utilisation per bin, P egress and D ingress."""
    links = res.timelines["links"]
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for side, style in (("egress", "-"), ("ingress", "--")):
        cols = [c for c in links.columns if c.endswith(side)]
        if cols:
            t = links.index.to_numpy() / 60
            ax.plot(t, links[cols].mean(axis=1) * 100, style, label=f"{side} mean")
            ax.plot(t, links[cols].max(axis=1) * 100, style, alpha=0.5, label=f"{side} busiest")
    ax.set(
        xlabel="time (min)",
        ylabel="NIC utilisation (%)",
        title="KV transfer link utilisation (P egress, D ingress)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_pools(res: SimResult, path: Path) -> Path:
    """Block-pool pages held by requests per engine (the rest is evictable prefix cache), and
    requests in the system."""
    held = res.timelines["held"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    t = held.index.to_numpy() / 60
    for col in held.columns:
        top.plot(t, held[col] * 100, label=col, lw=1)
    top.set(
        ylabel="pages held (%)",
        title="Block pools: pages held by requests (the rest caches prefixes)",
    )
    top.legend(fontsize=7, ncol=8)
    series = res.timelines.get("in_system")
    if series is not None:
        bottom.plot(series.index.to_numpy() / 60, series.to_numpy(), lw=1)
    bottom.set(xlabel="time (min)", ylabel="requests in system")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_slo_vs_rate(capacities: Sequence[Capacity], path: Path) -> Path:
    """SLO-met rate and SLO attainment against the offered rate, one line per configuration;
    a dotted line marks each capacity (the highest rate meeting the attainment target)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for cap in capacities:
        df = cap.frame()
        left.plot(df["rate_rps"], df["slo_met_rps"], "o-", label=cap.label)
        right.plot(df["rate_rps"], df["attainment"] * 100, "o-", label=cap.label)
        if cap.capacity_rps:
            right.axvline(cap.capacity_rps, ls=":", lw=1)
    if capacities:
        right.axhline(capacities[0].target * 100, ls="--", c="gray", lw=1)
    left.set(
        xlabel="offered rate (req/s)",
        ylabel="requests meeting the SLO per second",
        title="SLO-met rate vs offered rate",
    )
    right.set(
        xlabel="offered rate (req/s)", ylabel="SLO attainment (%)", title="SLO attainment vs rate"
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig: object, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
