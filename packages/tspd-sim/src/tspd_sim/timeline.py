"""Utilisation over time: NIC links, block pools, requests in the system.

Everything is time-weighted per bin (not sampled at bin edges): the network keeps each NIC's
cumulative carried work and the engines keep step-function occupancy samples, so the mean of a
bin is an exact integral divided by its width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pandas as pd

if TYPE_CHECKING:
    from tspd_sim.sim.finished import FinishedRun

F64 = npt.NDArray[np.float64]

#: Default number of bins over the run.
BINS = 240


def bin_edges(end_s: float, bins: int = BINS) -> F64:
    """Evenly spaced edges from 0 to ``end_s`` (at least one bin of 1 s)."""
    return np.linspace(0.0, max(end_s, 1.0), bins + 1)


def step_mean(t: list[float] | F64, v: list[float] | F64, edges: F64) -> F64:
    """Bin means of the right-continuous step function with value ``v[i]`` from ``t[i]`` on."""
    t_arr, v_arr = np.asarray(t, dtype=np.float64), np.asarray(v, dtype=np.float64)
    # Cumulative integral at each sample time, then linear interpolation between samples is
    # exact for a step function (the integral is piecewise linear).
    area = np.concatenate(([0.0], np.cumsum(np.diff(t_arr) * v_arr[:-1])))
    at = np.interp(edges, t_arr, area, right=np.nan)
    tail = edges > t_arr[-1]
    at[tail] = area[-1] + (edges[tail] - t_arr[-1]) * v_arr[-1]
    return np.diff(at) / np.diff(edges)


def build_timelines(sim: FinishedRun, bins: int = BINS) -> dict[str, Any]:
    """Binned link utilisation, pool utilisation and in-system counts of a finished run."""
    end = sim.env.now
    edges = bin_edges(end, bins)
    mid = (edges[:-1] + edges[1:]) / 2
    util = sim.net.utilisation(edges)
    names = [
        f"P{i}.gpu{g} egress" for i, info in enumerate(sim.p_info) for g in range(info.group.tp)
    ]
    names += [
        f"D{i}.gpu{g} ingress" for i, info in enumerate(sim.d_info) for g in range(info.group.tp)
    ]
    links = pd.DataFrame(util.T, index=mid, columns=names)
    pools, held = {}, {}
    names_kv = [f"P{i}" for i in range(len(sim.p_engines))]
    names_kv += [f"D{i}" for i in range(len(sim.d_engines))]
    for name, kv in zip(names_kv, sim.kvs(), strict=True):
        used = np.asarray(kv.samples_used, dtype=np.float64) / kv.num_pages
        pools[name] = step_mean(kv.samples_t, used, edges)
        mine = np.asarray(kv.samples_held, dtype=np.float64) / kv.num_pages
        held[name] = step_mean(kv.samples_t, mine, edges)
    frame: dict[str, Any] = {
        "edges": edges,
        "links": links,
        #: Fraction of each engine's pages in use (requests and prefix cache).
        "pools": pd.DataFrame(pools, index=mid),
        #: Fraction held by requests (the rest of "pools" is evictable prefix cache).
        "held": pd.DataFrame(held, index=mid),
    }
    if sim.in_system:
        t, n = zip(*sim.in_system, strict=True)
        frame["in_system"] = pd.Series(n, index=t, name="requests")
    return frame
