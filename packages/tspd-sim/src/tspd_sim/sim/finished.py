"""The view of a finished run that results are collected from (:mod:`tspd_sim.metrics`,
:mod:`tspd_sim.timeline`): a protocol, so that the result code reads a run without importing the
simulation that produces it."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt
import simpy

from tspd_sim.network import Network
from tspd_sim.records import RunFiles
from tspd_sim.sim.context import EngineInfo, SimConfig
from tspd_sim.sim.decode import DecodeEngine
from tspd_sim.sim.kv import EngineKv
from tspd_sim.sim.prefill import PrefillEngine
from tspd_sim.traces import Trace


class FinishedRun(Protocol):
    """What :func:`~tspd_sim.metrics.build_result` and the timelines read of a finished run
    (a :class:`~tspd_sim.sim.simulation.Simulation` after ``run``)."""

    trace: Trace
    config: SimConfig
    env: simpy.Environment
    net: Network
    files: RunFiles | None
    p_engines: list[PrefillEngine]
    d_engines: list[DecodeEngine]
    p_info: list[EngineInfo]
    d_info: list[EngineInfo]

    @property
    def in_system(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """(times, requests in the system) samples."""
        ...

    def kvs(self) -> list[EngineKv]:
        """Every engine's KV state, P engines first."""
        ...
