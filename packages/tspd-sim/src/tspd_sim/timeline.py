"""Utilisation over time: NIC links, block pools, requests in the system.

Everything is time-weighted per bin (not sampled at bin edges): the network and the engines
integrate their step functions (NIC rates, pages in use) over the run's bins as it goes
(:mod:`tspd_sim.bins`), so the mean of a bin is an exact integral divided by its width. The
bins are equal, ``BINS`` to ``2 · BINS`` of them over the run, the last one partial.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from tspd_sim.sim.finished import FinishedRun


def build_timelines(sim: FinishedRun) -> dict[str, Any]:
    """Binned link utilisation, pool utilisation and in-system counts of a finished run."""
    end = sim.env.now
    edges = sim.net.utilisation_edges(end)
    mid = (edges[:-1] + edges[1:]) / 2
    names = [
        f"P{i}.gpu{g} egress" for i, info in enumerate(sim.p_info) for g in range(info.group.tp)
    ]
    names += [
        f"D{i}.gpu{g} ingress" for i, info in enumerate(sim.d_info) for g in range(info.group.tp)
    ]
    links = pd.DataFrame(sim.net.utilisation(end).T, index=mid, columns=names)
    pools, held = {}, {}
    names_kv = [f"P{i}" for i in range(len(sim.p_engines))]
    names_kv += [f"D{i}" for i in range(len(sim.d_engines))]
    for name, kv in zip(names_kv, sim.kvs(), strict=True):
        means = kv.occupancy.bin_means(end) / kv.num_pages
        pools[name], held[name] = means[:, 0], means[:, 1]
    frame: dict[str, Any] = {
        "edges": edges,
        "links": links,
        #: Fraction of each engine's pages in use (requests and prefix cache).
        "pools": pd.DataFrame(pools, index=mid),
        #: Fraction held by requests (the rest of "pools" is evictable prefix cache).
        "held": pd.DataFrame(held, index=mid),
    }
    t, n = sim.in_system
    if len(t):
        frame["in_system"] = pd.Series(n, index=t, name="requests")
    return frame
