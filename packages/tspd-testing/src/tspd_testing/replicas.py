"""Real multi-process P and D replicas on one host: for tests, benchmarks and demos.

A :class:`Replica` is N engine processes (one per TP rank, a gloo group of N), each starting
its own transfer worker, each running the scripted engine loop of
:mod:`tspd_testing.replica_rank`. Several replicas run at once (a P instance, a D instance,
...), each with its own round counter; they meet only through the PD protocol — the bootstrap
server, ZMQ and Mooncake — exactly as separate engines would::

    test process                       engine processes (gloo group per replica)
    ────────────                       ─────────────────────────────────────────
    BootstrapServer (HTTP thread)      p0 ─ worker   p1 ─ worker   ...   (P replica)
    Replica.start ── script ─────────► d0 ─ worker   d1 ─ worker         (D replica)
    wait_ready ◄──── ("ready", pid) ── every rank
    go ───────────── "go" ───────────► rounds: register, poll(mesh), react
    results ◄─────── RankResult ────── log, outcomes, pools, problems, metrics

Start every replica, wait until all are ready (P ranks are registered with their bootstrap
server by then), then ``go`` them all.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as tmp

from tspd_core.pd.errors import PdError
from tspd_core.pd.proc import forkserver
from tspd_core.pd.proc.handle import PRELOAD
from tspd_testing.replica_rank import RankResult, ReplicaScript, rank_main

STOP_S = 20.0


class Replica:
    """The engine processes of one replica (close it, or use ``with``)."""

    def __init__(self, name: str, script: ReplicaScript) -> None:
        self.name = name
        self.script = script
        self.size = script.arena.tp_size
        self._dir = tempfile.TemporaryDirectory(prefix="tspd-replica-")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self.worker_pids: list[int] = []

    def start(self) -> Replica:
        ctx: Any = tmp.get_context("forkserver")
        # The ranks' modules, and the workers' (the same server may start their workers).
        preload = [*PRELOAD, "tspd_testing.replica_rank"]
        ctx.set_forkserver_preload(preload)
        server = forkserver.running(preload)  # each rank starts its worker from it
        store = os.path.join(self._dir.name, "store")
        for rank in range(self.size):
            ours, theirs = ctx.Pipe()
            # Not daemonic: an engine rank starts its own transfer worker process.
            proc = ctx.Process(
                target=rank_main,
                args=(self.script, rank, self.size, store, theirs, server),
                name=f"tspd-engine-{self.name}{rank}",
                daemon=False,
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> list[int]:
        """Every rank's transfer worker pid, once all serve; :class:`PdError` otherwise."""
        self.worker_pids = [self._expect(c, "ready", timeout_s) for c in self._conns]
        return self.worker_pids

    def go(self) -> None:
        for c in self._conns:
            c.send("go")

    def results(self, timeout_s: float) -> list[RankResult]:
        """Every rank's result (ranks finish in the same round, give or take the pipe)."""
        return gather([self], timeout_s)[self.name]

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send("stop")
            except OSError:
                pass
        for p in self._procs:
            p.join(STOP_S)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self._conns:
            c.close()
        self._dir.cleanup()

    def __enter__(self) -> Replica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _expect(self, conn: Any, kind: str, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise PdError(f"replica {self.name}: no {kind!r} from a rank in {timeout_s:g} s")
        got, value = conn.recv()
        if got != kind:
            raise PdError(f"replica {self.name}: a rank answered {got}: {value}")
        return value


#: ``on_note(replica name, rank, note)``: what a rank reports mid-run (e.g. "worker_lost"),
#: for the test to act as a launcher would (stop an instance's bootstrap server, ...).
OnNote = Callable[[str, int, str], None]


def gather(
    replicas: list[Replica], timeout_s: float, on_note: OnNote | None = None
) -> dict[str, list[RankResult]]:
    """Every rank's result, by replica; mid-run notes go to ``on_note`` as they come."""
    pending: dict[Any, tuple[Replica, int]] = {
        c: (r, rank) for r in replicas for rank, c in enumerate(r._conns)
    }
    out: dict[str, list[Any]] = {r.name: [None] * r.size for r in replicas}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        ready = mpc.wait(list(pending), timeout=max(0.0, left))
        if not ready:
            stuck = sorted(f"{r.name}{rank}" for r, rank in pending.values())
            raise PdError(f"ranks {stuck} did not finish in {timeout_s:g} s")
        for conn in ready:
            replica, rank = pending[conn]
            assert isinstance(conn, mpc.Connection)
            kind, value = conn.recv()
            if kind == "note":
                if on_note is not None:
                    on_note(replica.name, rank, value)
                continue
            if kind != "done":
                raise PdError(f"replica {replica.name} rank {rank} answered {kind}: {value}")
            out[replica.name][rank] = value
            del pending[conn]
    return out


def run_replicas(
    replicas: list[Replica],
    timeout_s: float,
    ready_s: float = 180.0,
    on_note: OnNote | None = None,
) -> dict[str, list[RankResult]]:
    """Start every replica, ``go`` them together, return each one's results by name."""
    for r in replicas:
        r.start()
    try:
        for r in replicas:
            r.wait_ready(ready_s)
        for r in replicas:
            r.go()
        return gather(replicas, timeout_s, on_note)
    finally:
        for r in replicas:
            r.close()
