"""KV-transfer network: per-NIC links shared max-min fairly among concurrent flows.

Every P GPU has one NIC whose *egress* its outgoing flows share; every D GPU one NIC whose
*ingress* its incoming flows share (NICs are full duplex). A flow is one (P rank, D rank) part
of one request's KV transfer. Its cost on an idle link is

::

    latency + (bytes + descriptors · per_descriptor_s · link_rate) / link_rate

i.e. the per-descriptor cost (posting, completion, per-write setup) is charged as extra work
on the link, so it is shared exactly like bytes when flows compete. Rates are max-min fair
(progressive filling over the egress and ingress NICs), recomputed whenever a flow starts or
ends; between those instants every rate is constant, so the next completion is exact.

Ownership: one :class:`Network` per simulation, driven from SimPy callbacks on one thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import simpy

from tspd_sim.bins import BinGrid, StepIntegral
from tspd_sim.errors import SpecError

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class NetKnobs:
    """Network cost knobs (defaults: RDMA through one 400 Gb/s NIC per GPU)."""

    #: Fixed start-up of one transfer: handshake-free RDMA write post to first byte (None: the
    #: GPU specs' NIC latency, the larger of the two ends; 30 µs for the built-in GPUs).
    latency_s: float | None = None
    #: Cost of one descriptor (one contiguous write): work-request post and completion.
    per_descriptor_s: float = 0.3e-6
    #: Fraction of the NIC line rate a bulk write reaches.
    efficiency: float = 0.9
    #: NIC line rate override in bytes/s (None: the GPU spec's NIC rate).
    nic_bw: float | None = None

    def __post_init__(self) -> None:
        if (self.latency_s is not None and self.latency_s < 0) or self.per_descriptor_s < 0:
            raise SpecError("network latency and per-descriptor cost must be ≥ 0")
        if not 0 < self.efficiency <= 1:
            raise SpecError(f"network efficiency {self.efficiency}: must be in (0, 1]")
        if self.nic_bw is not None and self.nic_bw <= 0:
            raise SpecError(f"NIC bandwidth override {self.nic_bw}: must be > 0")


#: Profiles selectable by name from the CLI.
NET_PROFILES: dict[str, NetKnobs] = {
    "rdma": NetKnobs(),
    # Mooncake over loopback TCP on the 2-core development machine, as measured when this
    # profile was set: ~1.4 GB/s for large writes, ~70-100 µs per descriptor (the transfer
    # benchmark's runs since: docs/measurements/transfer.md).
    "tcp-dev": NetKnobs(latency_s=100e-6, per_descriptor_s=80e-6, efficiency=1.0, nic_bw=1.4e9),
}


class Flow:
    """One in-flight (P rank, D rank) write. Fields are owned by :class:`Network`."""

    __slots__ = ("done", "dst", "rate", "remaining", "src", "work")

    def __init__(self, src: int, dst: int, work: float, done: Callable[[], None]) -> None:
        self.src, self.dst, self.work, self.done = src, dst, work, done
        self.remaining = work
        self.rate = 0.0


class Network:
    """Max-min fair sharing of NIC egress (P GPUs) and ingress (D GPUs).

    NIC ids are the simulation's global GPU indices on each side. ``start`` is the only entry
    point; a flow's ``done`` callback runs at its completion instant, in start order among flows
    finishing at the same instant.
    """

    def __init__(
        self,
        env: simpy.Environment,
        egress_bw: list[float],
        ingress_bw: list[float],
        knobs: NetKnobs,
        latencies: tuple[list[float], list[float]] | None = None,
        grid: BinGrid | None = None,
    ) -> None:
        """``latencies``: (egress, ingress) NIC start-up latencies, used when the knobs give
        none (a path's latency is the larger of its two ends'; 30 µs without either).
        ``grid``: the run's timeline bins (utilisation is kept per bin)."""
        self.env, self.knobs = env, knobs
        if knobs.latency_s is not None or latencies is None:
            fixed = 30e-6 if knobs.latency_s is None else knobs.latency_s
            latencies = ([fixed] * len(egress_bw), [fixed] * len(ingress_bw))
        self._lat_src, self._lat_dst = latencies
        eff = knobs.efficiency
        self._cap = [b * eff for b in egress_bw] + [b * eff for b in ingress_bw]
        self._n_egress = len(egress_bw)
        self._flows: list[Flow] = []
        self._last = 0.0
        self._version = 0
        # Each NIC's carried rate over time (bytes/s), integrated per bin as the run goes.
        self._load = StepIntegral(grid or BinGrid(1.0), len(self._cap))

    @property
    def capacities(self) -> list[float]:
        """Effective rates of all NICs, egress first (bytes/s)."""
        return list(self._cap)

    @property
    def n_egress(self) -> int:
        return self._n_egress

    def link_rate(self, src: int, dst: int) -> float:
        """The idle rate of a P GPU → D GPU path."""
        return min(self._cap[src], self._cap[self._n_egress + dst])

    def latency(self, src: int, dst: int) -> float:
        """Start-up latency of a P GPU → D GPU path."""
        return max(self._lat_src[src], self._lat_dst[dst])

    def ideal_time(self, src: int, dst: int, nbytes: float, descriptors: int) -> float:
        """Seconds the flow would take on an idle path (latency included)."""
        k = self.knobs
        rate = self.link_rate(src, dst)
        return self.latency(src, dst) + nbytes / rate + descriptors * k.per_descriptor_s

    def start(
        self, src: int, dst: int, nbytes: float, descriptors: int, done: Callable[[], None]
    ) -> None:
        """Start a flow of ``nbytes`` in ``descriptors`` writes from P GPU ``src`` to D GPU
        ``dst``; ``done()`` runs when its last byte lands."""
        self.env.timeout(self.latency(src, dst)).callbacks.append(
            lambda _e: self.start_now(src, dst, nbytes, descriptors, done)
        )

    def start_now(
        self, src: int, dst: int, nbytes: float, descriptors: int, done: Callable[[], None]
    ) -> None:
        """Like :meth:`start` for a flow whose start-up latency has already elapsed (the
        caller scheduled it :meth:`latency` later itself, saving one event per flow)."""
        if nbytes <= 0 and descriptors <= 0:
            done()
            return
        rate = self.link_rate(src, dst)
        work = nbytes + descriptors * self.knobs.per_descriptor_s * rate
        self._admit(Flow(src, self._n_egress + dst, work, done))

    # ---- internals -------------------------------------------------------------------------------

    def _admit(self, flow: Flow) -> None:
        self._advance()
        self._flows.append(flow)
        self._reschedule()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            for f in self._flows:
                f.remaining -= f.rate * dt
        self._last = now

    def _reschedule(self) -> None:
        self._version += 1
        rates = [0.0] * len(self._cap)
        if not self._flows:
            self._load.set(self.env.now, rates)
            return
        _fair_rates(self._flows, self._cap)
        for f in self._flows:
            rates[f.src] += f.rate
            rates[f.dst] += f.rate
        self._load.set(self.env.now, rates)
        nxt = min(f.remaining / f.rate for f in self._flows)
        version = self._version
        self.env.timeout(max(nxt, 0.0)).callbacks.append(lambda _e: self._wake(version))

    def _wake(self, version: int) -> None:
        if version != self._version:
            return  # a later start or finish superseded this wake-up
        self._advance()
        finished = [f for f in self._flows if f.remaining <= f.rate * 1e-9 + 1e-6]
        self._flows = [f for f in self._flows if f.remaining > f.rate * 1e-9 + 1e-6]
        self._reschedule()
        for f in finished:
            f.done()

    def utilisation_edges(self, end: float) -> F64:
        """Edges of the bins :meth:`utilisation` reports, over ``[0, end]``."""
        return self._load.grid.edges(end)

    def utilisation(self, end: float) -> F64:
        """Per-NIC utilisation in each bin of the grid up to ``end`` (shape (NICs, bins)),
        egress NICs first; 1.0 is the NIC's effective rate all through the bin."""
        util: F64 = (self._load.bin_means(end) / np.asarray(self._cap)).T
        return util


def _fair_rates(flows: list[Flow], cap: list[float]) -> None:
    """Progressive filling: repeatedly saturate the NIC with the smallest fair share."""
    users: dict[int, list[Flow]] = {}
    for f in flows:
        users.setdefault(f.src, []).append(f)
        users.setdefault(f.dst, []).append(f)
    if len(users) == 2 * len(flows):  # no NIC shared: each flow gets its path's rate
        for f in flows:
            f.rate = min(cap[f.src], cap[f.dst])
        return
    left = {r: cap[r] for r in users}
    frozen: set[int] = set()
    while len(frozen) < len(flows):
        best, share = -1, float("inf")
        for r, fl in users.items():
            n = sum(1 for f in fl if id(f) not in frozen)
            if n and left[r] / n < share:
                best, share = r, left[r] / n
        for f in users[best]:
            if id(f) in frozen:
                continue
            f.rate = share
            frozen.add(id(f))
            for r in (f.src, f.dst):
                left[r] -= share
