"""Layerwise streaming: forward start -> Success with the transfer overlapping the prefill.

One 4,096-token prompt of the 8B-class layout (Llama-3-8B: 32 layers, 8 KV heads, head dim
128, bf16, 16-token pages: 512 MiB) goes from P TP 1 to D TP 1 through real peers (bootstrap
server, transfer worker processes, ZMQ, Mooncake over loopback TCP). The P forward is
simulated: each of its 32 producer steps "computes" for a fixed time (a sleep: on a GPU the
host and the NIC are free meanwhile), then advances the step counter. Measured per run, from
the forward's start:

* off (baseline, same cluster, same run): rows staged, handed over after the last step;
* on: rows armed before the forward, each layer sent as the counter passes it, the first
  token handed over after the forward.

Success is the moment the engine-side poll of D yields RemotePrefill (the scheduler loop runs
on the main thread, the forward on its own, as in an engine). Each setting runs off and on
interleaved, best of the rounds. Reported: both times, on/off, the transfer's exposed tail
(Success − forward end) in each mode, the time saved, and the overlap achieved as the share
of off's exposed tail that layerwise hid (1 − on tail / off tail). D's pages are compared with
P's after every run.
"""

from __future__ import annotations

import argparse
import multiprocessing.connection as mpc
import threading
import time

import numpy as np
from common import table

from tspd_core.ids import RequestId, Room
from tspd_core.layout import llama3_8b
from tspd_core.pd import BootstrapInfo, Bootstrapped, Failed, RemotePrefill, Succeeded
from tspd_core.pd.transfer.mooncake import quiet_mooncake_logs
from tspd_testing.identity import page_mask
from tspd_testing.layerwise_loopback import PrefillJob, SimulatedForward
from tspd_testing.loopback import LoopbackCluster, Outcome, RoomPlan

PAGE = 16
GID = "full_attention"


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench_layerwise")
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, one round")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=int, default=1, help="producer steps per interval")
    parser.add_argument(
        "--layer-ms", default="2,12,25", help="simulated compute per layer (ms), comma-separated"
    )
    opts = parser.parse_args(args)
    tokens = 1024 if opts.quick else opts.tokens
    rounds = 1 if opts.quick else opts.rounds
    settings = [float(x) for x in opts.layer_ms.split(",")]
    quiet_mooncake_logs(debug=False)
    pages = tokens // PAGE
    spec = llama3_8b(num_pages=pages + 8)
    print(f"{tokens} tokens, 8B layout, interval {opts.interval}: P TP1 -> D TP1", flush=True)
    with LoopbackCluster([spec], [spec], layerwise_interval=opts.interval) as cluster:
        bench = _Bench(cluster, tokens)
        bench.once(0.0, layerwise=False)  # warm-up: connections, registrations
        bench.once(0.0, layerwise=True)
        results = [bench.setting(ms / 1e3, rounds) for ms in settings]
    rows = [
        [
            r["layer_ms"],
            r["forward_s"] * 1e3,
            r["off_s"] * 1e3,
            r["on_s"] * 1e3,
            r["on_vs_off"],
            r["off_tail_s"] * 1e3,
            r["on_tail_s"] * 1e3,
            r["saved_s"] * 1e3,
            r["tail_hidden"],
        ]
        for r in results
    ]
    print("\nforward start -> Success on D (ms, best of the rounds)")
    print(table(HEADERS, rows))
    return {"tokens": tokens, "interval": opts.interval, "bytes": bench.nbytes, "cases": results}


HEADERS = ["ms/layer", "forward", "off", "on", "on/off", "off tail", "on tail", "saved", "hidden"]


class _Bench:
    """One cluster, one room at a time: P's pages random, D's zeroed before each run."""

    def __init__(self, cluster: LoopbackCluster, tokens: int) -> None:
        self.cluster, self.tokens = cluster, tokens
        pages = tokens // PAGE
        self.table = np.arange(1, pages + 1, dtype=np.int64)
        self.mask = page_mask(cluster.p[0].view.contract, {GID: self.table})
        self.nbytes = int(self.mask.sum())
        cluster.p[0].arena.random_(0, 256)
        self.forward = SimulatedForward(cluster, write=False)
        self.n = 0

    def setting(self, compute_s: float, rounds: int) -> dict[str, float]:
        best: dict[bool, dict[str, float]] = {}
        for _ in range(rounds):
            for layerwise in (False, True):
                got = self.once(compute_s, layerwise)
                if layerwise not in best or got["total"] < best[layerwise]["total"]:
                    best[layerwise] = got
            print(
                f"  {compute_s * 1e3:g} ms/layer: off {best[False]['total'] * 1e3:.0f} ms, "
                f"on {best[True]['total'] * 1e3:.0f} ms",
                flush=True,
            )
        off, on = best[False], best[True]
        return {
            "layer_ms": compute_s * 1e3,
            "forward_s": on["forward"],
            "off_s": off["total"],
            "on_s": on["total"],
            "on_vs_off": on["total"] / off["total"],
            "off_tail_s": off["tail"],
            "on_tail_s": on["tail"],
            "saved_s": off["total"] - on["total"],
            "tail_hidden": 1.0 - on["tail"] / off["tail"] if off["tail"] > 0 else 0.0,
        }

    def once(self, compute_s: float, layerwise: bool) -> dict[str, float]:
        """One room: register, bootstrap, then time forward start -> RemotePrefill on D."""
        self.n += 1
        plan = RoomPlan(
            RequestId(f"lw-{self.n}"),
            Room(10_000 + self.n),
            self.tokens,
            0,
            {GID: self.table},
            {GID: self.table},
            token=self.n,
        )
        d = self.cluster.d[0]
        d.view.arena[self.mask] = 0
        self._bootstrap(plan)
        self.forward.compute_s = compute_s
        job = PrefillJob(plan)
        marks: dict[str, float] = {}

        def forward() -> None:
            marks["start"] = time.perf_counter()
            self.forward.run({0: [(job, 0)]}, layerwise=layerwise)
            marks["end"] = time.perf_counter()

        thread = threading.Thread(target=forward, name="bench-forward")
        thread.start()
        done = self._await(plan)
        thread.join()
        if not np.array_equal(d.view.arena[self.mask], self.cluster.p[0].view.arena[self.mask]):
            raise SystemExit("D's pages differ from P's after the transfer")
        return {
            "total": done - marks["start"],
            "forward": marks["end"] - marks["start"],
            "tail": max(done - marks["end"], 0.0),
        }

    def _bootstrap(self, plan: RoomPlan) -> None:
        host, port = self.cluster.bootstrap
        p, d = self.cluster.p[0], self.cluster.d[0]
        for rank in (p, d):
            rank.peer.register(plan.rid, BootstrapInfo(host, port, plan.room))
        seen: dict[str, bool] = {"p": False, "d": False}
        deadline = time.monotonic() + 60
        while not all(seen.values()):
            if time.monotonic() > deadline:
                raise SystemExit("the room did not bootstrap within 60 s")
            if any(isinstance(e, Bootstrapped) for e in d.peer.poll()):
                seen["d"] = True
                self.cluster._react("d", d, [Bootstrapped(plan.rid)], {plan.rid: plan}, Outcome())
            seen["p"] |= any(isinstance(e, Bootstrapped) for e in p.peer.poll())
            mpc.wait([p.peer.fileno(), d.peer.fileno()], timeout=0.005)

    def _await(self, plan: RoomPlan) -> float:
        """Poll like a scheduler loop until D's RemotePrefill (its time) and P's Succeeded."""
        p, d = self.cluster.p[0], self.cluster.d[0]
        done: float | None = None
        succeeded = False
        deadline = time.monotonic() + 600
        while done is None or not succeeded:
            if time.monotonic() > deadline:
                raise SystemExit("the room did not finish within 600 s")
            for e in d.peer.poll():
                if isinstance(e, Failed):
                    raise SystemExit(f"the room failed on D: {e.reason}")
                if isinstance(e, RemotePrefill):
                    done = time.perf_counter()
            succeeded |= any(isinstance(e, Succeeded) for e in p.peer.poll())
            mpc.wait([p.peer.fileno(), d.peer.fileno()], timeout=0.001)
        return done
