"""Whole P -> D pairs of either system on one machine, timed and checked byte for byte.

A pair is a P instance and a D replica, each TokenSpeed's (its own managers from the interop
fixture, a :class:`~tspd_testing.interop.host.TokenSpeedHost` child process per rank, as
TokenSpeed runs a process per rank) or tspd's (its peers in this process, or each rank's in
a child of its own, :mod:`~tspd_testing.interop.tspd_host`; a transfer worker process per
rank either way): TokenSpeed -> TokenSpeed, tspd -> tspd and the two mixed pairs, all on the
same contracts (TokenSpeed's recipe and tspd's give the same canonical JSON; checked at start),
the same block tables and Mooncake over loopback TCP. Both systems are driven the same way:
every rank registers each room, D publishes its manifest and P hands its prompt over once the
room is bootstrapped (what TokenSpeed's executors do), then each rank polls until the room
ends there. Each step is stamped on the side that takes it (perf_counter: the system-wide
monotonic clock on Linux, so stamps of different processes compare):

* ``transfer_s``: the first P rank's hand-over -> the last D rank's KV in (the throughput);
* ``latency_s``: the first registration on either side -> the last D rank's KV in.

Used by the transfer benchmark's ``tokenspeed`` part and by ``tests/interop``. Owned by one
thread (the caller's); each instance is started once and serves every pair that needs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tspd_core.ids import RequestId
from tspd_core.layout import (
    CacheContract,
    build_contract,
    encode_contract,
    parse_contract,
    slot_range,
)
from tspd_core.pd import PdEvent, PdTunables, RemotePrefill, Succeeded
from tspd_testing import procstat
from tspd_testing.identity import RankView, check_identity
from tspd_testing.interop.contracts import Model, tokenspeed_contract, tspd_spec
from tspd_testing.interop.host import TokenSpeedHost
from tspd_testing.interop.tspd_host import WIRE_DESCRIPTORS, HostedInstance
from tspd_testing.interop.tspd_side import (
    LOOPBACK,
    Room_,
    Stamps,
    TspdInstance,
    drive_many,
    failed,
    shared_arena,
    start_decode,
    start_prefill,
    tag_sources,
    verify,
)

SYSTEMS = ("tokenspeed", "tspd")
GID = "full_attention"
#: TokenSpeed's P hands Mooncake 4,096 descriptors per call; Mooncake's TCP transport queues
#: 1,024 per peer by default and fails the rest ("TCP lane queue-full rejection"), so a
#: TokenSpeed P over TCP fails any job of more descriptors unless this is raised (its
#: deployments run RDMA). tspd's P keeps 64 in flight and needs nothing.
TOKENSPEED_MOONCAKE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "8192",
}
_names = itertools.count()


class PairError(Exception):
    """A pair did not move its rooms: a failure, a timeout or a byte out of place."""


class TokenSpeedInstance:
    """One TokenSpeed P instance or D replica: a host child per rank, arenas made here."""

    def __init__(self, role: str, model: Model, tp: int, budget: int) -> None:
        self.role, self.tp = role, tp
        self.name = f"{role}-{model.name}-{tp}-{next(_names)}"
        self.wire = tokenspeed_contract(model, tp, budget).to_wire_bytes()
        self.contract = parse_contract(self.wire)
        self.arenas = [shared_arena(self.contract) for _ in range(tp)]
        self.views = [RankView(a.numpy(), self.contract, tp, r) for r, a in enumerate(self.arenas)]
        self.hosts: list[TokenSpeedHost] = []
        self.port = 0
        try:
            for rank, arena in enumerate(self.arenas):
                host = TokenSpeedHost(TOKENSPEED_MOONCAKE_ENV)
                self.hosts.append(host)
                if role == "p":
                    got = host.call("start_prefill", self.name, self.wire, [arena], tp, rank,
                                    self.port)  # fmt: skip
                    self.port = self.port or int(got)
                else:
                    host.call("start_decode", self.name, self.wire, [arena], tp, rank)
        except BaseException:
            self.close()
            raise

    def submit(self, rooms: Sequence[Room_], p_port: int, timeout_s: float) -> None:
        """Start ``rooms`` on every rank (P: senders; D: receivers looking up ``p_port``)."""
        if self.role == "p":
            plans: list[Any] = [(r.room, _lists(r.p_table), r.token) for r in rooms]
            for host in self.hosts:
                host.submit("run_prefill", self.name, plans, timeout_s)
            return
        plans = [(r.room, _lists(r.d_table), r.prefix_len, r.prompt_len) for r in rooms]
        for host in self.hosts:
            host.submit("run_decode", self.name, f"{LOOPBACK}:{p_port}", plans, timeout_s)

    def answered(self) -> bool:
        return all(host.ready() for host in self.hosts)

    def collect(self, timeout_s: float) -> tuple[dict[int, list[str]], Stamps]:
        """Each room's final state per rank and the rooms' stamps (one per rank)."""
        results: dict[int, list[str]] = {}
        stamps: Stamps = {}
        for host in self.hosts:
            for room, states in host.result(timeout_s).items():
                results.setdefault(room, []).extend(states)
        for host in self.hosts:
            for key, values in host.call("marks").items():
                stamps.setdefault(key, []).extend(values)
        return results, stamps

    def errors(self) -> list[str]:
        return [line for host in self.hosts for line in host.call("errors")]

    def pids(self) -> list[int]:
        """Every process of this instance (a child per rank; TokenSpeed starts none below)."""
        return [pid for host in self.hosts for pid in procstat.descendants(host.pid)]

    def close(self) -> None:
        for host in self.hosts:
            host.close()


Instance = TokenSpeedInstance | TspdInstance | HostedInstance


def _lists(table: dict[str, npt.NDArray[np.int64]]) -> dict[str, list[int]]:
    return {g: ids.tolist() for g, ids in table.items()}


def _port(p: Instance) -> int:
    if isinstance(p, TokenSpeedInstance | HostedInstance):
        return p.port
    assert p.server is not None, "a tspd P instance hosts its bootstrap server"
    return p.server.port


def budget_for(model: Model, tp: int, pages: int) -> int:
    """Cache bytes per rank that give at least ``pages`` pages (packing and padding included)."""
    probe = build_contract(tspd_spec(model, tp, 1 << 24))
    budget = probe.plan.arena_bytes // probe.group(GID).page_count * (pages + 4)
    while build_contract(tspd_spec(model, tp, budget)).group(GID).page_count < pages:
        budget += budget // 8
    return budget


@dataclass
class Instances:
    """Both systems' P instance and D replica for one shape, on the same contracts."""

    model: Model
    p_tp: int
    d_tp: int
    budget: int
    p: dict[str, Instance] = field(default_factory=dict)
    d: dict[str, Instance] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        model: Model,
        p_tp: int,
        d_tp: int,
        pages: int,
        tunables: PdTunables | None = None,
        *,
        hosted: bool = False,
    ) -> Instances:
        """Start the four instances with room for ``pages`` pages per rank; checks that both
        systems' contracts are the same canonical JSON. ``hosted``: tspd's ranks each in a
        child process (:class:`~tspd_testing.interop.tspd_host.HostedInstance`), as
        TokenSpeed's are; otherwise in this process."""
        budget = max(budget_for(model, p_tp, pages), budget_for(model, d_tp, pages))
        out = cls(model, p_tp, d_tp, budget)
        try:
            for role, tp, into in (("p", p_tp, out.p), ("d", d_tp, out.d)):
                ts = TokenSpeedInstance(role, model, tp, budget)
                into["tokenspeed"] = ts
                ours = build_contract(tspd_spec(model, tp, budget))
                if encode_contract(ours) != ts.wire:
                    raise PairError(f"{model.name} TP {tp}: the two recipes' contracts differ")
                if hosted:
                    into["tspd"] = HostedInstance(role, ours, tp, tunables or PdTunables())
                    continue
                start = start_prefill if role == "p" else start_decode
                into["tspd"] = start(ours, tp, tunables or PdTunables())
        except BaseException:
            out.close()
            raise
        return out

    def contracts(self) -> tuple[CacheContract, CacheContract]:
        return self.p["tspd"].views[0].contract, self.d["tspd"].views[0].contract

    def close(self) -> None:
        # TokenSpeed's first: its heartbeats must not outlive the tspd servers they probe.
        for inst in [*self.p.values(), *self.d.values()]:
            if isinstance(inst, TokenSpeedInstance):
                inst.close()
        for inst in [*self.p.values(), *self.d.values()]:
            if not isinstance(inst, TokenSpeedInstance):
                inst.close()

    def errors(self) -> list[str]:
        """ERROR lines the children logged, TokenSpeed's and hosted tspd ranks' (in-process
        tspd ranks log to this process's log)."""
        return [
            line
            for inst in [*self.p.values(), *self.d.values()]
            if not isinstance(inst, TspdInstance)
            for line in inst.errors()
        ]


@dataclass(frozen=True, slots=True)
class Timed:
    """One pair run: its times (seconds) and what the P side put on the wire."""

    transfer_s: float
    latency_s: float
    descriptors: int  #: descriptors P handed Mooncake (tspd: after staging and cutting runs)


def run(
    p: Instance,
    d: Instance,
    rooms: Sequence[Room_],
    *,
    snapshots: Sequence[npt.NDArray[np.uint8]] | None = None,
    timeout_s: float = 120.0,
    engine_flow: bool = False,
    count: bool = True,
) -> Timed:
    """Move ``rooms`` (their sources tagged by the caller: :func:`tag_sources`) from ``p`` to
    ``d``; raises :class:`PairError` unless every rank ended every room as expected and every
    destination page holds its room's identity (with ``snapshots`` of D's arenas: and no
    other D byte changed). ``engine_flow``: tspd's side does what its engine does by default
    (:func:`~tspd_testing.interop.tspd_side.drive_many`); TokenSpeed's side always does what its
    executors do. ``count``: also count the descriptors P handed Mooncake (a metrics call to
    each P rank before and after, outside the timed span; False: ``descriptors`` is 0)."""
    port = _port(p)
    ts = [x for x in (p, d) if isinstance(x, TokenSpeedInstance)]
    hosted = [x for x in (d, p) if isinstance(x, HostedInstance)]  # D first, as drive_many
    ours = [x for x in (d, p) if isinstance(x, TspdInstance)]
    before = _descriptors(p) if count else 0
    for x in ts:  # P first: its senders exist before D's registrations arrive
        x.submit(rooms, port, timeout_s)
    for y in hosted:
        y.submit(rooms, port, timeout_s, engine_flow)
    children: list[TokenSpeedInstance | HostedInstance] = [*ts, *hosted]
    if ours:
        finals, tspd_stamps = drive_many(
            ours,
            rooms,
            (LOOPBACK, port),
            lambda: all(x.answered() for x in children),
            timeout_s,
            engine_flow,
        )
    else:
        finals, tspd_stamps = [], []
    stamps: dict[int, Stamps] = dict(zip(map(id, ours), tspd_stamps, strict=True))
    problems: list[str] = []
    for t in ts:
        results, stamps[id(t)] = t.collect(timeout_s)
        problems += _ts_problems(t, rooms, results)
    ended: list[tuple[Instance, dict[int, dict[RequestId, PdEvent]]]] = list(
        zip(ours, finals, strict=True)
    )
    for y in hosted:
        final, stamps[id(y)] = y.collect(timeout_s)
        ended.append((y, final))
    for side, final in ended:
        problems += failed(final)
        want = RemotePrefill if side is d else Succeeded
        problems += [
            f"{(side is d and 'D') or 'P'} rank {i}: {r.rid} ended {f.get(r.rid)!r}"
            for i, f in final.items()
            for r in rooms
            if not isinstance(f.get(r.rid), want)
        ]
    if not problems:
        problems = (
            verify(d.views, rooms, snapshots) if snapshots is not None else _identity(d, rooms)
        )
    if problems:
        raise PairError(f"{len(problems)} problem(s): {problems[:3]}")
    ps, ds = stamps[id(p)], stamps[id(d)]
    transfer, latency = [], []
    for r in rooms:
        done = max(ds[(r.room, "done")])
        transfer.append(done - min(ps[(r.room, "handed")]))
        latency.append(done - min(*ps[(r.room, "registered")], *ds[(r.room, "registered")]))
    return Timed(max(transfer), max(latency), _descriptors(p) - before if count else 0)


def _descriptors(p: Instance) -> int:
    """The descriptors P's ranks handed to Mooncake so far."""
    if isinstance(p, TokenSpeedInstance):
        return sum(int(host.call("sent")["descriptors"]) for host in p.hosts)
    if isinstance(p, HostedInstance):
        return p.descriptors()
    # After staging and cutting: what the worker handed Mooncake (its metric of that name).
    return sum(int(peer.metrics().total(WIRE_DESCRIPTORS)) for peer in p.peers)


def _ts_problems(
    x: TokenSpeedInstance, rooms: Sequence[Room_], got: dict[int, list[str]]
) -> list[str]:
    problems = []
    for r in rooms:
        want = "success" if x.role == "p" else f"token {r.token}"
        states = got.get(r.room, [])
        if states != [want] * x.tp:
            problems.append(f"TokenSpeed {x.role.upper()} room {r.room}: {states}")
    return problems


def _identity(d: Instance, rooms: Sequence[Room_]) -> list[str]:
    """Every destination page of ``rooms`` holds its room's identity (the other bytes are not
    checked: the one-page rooms' check, cheap whatever the arena's size)."""
    problems: list[str] = []
    for i, view in enumerate(d.views):
        for r in rooms:
            for spec in view.contract.group_specs:
                span = slot_range(spec, r.prefix_len, r.prompt_len)
                slots = np.arange(span.start, span.stop)
                pages = r.d_table[spec.group_id][slots]
                found = check_identity(view, spec.group_id, slots, pages, r.room)
                problems += [f"D{i} room {r.room}: {p}" for p in found]
    return problems


def room(
    number: int,
    tokens: int,
    p_pages: npt.NDArray[np.int64],
    d_pages: npt.NDArray[np.int64],
    gid: str = GID,
) -> Room_:
    """A room of ``tokens`` tokens (no prefix hit) on these pages of each side."""
    return Room_(number, tokens, 0, {gid: p_pages}, {gid: d_pages}, 100 + number % 1000)


def tag(p: Instance, rooms: Sequence[Room_]) -> None:
    """Write each room's identity into P's pages of it (on every P rank)."""
    tag_sources(p.views, rooms)


def fill(d: Instance, value: int) -> list[npt.NDArray[np.uint8]]:
    """Fill D's arenas with one byte value (a new one per round: a page a room missed then
    reads stale); their snapshots, for ``run(..., snapshots=...)``."""
    out = []
    for view in d.views:
        view.arena.fill(value % 256)
        out.append(view.arena.copy())
    return out
