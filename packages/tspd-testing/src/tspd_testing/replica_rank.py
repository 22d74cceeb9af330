"""One engine rank of a multi-process PD replica: the loop a real engine would run, scripted.

Each rank is its own process with its own transfer worker; the ranks of one replica form a gloo
group and agree on every round's events through ``poll(mesh)``. Pages come from the real
scheduler's :class:`~tspd_core.sched.BlockPool` (one per rank; every rank of a replica sees the
same events in the same rounds, so the pools evolve identically). P fills a request's pages with
its identity (:mod:`tspd_testing.identity`) as a prefill would; D zeroes and publishes,
and checks every page byte-exact on RemotePrefill. Run by
:class:`tspd_testing.replicas.Replica`; the pipe to the parent carries pickled harness
values only (nothing here is a wire format).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection as mpc
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, build_contract, build_manifest, encode_contract
from tspd_core.pd.config import DecodePeerConfig, PdTunables, PrefillPeerConfig
from tspd_core.pd.decode.peer import DecodeOutbox, DecodePeer, RemotePrefillRow
from tspd_core.pd.errors import PeerError
from tspd_core.pd.events import BootstrapInfo, Bootstrapped, Failed, PdEvent, RemotePrefill
from tspd_core.pd.peer.agreement import SOLO, GlooMesh, Mesh
from tspd_core.pd.peer.transfer_peer import TransferPeer
from tspd_core.pd.prefill.peer import FirstToken, PrefillOutbox, PrefillPeer, RemoteDecodeRow
from tspd_core.pd.proc import forkserver
from tspd_core.sched import BlockPool
from tspd_testing.identity import RankView, check_identity, fill_identity

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoomScript:
    """One request: registered on every rank of its replica in round ``at_round``."""

    rid: str
    room: int
    prompt_len: int
    prefix_len: int  #: D's prefix hit (D fills those pages itself, as a cache hit would)
    token: int
    at_round: int
    bootstrap: tuple[str, int]  #: the P instance's bootstrap server


@dataclass(frozen=True, slots=True)
class ReplicaScript:
    """What every rank of one replica runs."""

    side: str  #: "p" or "d"
    arena: ArenaSpec  #: tp_size = the replica's size (tp_rank is set per rank)
    rooms: tuple[RoomScript, ...]
    tunables: PdTunables
    p_bootstrap: str | None = None  #: P: where its ranks register (host:port)
    kill_worker: tuple[int, int] | None = None  #: P: (rank, after that many hand-overs)
    max_rounds: int = 200_000  #: a deterministic stop (the same on every rank)
    idle_wait_s: float = 0.003


@dataclass
class RankResult:
    """What one rank saw: its (round, event, rid) log, outcomes, pool counts, problems."""

    side: str
    rank: int
    log: list[tuple[int, str, str]] = field(default_factory=list)
    outcome: dict[str, tuple[str, str]] = field(default_factory=dict)  #: rid -> (event, detail)
    event_times: dict[str, float] = field(default_factory=dict)  #: rid -> final event time
    free_start: int = 0
    free_end: int = 0
    problems: list[str] = field(default_factory=list)
    rounds: int = 0
    tracked_end: int = 0
    killed_at: float | None = None
    lost_at: float | None = None  #: when the engine found its worker gone
    metrics: dict[str, Any] = field(default_factory=dict)


class RankEngine:
    """One rank's peer, pool and loop (see the module docstring)."""

    def __init__(
        self, script: ReplicaScript, rank: int, size: int, note: Callable[[str], None]
    ) -> None:
        self.script, self.rank = script, rank
        self._note = note  # tells the parent (the "launcher") what an operator would see
        spec = dataclasses.replace(script.arena, tp_rank=rank)
        self.contract = build_contract(spec)
        self.gid = self.contract.group_ids()[0]
        self.g = self.contract.plan.prefix_granularity
        arena = torch.zeros(self.contract.plan.arena_bytes, dtype=torch.uint8)
        arena.share_memory_()  # type: ignore[no-untyped-call]
        self.view = RankView(arena.numpy(), self.contract, size, rank)
        kw: dict[str, Any] = {
            "contract": encode_contract(self.contract).decode(),
            "arena": arena,
            "tp_size": size,
            "tp_rank": rank,
            "host": "127.0.0.1",
            "tunables": script.tunables,
            "start_method": "spawn",  # from a forkserver child: no second forkserver per rank
        }
        self.peer: TransferPeer
        self.outbox: PrefillOutbox | DecodeOutbox
        if script.side == "p":
            assert script.p_bootstrap is not None
            self.peer, self.outbox = PrefillPeer.start(
                PrefillPeerConfig(bootstrap_url=script.p_bootstrap, **kw)
            )
        else:
            self.peer, self.outbox = DecodePeer.start(DecodePeerConfig(**kw))
        self.mesh: Mesh = SOLO
        if size > 1:
            import torch.distributed as dist

            self.mesh = GlooMesh([dist.group.WORLD])
        self.pool = BlockPool(self.contract.group(self.gid).page_count - 1)
        self.tables: dict[str, npt.NDArray[np.int64]] = {}
        self.rooms = {r.rid: r for r in script.rooms}
        self.handed = 0
        self.out = RankResult(script.side, rank, free_start=self.pool.free_count())

    def run(self) -> RankResult:
        waves: dict[int, list[RoomScript]] = {}
        for r in self.script.rooms:
            waves.setdefault(r.at_round, []).append(r)
        last = max(waves, default=0)
        queued: list[RoomScript] = []
        rnd = 0
        while rnd < last or queued or self.peer.has_in_flight():
            if rnd >= self.script.max_rounds:
                break
            rnd += 1
            queued += waves.get(rnd, [])
            # Admit in order while the pool has room; every rank's pool is in the same state
            # (the same events in the same rounds), so every rank admits the same requests.
            while queued and self.pool.free_count() >= self._pages(queued[0]):
                self._admit(queued.pop(0))
            events = self.peer.poll(self.mesh)
            if self.peer.worker_lost is not None and self.out.lost_at is None:
                self.out.lost_at = time.monotonic()
                self._note("worker_lost")
            for e in events:
                self.out.log.append((rnd, type(e).__name__, str(e.rid)))
                self._react(e)
            if not events:
                mpc.wait([self.peer.fileno()], timeout=self.script.idle_wait_s)
        self.out.rounds = rnd
        self.out.tracked_end = self.peer.tracked_count()
        self.out.free_end = self.pool.free_count()
        self.out.metrics = self.peer.metrics().families
        return self.out

    def _pages(self, r: RoomScript) -> int:
        return -(-r.prompt_len // self.g)

    def _admit(self, r: RoomScript) -> None:
        pages = self.pool.allocate(self._pages(r)).astype(np.int64)
        self.tables[r.rid] = pages
        if self.script.side == "p":
            fill_identity(self.view, {self.gid: pages}, salt=r.room)
        elif r.prefix_len:
            fill_identity(self.view, {self.gid: pages[: r.prefix_len // self.g]}, salt=r.room)
        self.peer.register(RequestId(r.rid), BootstrapInfo(*r.bootstrap, Room(r.room)))

    def _react(self, e: PdEvent) -> None:
        rid = str(e.rid)
        r = self.rooms[rid]
        if isinstance(e, Bootstrapped):
            self._on_bootstrapped(r)
            return
        detail = e.reason if isinstance(e, Failed) else ""
        if isinstance(e, RemotePrefill):
            detail = str(e.first_token)
            self._verify(r, e)
        self.out.outcome[rid] = (type(e).__name__, detail)
        self.out.event_times[rid] = time.monotonic()
        self.pool.decref(self.tables.pop(rid))

    def _on_bootstrapped(self, r: RoomScript) -> None:
        pages = self.tables[r.rid]
        if isinstance(self.outbox, DecodeOutbox):
            m = build_manifest(self.contract, {self.gid: pages}, r.prefix_len, r.prompt_len)
            self.outbox.stage_remote_prefill([RemotePrefillRow(RequestId(r.rid), m)])
            self.outbox.hand_over_remote_prefill()
            return
        row = RemoteDecodeRow(RequestId(r.rid), pages, 0, r.prompt_len)
        self.outbox.stage_remote_decode([row])
        try:
            self.outbox.hand_over_remote_decode({RequestId(r.rid): FirstToken(r.token)})
        except PeerError:
            return  # the worker is gone: the room fails at the next poll, on every rank
        self.handed += 1
        kill = self.script.kill_worker
        if kill is not None and kill == (self.rank, self.handed):
            os.kill(self.peer._worker.pid, signal.SIGKILL)
            self.out.killed_at = time.monotonic()

    def _verify(self, r: RoomScript, e: RemotePrefill) -> None:
        pages = self.tables[r.rid]
        slots = np.arange(pages.size)
        found = check_identity(self.view, self.gid, slots, pages, r.room)
        self.out.problems += [f"{r.rid}: {p}" for p in found]
        if e.first_token != r.token:
            self.out.problems.append(f"{r.rid}: first token {e.first_token}, want {r.token}")


def rank_main(
    script: ReplicaScript,
    rank: int,
    size: int,
    store: str,
    conn: Any,
    server: forkserver.Server | None = None,
) -> None:
    """Entry point of one engine rank process (see
    :class:`tspd_testing.replicas.Replica`); its worker comes from ``server``."""
    forkserver.adopt(server)
    logging.basicConfig(level=logging.WARNING)
    import torch.distributed as dist

    if size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=120),  # a broken test fails, it does not hang
        )
    engine = None
    try:
        engine = RankEngine(script, rank, size, lambda what: conn.send(("note", what)))
        conn.send(("ready", engine.peer._worker.pid))
        if conn.recv() == "go":
            conn.send(("done", engine.run()))
            conn.recv()  # serve (late frames of other replicas) until the parent says stop
    except EOFError:
        pass  # the parent went away: stop
    except Exception as exc:
        log.exception("engine rank %s%d failed", script.side, rank)
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        if engine is not None:
            engine.peer.shutdown()
        if size > 1:
            dist.destroy_process_group()
