"""What the parts of a simulation share: the run's settings (:class:`SimConfig`), what each
engine sees of the simulation (:class:`EngineCtx`) and the static facts about an engine that the
results report (:class:`EngineInfo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from tspd_sim.cluster import ClusterSpec, EngineTuning, GroupSpec
from tspd_sim.cost.calibration import Calibration
from tspd_sim.cost.fitted import StepCost
from tspd_sim.errors import SpecError
from tspd_sim.network import NetKnobs
from tspd_sim.sim.router import RoutingSpec
from tspd_sim.specs import ModelSpec

#: Default most steps priced at once: bounds the work thrown away when a join cuts a
#: macro-step. A horizon of 1 is the one-event-per-step baseline (same results).
HORIZON = 1024


@dataclass(frozen=True)
class SimConfig:
    """Everything a run depends on besides the trace (immutable; picklable for workers)."""

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    net: NetKnobs = field(default_factory=NetKnobs)
    calibration: Calibration = field(default_factory=Calibration)
    seed: int = 0
    #: Period of the in-system request count samples (0 disables them).
    sample_interval_s: float = 1.0
    #: Most decode steps priced per event (1: one event per decode step, the slow baseline).
    decode_horizon: int = HORIZON

    def __post_init__(self) -> None:
        if self.decode_horizon < 1:
            raise SpecError(f"decode_horizon {self.decode_horizon}: must be ≥ 1")
        if self.sample_interval_s < 0:
            raise SpecError(f"sample_interval_s {self.sample_interval_s}: must be ≥ 0")


@dataclass(slots=True)
class EngineCtx:
    """What an engine shares with the simulation: the clock, its cost model, the settings."""

    env: simpy.Environment
    cost: StepCost
    tuning: EngineTuning
    model: ModelSpec
    #: Most decode steps one macro-step prices at once.
    horizon: int = HORIZON
    #: Host link of one GPU, bytes/s (KV swapped out and in under memory pressure).
    host_bw: float = 64e9


@dataclass(slots=True)
class EngineInfo:
    """Static facts about one engine, for metrics."""

    role: str
    instance: int
    dp_rank: int
    group: GroupSpec
    gpu_base: int
    num_pages: int
