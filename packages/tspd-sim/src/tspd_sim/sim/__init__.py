"""The simulation loop: engines around the real scheduler and planner, the network, routing."""

from tspd_sim.sim.context import SimConfig
from tspd_sim.sim.router import POLICIES, RoutingSpec
from tspd_sim.sim.simulation import Simulation

__all__ = ["POLICIES", "RoutingSpec", "SimConfig", "Simulation"]
