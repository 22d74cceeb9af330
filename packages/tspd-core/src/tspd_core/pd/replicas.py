"""Real multi-process P and D replicas on one host: for tests, benchmarks and demos.

A :class:`Replica` is N engine processes (one per TP rank, a gloo group of N), each starting
its own transfer worker, each running the scripted engine loop of
:mod:`tspd_core.pd.replica_rank`. Several replicas run at once (a P instance, a D instance,
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

import os
import tempfile
import time
from typing import Any

import torch.multiprocessing as tmp

from tspd_core.pd.errors import PdError
from tspd_core.pd.replica_rank import RankResult, ReplicaScript, rank_main

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
        ctx.set_forkserver_preload(["torch", "numpy", "zmq"])
        store = os.path.join(self._dir.name, "store")
        for rank in range(self.size):
            ours, theirs = ctx.Pipe()
            # Not daemonic: an engine rank starts its own transfer worker process.
            proc = ctx.Process(
                target=rank_main,
                args=(self.script, rank, self.size, store, theirs),
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
        deadline = time.monotonic() + timeout_s
        return [self._expect(c, "done", max(1.0, deadline - time.monotonic())) for c in self._conns]

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


def run_replicas(
    replicas: list[Replica], timeout_s: float, ready_s: float = 180.0
) -> dict[str, list[RankResult]]:
    """Start every replica, ``go`` them together, return each one's results by name."""
    for r in replicas:
        r.start()
    try:
        for r in replicas:
            r.wait_ready(ready_s)
        for r in replicas:
            r.go()
        return {r.name: r.results(timeout_s) for r in replicas}
    finally:
        for r in replicas:
            r.close()
