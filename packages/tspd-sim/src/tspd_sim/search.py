"""Capacity search and configuration grids.

**Capacity** (DistServe's method): the highest arrival rate at which a configuration still
meets the SLO for at least ``target`` of the requests. The trace is replayed at rate scales
``s`` (``trace.scale_rate(s)``: same requests, ``s`` times denser); starting from 1 the scale
doubles or halves until the target is bracketed, then the bracket is bisected (geometrically)
``iters`` times. Attainment falls with rate in any sane configuration; the search assumes it.

**Grid**: many configurations at once, each in a process of its own or a task of a Ray
cluster (:mod:`tspd_sim.parallel`); every point is a pure function of its inputs, so results
do not depend on the worker count, the order or where they ran.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from tspd_sim.errors import SpecError
from tspd_sim.metrics import SimResult, Slo
from tspd_sim.parallel import run_points
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.specs import ModelSpec
from tspd_sim.traces import Trace


@dataclass(frozen=True, slots=True)
class Probe:
    """One replay of the capacity search."""

    scale: float
    rate_rps: float
    attainment: float
    #: Requests meeting the SLO per second of this replay.
    slo_met_rps: float
    summary: dict[str, float] = field(repr=False)


@dataclass(frozen=True, slots=True)
class Capacity:
    """The result of a capacity search: ``capacity_rps``, the highest offered rate whose SLO
    attainment reached ``target`` (0 when even the lowest scale failed)."""

    label: str
    gpus: int
    scale: float
    capacity_rps: float
    target: float
    probes: tuple[Probe, ...]

    @property
    def capacity_rps_per_gpu(self) -> float:
        """The capacity per GPU of the configuration (DistServe's per-GPU goodput)."""
        return self.capacity_rps / self.gpus

    def frame(self) -> pd.DataFrame:
        """The probes as a table (sorted by rate), for SLO-vs-rate plots."""
        rows = [
            {
                "scale": p.scale,
                "rate_rps": p.rate_rps,
                "attainment": p.attainment,
                "slo_met_rps": p.slo_met_rps,
                "config": self.label,
            }
            for p in self.probes
        ]
        return pd.DataFrame(rows).sort_values("rate_rps").reset_index(drop=True)


def probe(trace: Trace, config: SimConfig, scale: float, slo: Slo) -> Probe:
    """Replay ``trace`` at ``scale`` times its rate; measure SLO attainment and SLO-met rate."""
    scaled = trace.scale_rate(scale)
    result = Simulation(scaled, config).run()
    s = result.summary(slo)
    return Probe(scale, scaled.rate, s["slo_attainment"], s["slo_met_rps"], s)


def capacity_search(
    trace: Trace,
    config: SimConfig,
    slo: Slo,
    target: float = 0.9,
    iters: int = 6,
    max_doublings: int = 8,
    on_probe: Callable[[Probe], None] | None = None,
) -> Capacity:
    """The highest rate scale whose SLO attainment is ≥ ``target`` (see module docstring)."""
    if not 0 < target <= 1:
        raise SpecError(f"attainment target {target}: must be in (0, 1]")
    probes: list[Probe] = []

    def run(scale: float) -> bool:
        p = probe(trace, config, scale, slo)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p.attainment >= target

    good, bad = _bracket(run, max_doublings)
    if good > 0 and bad < math.inf:
        for _ in range(iters):
            mid = math.sqrt(good * bad)
            good, bad = (mid, bad) if run(mid) else (good, mid)
    best = max((p for p in probes if p.attainment >= target), key=lambda p: p.scale, default=None)
    return Capacity(
        config.cluster.label(),
        config.cluster.gpus,
        best.scale if best else 0.0,
        best.rate_rps if best else 0.0,
        target,
        tuple(probes),
    )


def _bracket(run: Callable[[float], bool], max_doublings: int) -> tuple[float, float]:
    """(a passing scale, a failing scale): 0 or inf when none was found in range."""
    if run(1.0):
        good = 1.0
        for _ in range(max_doublings):
            if not run(good * 2):
                return good, good * 2
            good *= 2
        return good, math.inf
    bad = 1.0
    for _ in range(max_doublings):
        if run(bad / 2):
            return bad / 2, bad
        bad /= 2
    return 0.0, bad


# ---- grids -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One configuration of a grid: run once at the trace's rate, or capacity-searched."""

    label: str
    config: SimConfig


def _point_worker(
    job: tuple[GridPoint, bool, float, int], shared: tuple[Trace, Slo]
) -> tuple[dict[str, object], Capacity | None]:
    """One grid point (a process's or a Ray task's work: a pure function of its inputs)."""
    point, search, target, iters = job
    trace, slo = shared
    row: dict[str, object] = {
        "config": point.label,
        "gpus": point.config.cluster.gpus,
        "routing": point.config.routing.policy,
    }
    if search:
        cap = capacity_search(trace, point.config, slo, target, iters=iters)
        cap = replace(cap, label=point.label)
        row.update(
            capacity_rps=cap.capacity_rps,
            capacity_scale=cap.scale,
            capacity_rps_per_gpu=cap.capacity_rps_per_gpu,
            probes=len(cap.probes),
        )
        return row, cap
    result: SimResult = Simulation(trace, point.config).run()
    row.update(result.summary(slo))
    return row, None


def run_grid(
    points: Sequence[GridPoint],
    trace: Trace,
    slo: Slo,
    *,
    search: bool = False,
    target: float = 0.9,
    iters: int = 6,
    workers: int | None = None,
    ray_address: str | None = None,
    progress: bool = False,
    on_done: Callable[[dict[str, object]], None] | None = None,
) -> pd.DataFrame:
    """Run every point (capacity search when ``search``, ``iters`` bisection steps) in
    parallel: ``workers`` processes here, or the tasks of the Ray cluster at ``ray_address``
    (:mod:`tspd_sim.parallel`; ``progress``: a bar on stderr); one row each, in the order of
    ``points``, the same either way. With ``search``, ``frame.attrs["capacities"]`` holds each
    point's :class:`Capacity` (its probes) in the same order."""
    if not points:
        raise SpecError("a grid needs at least one configuration")
    labels = [p.label for p in points]
    if len(set(labels)) != len(labels):
        raise SpecError(f"grid labels must be unique, got {labels}")
    outputs = run_points(
        _point_worker,
        [(p, search, target, iters) for p in points],
        (trace, slo),
        workers=workers,
        ray_address=ray_address,
        progress=progress,
        on_done=None if on_done is None else lambda out: on_done(out[0]),
        what="configurations",
    )
    frame = pd.DataFrame([row for row, _ in outputs])
    # The probes of each capacity search, for SLO-vs-rate plots.
    frame.attrs["capacities"] = [cap for _, cap in outputs if cap is not None]
    return frame


def vary(base: SimConfig, **changes: Sequence[object]) -> list[GridPoint]:
    """Grid points over the cartesian product of ``changes`` (keys: ``prefill``, ``decode`` —
    tuples of GroupSpec; ``routing`` — policy names; ``page_size``, ``layerwise``, ...
    EngineTuning fields), labelled by what varies."""
    points = [GridPoint("", base)]
    for key, values in changes.items():
        nxt = []
        for point in points:
            for value in values:
                cfg = _with(point.config, key, value)
                label = f"{point.label} {key}={_show(value)}".strip()
                nxt.append(GridPoint(label, cfg))
        points = nxt
    return points


def _with(cfg: SimConfig, key: str, value: Any) -> SimConfig:
    cl = cfg.cluster
    if key == "model":
        return replace(
            cfg, cluster=replace(cl, model=value if isinstance(value, ModelSpec) else str(value))
        )
    if key == "prefill":
        return replace(cfg, cluster=replace(cl, prefill=tuple(value)))
    if key == "decode":
        return replace(cfg, cluster=replace(cl, decode=tuple(value)))
    if key == "routing":
        return replace(cfg, routing=replace(cfg.routing, policy=str(value)))
    if key in cl.tuning.__dataclass_fields__:
        tuning = replace(cl.tuning, **{key: value})
        return replace(cfg, cluster=replace(cl, tuning=tuning))
    raise SpecError(
        f"cannot vary {key!r}: use prefill, decode, model, routing or an EngineTuning field"
    )


def _show(value: object) -> str:
    if isinstance(value, ModelSpec):
        return value.name
    if isinstance(value, tuple):
        return "+".join(getattr(v, "label", lambda v=v: str(v))() for v in value)
    return str(value)
