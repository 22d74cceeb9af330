"""A whole P instance and D replica on one host: for tests, benchmarks and demos.

:class:`LoopbackCluster` starts a real bootstrap server (in this process), one PrefillPeer per
P rank and one DecodePeer per D rank (each with its own transfer worker process and shared
arena), then drives rooms through the real protocol the way an engine's scheduler would::

    register on every rank ─► D: Bootstrapped ─► stage + hand over the manifest
                             P: Bootstrapped ─► stage the prompt, hand over with the token
                             P: Succeeded, D: RemotePrefill (or Failed) ─► done

Each rank polls with the single-member agreement (a replica of one), so every rank acts on its
own events; the ranks of one side share one block table per room, as replicated schedulers do.

``device="cuda"`` puts every arena (and P's step counters) on the GPU: the workers map them
through CUDA IPC handles and Mooncake moves GPU memory; the identity oracle works on a host
copy of each arena (:class:`~tspd_testing.mirror.DeviceArena`), pushed before the
transfers and pulled before the checks.

``credential`` turns the cluster credential on for the bootstrap server and every rank
(``d_credential`` gives the D ranks another one, or none).

The two sides may sit on two hosts: ``d_host`` is the D ranks' address (``host`` P's and the
bootstrap server's), and ``within(side, start)`` runs each side's start (``"p"``: the bootstrap
server and the P ranks; ``"d"``: the D ranks) where that side lives, e.g. on a thread inside its
network namespace (:meth:`tspd_testing.netns.Network.call`). A rank's worker process is
created by the thread that starts the rank and so shares its namespace, with
``start_method="spawn"`` (a forkserver, started once, would put every worker in its own).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.connection as mpc
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.multiprocessing as tmp

from tspd_bootstrap.auth import ClusterCredential
from tspd_bootstrap.server import BootstrapServer
from tspd_core.ids import RequestId, Room
from tspd_core.layout import (
    ArenaSpec,
    BlockManifest,
    CacheContract,
    build_contract,
    build_manifest,
    canonical_layout_text,
    encode_contract,
    slot_range,
)
from tspd_core.pd.config import DecodePeerConfig, PdTunables, PrefillPeerConfig
from tspd_core.pd.decode.peer import DecodeOutbox, DecodePeer, RemotePrefillRow
from tspd_core.pd.errors import PdError
from tspd_core.pd.events import (
    BootstrapInfo,
    Bootstrapped,
    Failed,
    PdEvent,
    RemotePrefill,
    Succeeded,
)
from tspd_core.pd.layerwise.step_counter import StepCounter
from tspd_core.pd.peer.transfer_peer import TransferPeer
from tspd_core.pd.prefill.peer import FirstToken, PrefillOutbox, PrefillPeer, RemoteDecodeRow
from tspd_testing.identity import RankView, check_identity, fill_identity, page_mask
from tspd_testing.mirror import DeviceArena

Table = dict[str, npt.NDArray[np.int64]]


@dataclass(frozen=True, slots=True, eq=False)
class RoomPlan:
    """One request: its room, lengths, and each side's block table (slot -> page id).

    ``d_table`` covers every slot; slots before ``prefix_len // G`` are D's prefix hit.
    """

    rid: RequestId
    room: Room
    prompt_len: int
    prefix_len: int
    p_table: Table
    d_table: Table
    token: int = 1


@dataclass(slots=True)
class Rank:
    """One rank of the cluster: its peer, outbox and arena (``view.arena`` is its host bytes:
    the arena itself on CPU, a copy on CUDA, see ``mirror``)."""

    peer: TransferPeer
    outbox: PrefillOutbox | DecodeOutbox
    arena: torch.Tensor
    view: RankView
    mirror: DeviceArena


@dataclass(slots=True)
class Outcome:
    """What a drive produced: every event per (side, rank), and when each room finished."""

    events: dict[tuple[str, int], list[PdEvent]] = field(default_factory=dict)
    done_at: dict[RequestId, float] = field(default_factory=dict)
    handed_at: dict[RequestId, float] = field(default_factory=dict)  #: P's last hand-over
    started: float = 0.0
    #: When the engine side first saw each step of a request (perf_counter seconds):
    #: "d_bootstrapped", "d_published" (manifest handed over), "p_bootstrapped", "p_handed".
    marks: dict[tuple[RequestId, str], float] = field(default_factory=dict)

    def final(self, side: str, rank: int) -> dict[RequestId, PdEvent]:
        """The last event of each request on one rank."""
        return {e.rid: e for e in self.events[(side, rank)] if not isinstance(e, Bootstrapped)}


#: Runs ``start`` for side ``"p"`` or ``"d"`` where that side lives; returns what it returns.
Within = Callable[[str, Callable[[], Any]], Any]


def _here(side: str, start: Callable[[], Any]) -> Any:
    return start()


class LoopbackCluster:
    """A bootstrap server, P ranks and D ranks on loopback, or on two hosts (``d_host``,
    ``within``: see the module docstring). Close it, or use ``with``."""

    def __init__(
        self,
        p_specs: Sequence[ArenaSpec],
        d_specs: Sequence[ArenaSpec],
        tunables: PdTunables | None = None,
        host: str = "127.0.0.1",
        mooncake_env: dict[str, str] | None = None,
        layerwise_interval: int = 0,
        draft_layers: int = 0,
        counter_start: int = 0,
        device: str = "cpu",
        d_host: str | None = None,
        within: Within = _here,
        start_method: str = "forkserver",
        early_manifest: bool = True,
        early_prefill: bool = False,
        credential: ClusterCredential | None = None,
        d_credential: ClusterCredential | str | None = "same",
    ) -> None:
        self.p_specs, self.d_specs = list(p_specs), list(d_specs)
        # A D replica of one rank stages its manifest with the registration, as the engine
        # does (docs/pd.md); several D ranks wait for their Bootstrapped event.
        self.early_manifest = early_manifest and len(self.d_specs) == 1
        self._published: set[tuple[int, RequestId]] = set()  # (id(D rank), request) staged
        # P hands its chunk over with the registration, as an engine that prefills before
        # Bootstrapped does (PdConfig.prefill_early): the worker holds it until Bootstrapped.
        # Off by default: the throughput benchmarks time P's hand-over -> D's RemotePrefill.
        self.early_prefill = early_prefill and not layerwise_interval
        self._handed: set[tuple[int, RequestId]] = set()  # (id(P rank), request) handed over
        self.device = torch.device(device)
        self.tunables = tunables or PdTunables.from_env()
        # P ranks stream layerwise when > 0, each with its own step counter from counter_start.
        self.layerwise = (layerwise_interval, draft_layers, counter_start)
        self.host = host  #: P's ranks and the bootstrap server
        self.d_host = d_host or host  #: D's ranks
        self.within = within
        self.start_method = start_method
        self.mooncake_env = dict(mooncake_env or {})
        # The cluster credential of the server and the P ranks, and the D ranks' ("same").
        self.credential = credential
        self.d_credential = d_credential if not isinstance(d_credential, str) else credential
        self.server = BootstrapServer(
            host, 0, layout_canonicalizer=canonical_layout_text, credential=credential
        )
        self.p: list[Rank] = []
        self.d: list[Rank] = []

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> LoopbackCluster:
        if self.within is not _here:
            # A process-wide helper the first spawned worker would start (multiprocessing's
            # resource tracker) is started here, so it stays out of the sides' namespaces.
            resource_tracker.ensure_running()
        try:
            self.within("p", self.server.start)
            for spec in self.p_specs:
                self.p.append(self.within("p", functools.partial(self._start_rank, spec, True)))
            for spec in self.d_specs:
                self.d.append(self.within("d", functools.partial(self._start_rank, spec, False)))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Shut every peer down (workers joined), then the bootstrap server."""
        for rank in [*self.p, *self.d]:
            rank.peer.shutdown()
        self.server.close()

    @property
    def bootstrap(self) -> tuple[str, int]:
        return self.host, self.server.port

    def _start_rank(self, spec: ArenaSpec, prefill: bool) -> Rank:
        contract = build_contract(spec)
        mirror = DeviceArena(contract.plan.arena_bytes, self.device)
        arena = mirror.arena
        text = encode_contract(contract).decode()
        peer: TransferPeer
        outbox: PrefillOutbox | DecodeOutbox
        if prefill:
            peer, outbox = PrefillPeer.start(
                PrefillPeerConfig(
                    contract=text,
                    arena=arena,
                    tp_size=spec.tp_size,
                    tp_rank=spec.tp_rank,
                    host=self.host,
                    tunables=self.tunables,
                    mooncake_env=self.mooncake_env,
                    start_method=self.start_method,
                    bootstrap_url=self.server.url,
                    credential=self.credential,
                    layerwise_interval=self.layerwise[0],
                    draft_layers=self.layerwise[1],
                    step_counter=StepCounter(self.device, start=self.layerwise[2])
                    if self.layerwise[0]
                    else None,
                )
            )
        else:
            peer, outbox = DecodePeer.start(
                DecodePeerConfig(
                    contract=text,
                    arena=arena,
                    tp_size=spec.tp_size,
                    tp_rank=spec.tp_rank,
                    host=self.d_host,
                    tunables=self.tunables,
                    mooncake_env=self.mooncake_env,
                    start_method=self.start_method,
                    credential=self.d_credential,
                )
            )
        view = RankView(mirror.numpy(), contract, spec.tp_size, spec.tp_rank)
        return Rank(peer, outbox, arena, view, mirror)

    # ---- driving rooms ------------------------------------------------------------------

    def drive(self, rooms: Sequence[RoomPlan], timeout_s: float = 60.0) -> Outcome:
        """Run ``rooms`` concurrently to completion on every rank; raises on a timeout."""
        by_rid = {r.rid: r for r in rooms}
        out = Outcome(started=time.perf_counter())
        ranks = [("p", i, r) for i, r in enumerate(self.p)] + [
            ("d", i, r) for i, r in enumerate(self.d)
        ]
        for side, i, _ in ranks:
            out.events[(side, i)] = []
        self.register(rooms, out)
        deadline = time.monotonic() + timeout_s
        while any(rank.peer.has_in_flight() for _, _, rank in ranks):
            if time.monotonic() > deadline:
                raise PdError(f"rooms still in flight after {timeout_s:g} s: {self._stuck()}")
            busy = self.publish_zeroed()
            for side, i, rank in ranks:
                events = rank.peer.poll()
                busy |= bool(events)
                out.events[(side, i)].extend(events)
                self._react(side, rank, events, by_rid, out)
            if not busy:
                ready = mpc.wait([r.peer.fileno() for _, _, r in ranks], timeout=0.01)
                # Real engines poll their own rank only; here one loop polls them all, so
                # the ranks with news go first (the others would only delay them).
                ranks.sort(key=lambda r: r[2].peer.fileno() not in ready)
        return out

    def register(self, rooms: Sequence[RoomPlan], out: Outcome) -> None:
        """Register every room on every rank, D first (its look-up and registration start
        the critical path; P only waits); a D replica of one rank stages its manifest with
        the registration (``early_manifest``), in the same write to its worker."""
        host, port = self.bootstrap
        for plan in rooms:
            for rank in [*self.d, *self.p]:
                early = self.early_manifest and any(rank is d for d in self.d)
                # As the engine's decode link: both in one write to the worker.
                with rank.peer.batch() if early else contextlib.nullcontext():
                    rank.peer.register(plan.rid, BootstrapInfo(host, port, plan.room))
                    if early:
                        self._publish(rank, [plan], out)
            if self.early_prefill:
                for rank in self.p:
                    self._hand_over(rank, [plan], out)

    def _react(
        self,
        side: str,
        rank: Rank,
        events: list[PdEvent],
        rooms: dict[RequestId, RoomPlan],
        out: Outcome,
    ) -> None:
        boot = [rooms[e.rid] for e in events if isinstance(e, Bootstrapped)]
        seen = time.perf_counter()
        for r in boot:
            out.marks.setdefault((r.rid, f"{side}_bootstrapped"), seen)
        if boot and side == "d":
            late = [r for r in boot if (id(rank), r.rid) not in self._published]
            if late:  # not staged with the registration
                self._publish(rank, late, out)
        elif boot:
            late = [r for r in boot if (id(rank), r.rid) not in self._handed]
            if late:  # not handed over with the registration
                self._hand_over(rank, late, out)
        now = time.perf_counter()
        for e in events:
            if isinstance(e, RemotePrefill | Succeeded | Failed):
                out.done_at[e.rid] = max(out.done_at.get(e.rid, 0.0), now)

    def _hand_over(self, rank: Rank, plans: Sequence[RoomPlan], out: Outcome) -> None:
        """Stage and hand over P's whole prompt of ``plans`` with its first token."""
        assert isinstance(rank.outbox, PrefillOutbox)
        gids = rank.view.contract.group_ids()
        rows = [
            RemoteDecodeRow(r.rid, [r.p_table[g] for g in gids], 0, r.prompt_len) for r in plans
        ]
        rank.outbox.stage_remote_decode(rows)
        rank.outbox.hand_over_remote_decode({r.rid: FirstToken(r.token) for r in plans})
        for r in plans:
            self._handed.add((id(rank), r.rid))
            out.handed_at[r.rid] = time.perf_counter()
            out.marks.setdefault((r.rid, "p_handed"), out.handed_at[r.rid])

    def _publish(self, rank: Rank, plans: Sequence[RoomPlan], out: Outcome) -> None:
        """Stage and hand over D's manifests of ``plans`` (zeroing their pages first)."""
        assert isinstance(rank.outbox, DecodeOutbox)
        rows = [RemotePrefillRow(r.rid, self.d_manifest(rank.view.contract, r)) for r in plans]
        rank.outbox.stage_remote_prefill(rows)
        rank.outbox.hand_over_remote_prefill()
        for r in plans:
            self._published.add((id(rank), r.rid))
            out.marks.setdefault((r.rid, "d_published"), time.perf_counter())

    def publish_zeroed(self) -> bool:
        """Hand over the D manifests whose pages' zeroing has finished (on CUDA it runs
        asynchronously: a manifest staged in one round may go out rounds later); returns
        whether any is still waiting, so a driving loop keeps polling instead of sleeping."""
        waiting = False
        for rank in self.d:
            assert isinstance(rank.outbox, DecodeOutbox)
            if rank.outbox.remote_prefill_pending():
                rank.outbox.hand_over_remote_prefill()
                waiting |= rank.outbox.remote_prefill_pending()
        return waiting

    @staticmethod
    def d_manifest(contract: CacheContract, plan: RoomPlan) -> BlockManifest:
        return build_manifest(contract, plan.d_table, plan.prefix_len, plan.prompt_len)

    # ---- identity oracle ----------------------------------------------------------------

    def tag(self, rooms: Sequence[RoomPlan], seed: int = 0) -> list[npt.NDArray[np.uint8]]:
        """Fill P pages with each room's identity, D arenas with noise; return D snapshots."""
        for rank in self.p:
            for plan in rooms:
                fill_identity(rank.view, plan.p_table, salt=plan.room)
            rank.mirror.push()
        rng = np.random.default_rng(seed)
        snapshots = []
        for rank in self.d:
            rank.view.arena[:] = rng.integers(0, 256, rank.view.arena.size, dtype=np.uint8)
            rank.mirror.push()
            snapshots.append(rank.view.arena.copy())
        return snapshots

    def verify(
        self, rooms: Sequence[RoomPlan], snapshots: Sequence[npt.NDArray[np.uint8]]
    ) -> list[str]:
        """Every destination page holds its room's identity; every other byte is unchanged."""
        problems: list[str] = []
        for i, rank in enumerate(self.d):
            rank.mirror.pull()
            contract = rank.view.contract
            touched: dict[str, list[npt.NDArray[np.int64]]] = {g: [] for g in contract.group_ids()}
            for plan in rooms:
                for spec in contract.group_specs:
                    slots = np.arange(*_bounds(slot_range(spec, plan.prefix_len, plan.prompt_len)))
                    pages = plan.d_table[spec.group_id][slots]
                    touched[spec.group_id].append(pages)
                    found = check_identity(rank.view, spec.group_id, slots, pages, plan.room)
                    problems += [f"D{i} room {plan.room}: {p}" for p in found]
            mask = page_mask(contract, {g: np.concatenate(v) for g, v in touched.items()})
            changed = int((rank.view.arena[~mask] != snapshots[i][~mask]).sum())
            if changed:
                problems.append(f"D{i}: {changed} bytes outside the destination pages changed")
        return problems

    def _stuck(self) -> str:
        return ", ".join(
            f"{type(r.peer).__name__}[{i}]: {r.peer.tracked_count()}"
            for i, r in enumerate([*self.p, *self.d])
        )


def _bounds(r: range) -> tuple[int, int]:
    return r.start, r.stop


def plan_rooms(
    p_contract: CacheContract,
    d_contract: CacheContract,
    count: int,
    max_prompt: int,
    seed: int = 0,
    prefix_share: float = 0.3,
) -> list[RoomPlan]:
    """``count`` concurrent rooms of mixed lengths, some with a prefix hit on D.

    Page ids are drawn without replacement from each side's pool (rooms run at the same time),
    shuffled so block tables are fragmented as after churn.
    """
    rng = np.random.default_rng(seed)
    g = p_contract.plan.prefix_granularity
    p_free = _shuffled_pool(p_contract, rng)
    d_free = _shuffled_pool(d_contract, rng)
    plans = []
    for n in range(count):
        prompt = int(rng.integers(1, max_prompt + 1))
        full = prompt // g if prompt % g else prompt // g - 1
        prefix = g * int(rng.integers(0, full + 1)) if full and rng.random() < prefix_share else 0
        slots = -(-prompt // g)
        p_table = {gid: _take(p_free[gid], slots, gid) for gid in p_contract.group_ids()}
        d_table = {gid: _take(d_free[gid], slots, gid) for gid in d_contract.group_ids()}
        room = Room(int(rng.integers(0, 2**63 - 1)))
        plans.append(RoomPlan(RequestId(f"req-{n}"), room, prompt, prefix, p_table, d_table, n + 7))
    return plans


def _shuffled_pool(contract: CacheContract, rng: np.random.Generator) -> dict[str, list[int]]:
    return {
        gid: rng.permutation(np.arange(1, contract.group(gid).page_count)).tolist()
        for gid in contract.group_ids()
    }


def _take(free: list[int], n: int, gid: str) -> npt.NDArray[np.int64]:
    if len(free) < n:
        raise PdError(f"group {gid}: the arena has too few pages for these rooms")
    taken, free[:] = free[:n], free[n:]
    return np.asarray(taken, dtype=np.int64)


def poll_events(peer: TransferPeer, want: int = 1, timeout_s: float = 20.0) -> list[PdEvent]:
    """Poll ``peer`` (a replica of one) until it yielded ``want`` events or ``timeout_s``
    passed; every event it yielded, in order (fewer than ``want`` on a timeout)."""
    got: list[PdEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += peer.poll()
        peer.wait(0.02)
    return got


def assert_nothing_left_behind(timeout_s: float = 10.0) -> None:
    """Raise unless every transfer worker process (``tspd-*``) this process started and every
    embedded bootstrap server thread is gone within ``timeout_s`` (test modules' leak check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = [p.name for p in tmp.active_children() if p.name.startswith("tspd-")]
        servers = [t.name for t in threading.enumerate() if t.name.startswith("tspd-bootstrap")]
        if not workers and not servers:
            return
        if time.monotonic() >= deadline:
            left = f"worker processes {workers}, server threads {servers}"
            raise AssertionError(f"left behind: {left}")
        time.sleep(0.1)
