"""Moving a prompt's KV from P to D through tspd's peers, against raw Mooncake and raw TCP.

The payload is a 4,096-token prompt of an 8B-class layout (Llama-3-8B: 32 layers, 8 KV heads,
head dim 128, bf16, 16-token pages: 256 pages, 512 MiB), moved by real peers (bootstrap
server, transfer worker processes sharing the arenas, ZMQ, Mooncake over loopback TCP):

* equal TP (P TP 1 -> D TP 1) and re-slicing (P TP 2 -> D TP 1; P TP 4 -> D TP 2; P TP 3 ->
  D TP 1 on the same layout with 6 KV heads, 384 MiB, each beside a TP 1 -> 1 of its bytes);
* block tables contiguous (runs coalesce) and scrambled as after churn (one run per page per
  field, or per head slice when re-slicing).

Baselines measured in the same run, interleaved round by round so machine noise hits both (in
each round a group's tspd rooms run back to back, then their baselines):
* raw Mooncake: a dedicated process writes the very same descriptors (same bytes, same batch
  shapes, <= 512 per call) from its own engine into the D worker's arena through Mooncake's
  own synchronous batch call (tspd writes through a window of asynchronous descriptors);
* loopback TCP: one Python socket stream of the same byte count.

tspd's time runs from P's hand-over (the forward finished) to D's RemotePrefill event, so it
includes planning the copies, the Success message and the engine-side poll. The round trip of
a one-page request is register -> RemotePrefill on D (both sides registered at once, D's
manifest handed over with its registration), median and p99, for the 8B layout and for a tiny
layout (the control plane alone), each with P handing its chunk over after its Bootstrapped
event or with its registration (an engine that prefills at once: PdConfig.prefill_early), and
each quiet and with two CPU-bound processes beside it (started here; blocks of trips
alternate, the spinners stopped with SIGSTOP in between), with the median of each step the
engine side sees. ``--breakdown`` also says where each millisecond goes, stage by stage, from
the ``tspd_core.trace`` stamps of every process (engine side, both workers). The machine's
load average is printed and recorded.

``--device cuda`` puts every arena on the GPU (the workers map them through CUDA IPC, Mooncake
reads and writes GPU memory, staging gathers and scatters on the device); the TCP baseline
stays host memory.

Across hosts (as root where ``ip netns`` works; ``--no-veth`` skips it, and it is skipped with
one line elsewhere): the contiguous cases also run with P and D on two hosts, network
namespaces joined by veth pairs through a bridge (:mod:`tspd_testing.netns`): the
bootstrap server and P's ranks and workers on one, D's on the other, so every Mooncake byte
crosses the veth. Those clusters run in the same rounds as the loopback ones; the "across
hosts" table gives each side's best round, their ratio and the median of the per-round ratios,
and one TCP stream across the veth beside the loopback one.

Side by side with TokenSpeed (``--only tokenspeed``; also run by default when TokenSpeed's
runtime is found, skipped with one line when not, see :mod:`transfer_tokenspeed`): its own PD
peers against tspd's on the same contracts and block tables, GB/s and one-page latency, and
the mixed pairs (TokenSpeed on one side: no staging).

Each figure is the best of the rounds. Targets: tspd >= 90 % of raw Mooncake and >= 60 % of
loopback TCP; P2->D1 >= 90 % of equal TP on the same bytes, best / best and the median of the
per-round ratios (issue 37; it was 80 %); one-page round trip of the control plane <= 3 ms
median with two busy processes beside it (issue 22).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.multiprocessing as tmp
import transfer_tokenspeed
from breakdown import by_request, chain, figures
from common import table

from tspd_core import trace
from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, PageLayout, PlaneArrangement, build_manifest, llama3_8b
from tspd_core.layout.copies import plan_copies
from tspd_core.layout.routes import plan_routes
from tspd_core.pd.config import PdTunables
from tspd_core.pd.transfer.byterows import split_runs
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs
from tspd_testing import procstat
from tspd_testing.loopback import LoopbackCluster, RoomPlan
from tspd_testing.netns import Network, clean_leftovers, unavailable

PAGE = 16
GB = 1e9


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    p_tp: int
    scrambled: bool
    arrangement: PlaneArrangement = PlaneArrangement.PER_FIELD
    direct_too: bool = True  #: also run a cluster that never stages (to show the pick)
    layout: PageLayout | None = None  #: K/V page order; None = the recipe's default
    veth_too: bool = False  #: also run P and D on two hosts (namespaces joined by a veth)
    d_tp: int = 1
    kv_heads: int = 8  #: 6 for TP 3 (Llama-3-8B's 8 do not split over 3)


# Cases in a group run at the same time, round by round, so their ratios share the noise.
GROUPS = [
    [
        Case("TP1->TP1 contiguous", 1, False, direct_too=False, veth_too=True),
        Case("TP2->TP1 contiguous", 2, False, veth_too=True),
    ],
    [Case("TP1->TP1 scrambled", 1, True), Case("TP2->TP1 scrambled", 2, True)],
    [Case("TP1->TP1 scrambled page-major", 1, True, PlaneArrangement.PAGE_MAJOR, False)],
    [
        Case("TP1->TP1 contiguous (for 4->2)", 1, False, direct_too=False),
        Case("TP4->TP2 contiguous", 4, False, direct_too=False, d_tp=2),
        Case("TP1->TP1 scrambled (for 4->2)", 1, True, direct_too=False),
        Case("TP4->TP2 scrambled", 4, True, direct_too=False, d_tp=2),
    ],
    [
        Case("TP1->TP1 contiguous, 6 heads", 1, False, direct_too=False, kv_heads=6),
        Case("TP3->TP1 contiguous, 6 heads", 3, False, direct_too=False, kv_heads=6),
        Case("TP1->TP1 scrambled, 6 heads", 1, True, direct_too=False, kv_heads=6),
        Case("TP3->TP1 scrambled, 6 heads", 3, True, direct_too=False, kv_heads=6),
    ],
]


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench_transfer")
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, one round")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trips", type=int, default=200,
                        help="one-page round trips per layout, half of them quiet and half "
                             "with two busy processes beside them")  # fmt: skip
    parser.add_argument("--only", choices=["throughput", "round-trip", "tokenspeed"],
                        help="run one part only")  # fmt: skip
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="round trips: where the time goes, stage by stage, from tspd_core.trace stamps "
        "of every process (adds ~50 µs a trip)",
    )
    parser.add_argument(
        "--layouts",
        default="",
        help="comma-separated K/V page orders (hnd,nhd) to run every per-field case in, side "
        "by side in the same rounds; default: the recipe's default order only",
    )
    parser.add_argument("--device", default="cpu", help="where the arenas live: cpu or cuda[:N]")
    parser.add_argument(
        "--no-veth", action="store_true", help="skip the runs across two hosts (network namespaces)"
    )
    parser.add_argument(
        "--try-slots",
        default="",
        metavar="SLOTS/PER_RANK",
        help="also run each re-slicing case with D's staging memory cut into SLOTS slots, "
        "PER_RANK granted to each P rank (e.g. 16/4), in the same rounds",
    )
    parser.add_argument(
        "--ts-tokens",
        type=int,
        default=512,
        help="tokenspeed part: the prompt of its throughput rooms (512: 64 MiB "
        "of Llama-3-8B's cache, ~3 s a round on TokenSpeed's NHD 2 -> 1, ~5 s on its 4 -> 2)",
    )
    parser.add_argument(
        "--ts-trips", type=int, default=40, help="tokenspeed part: one-page rooms per pair"
    )
    parser.add_argument(
        "--ts-tables",
        default="contiguous,scrambled",
        help="tokenspeed part: block tables of its throughput rooms",
    )
    parser.add_argument(
        "--ts-shapes",
        default="",
        help="tokenspeed part: a comma-separated subset of its shapes, e.g. "
        "'NHD 2 -> 1' (default: all)",
    )
    parser.add_argument(
        "--ts-tspd-ranks",
        choices=["process", "bench"],
        default="process",
        help="tokenspeed part: where tspd's engine-side ranks run: a child process each, as "
        "TokenSpeed's ranks run here and as a deployment runs them (default), or all on the "
        "benchmark's one thread",
    )
    parser.add_argument(
        "--ts-cpu-threads",
        action="store_true",
        help="tokenspeed part: also break each side's CPU per one-page room down by process "
        "and thread name (a process per rank only)",
    )
    parser.add_argument("--ts-try", default="",
                        help="tokenspeed part: also a tspd P so tuned against TokenSpeed's D "
                             "and tspd's D, comma-separated, e.g. window=256,lanes=8+window=256,"
                             "window=0+batch=4096,inline_staged=0 (window: descriptors in "
                             "flight; batch: per Mooncake call; inline, inline_staged: the "
                             "largest direct / staged job P's control thread starts; "
                             "stage_below, stage_few_below, stage_runs: when a job is staged; "
                             "lanes: MC_TCP_LANES_PER_PEER)")  # fmt: skip
    parser.add_argument(
        "--no-raw",
        action="store_true",
        help="throughput: tspd's rooms only, no raw Mooncake writes and no never-staging "
        "clusters (their one descriptor per 1 KiB row takes ~20 s a round at NHD re-slicing); "
        "the ratios to TP 1 -> 1 are the same rooms",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="throughput: also each case's CPU seconds per GB (its tspd rooms, every process "
        "of the run, by process and thread name)",
    )
    parser.add_argument(
        "--no-wide",
        action="store_true",
        help="skip the P TP 4 -> D TP 2 and P TP 3 -> D TP 1 groups (six and four peers)",
    )
    opts = parser.parse_args(args)
    groups = _groups([PageLayout(x) for x in opts.layouts.split(",") if x])
    if opts.no_wide:
        groups = [g for g in groups if all(c.p_tp <= 2 for c in g)]
    if opts.no_raw:
        groups = [[dataclasses.replace(c, direct_too=False) for c in g] for g in groups]
    tokens = 1024 if opts.quick else opts.tokens
    rounds = 1 if opts.quick else opts.rounds
    trips = 40 if opts.quick else opts.trips
    quiet_mooncake_logs(debug=False)
    load_before = os.getloadavg()
    print(f"load average (1, 5, 15 min): {load_before}; arenas on {opts.device}", flush=True)
    results: dict[str, object] = {"device": opts.device}
    traced = tempfile.TemporaryDirectory(prefix="bench-trace-") if opts.breakdown else None
    if traced is not None:
        # Before any worker starts: they inherit it (through the forkserver, started once).
        trace.enable(traced.name)
    if opts.only in (None, "throughput"):
        slots = _slots(opts.try_slots)
        results |= _throughput(
            groups, tokens, rounds, opts.device, opts.no_veth, slots, not opts.no_raw, opts.cpu
        )
    if opts.only in (None, "round-trip"):
        traced_at = Path(traced.name) if traced is not None else None
        results["round_trip"] = _round_trips(trips, opts.device, traced_at)
    if opts.only in (None, "tokenspeed") and opts.device != "cpu":
        print("tokenspeed part skipped: TokenSpeed's peers run on host arenas (--device cpu)")
    elif opts.only in (None, "tokenspeed"):
        results["tokenspeed"] = transfer_tokenspeed.run(
            128 if opts.quick else opts.ts_tokens,
            rounds,
            5 if opts.quick else opts.ts_trips,
            [x for x in opts.ts_tables.split(",") if x],
            [x.strip() for x in opts.ts_shapes.split(",") if x.strip()],
            [x for x in opts.ts_try.split(",") if x],
            hosted=opts.ts_tspd_ranks == "process",
            threads=opts.ts_cpu_threads,
        )
    if traced is not None:
        trace.disable()
        traced.cleanup()
    results["load_average"] = {"before": load_before, "after": os.getloadavg()}
    print(f"load average after: {os.getloadavg()}")
    return results


def _slots(text: str) -> PdTunables | None:
    """The --try-slots variant's tunables, or None."""
    if not text:
        return None
    slots, per_rank = (int(x) for x in text.split("/"))
    return PdTunables(staging_slots=slots, staging_slots_per_rank=per_rank)


def _throughput(
    groups: list[list[Case]],
    tokens: int,
    rounds: int,
    device: str,
    no_veth: bool,
    slots: PdTunables | None = None,
    raw: bool = True,
    cpu: bool = False,
) -> dict[str, object]:
    tcp = max(_loopback_tcp(tokens * 128 * 1024) for _ in range(max(rounds, 2)))
    print(f"loopback TCP, one stream: {tcp / GB:.3f} GB/s", flush=True)
    cases: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as hosts:
        net = None if no_veth else _two_hosts(hosts)
        veth_tcp = _veth_tcp(net, tokens * 128 * 1024, max(rounds, 2)) if net else None
        for group in groups:
            cases.update(_run_group(group, tokens, rounds, device, net, slots, raw, cpu))
    rows = []
    for group in groups:
        for case in group:
            equal = cases[_baseline(group, case).name]
            res = cases[case.name]
            res["vs_loopback_tcp"] = res["tspd_gbps"] * GB / tcp
            res["vs_equal_tp_same_tables"] = res["tspd_gbps"] / equal["tspd_gbps"]
            # Rounds of a group run back to back, so a round's ratio shares its noise.
            paired = zip(res["rounds_gbps"], equal["rounds_gbps"], strict=True)
            res["vs_equal_tp_round_median"] = statistics.median(a / b for a, b in paired)
            rows.append(_row(case.name, res))
    print("\nthroughput in GB/s (best round); direct = a cluster that never stages;")
    print("vs TP1 = best / best, rounds = median of the per-round ratios")
    print(table(HEADERS, rows))
    if cpu:
        _print_cpu(cases)
    results: dict[str, object] = {"loopback_tcp_gbps": tcp / GB, "tokens": tokens, "cases": cases}
    if veth_tcp is not None:
        results["veth_tcp_gbps"] = veth_tcp / GB
        _print_veth(tcp, veth_tcp, cases)
    return results


#: Threads per case the --cpu breakdown prints.
CPU_ROWS = 8


def _print_cpu(cases: dict[str, dict[str, Any]]) -> None:
    """Each case's CPU per GB moved, all processes of the run, by process/thread name."""
    print("\nCPU seconds per GB of the tspd rooms, every process of the run by process/thread "
          f"(the {CPU_ROWS} largest; python/python: this process, the ranks' engine sides, "
          "D's zeroing included)")  # fmt: skip
    for name, res in cases.items():
        split = res.get("cpu_s_per_gb")
        if not split:
            continue
        top = sorted(split.items(), key=lambda kv: -kv[1])[:CPU_ROWS]
        print(f"  {name}: total {sum(split.values()):.3f}; "
              + ", ".join(f"{k} {v:.3f}" for k, v in top))  # fmt: skip


def _baseline(group: list[Case], case: Case) -> Case:
    """The equal-TP case of ``group`` that moves the same bytes as ``case``: TP 1 -> 1 with its
    block tables, heads, page order and arrangement (else the group's first)."""
    same = [
        c
        for c in group
        if c.p_tp == c.d_tp == 1
        and (c.scrambled, c.kv_heads, c.layout, c.arrangement)
        == (case.scrambled, case.kv_heads, case.layout, case.arrangement)
    ]
    return same[0] if same else group[0]


def _groups(layouts: list[PageLayout]) -> list[list[Case]]:
    """GROUPS, or each per-field case once per page order (in one group: the same rounds)."""
    if not layouts:
        return GROUPS
    out = []
    for group in GROUPS:
        if group[0].arrangement is not PlaneArrangement.PER_FIELD:
            out.append(group)
            continue
        out.append(
            [
                dataclasses.replace(case, name=f"{case.name} {order.value}", layout=order)
                for order in layouts
                for case in group
            ]
        )
    return out


HEADERS = [
    "case",
    "descs",
    "KiB/desc",
    "raw",
    "direct",
    "tspd",
    "picked",
    "direct/raw",
    "tspd/raw (≥ 0.9)",
    "tspd/TCP (≥ 0.6)",
    "vs TP1 (≥ 0.9)",
    "rounds (≥ 0.9)",
]


def _row(name: str, res: dict[str, Any]) -> list[object]:
    return [
        name,
        int(res["descriptors"]),
        res["bytes"] / res["descriptors"] / 1024,
        res["raw_gbps"] or "-",
        res.get("tspd_direct_gbps", res["tspd_gbps"]),
        res["tspd_gbps"],
        "staged" if res["staged"] else "direct",
        res.get("tspd_direct_vs_raw", res["tspd_vs_raw"]) or "-",
        res["tspd_vs_raw"] or "-",
        res["vs_loopback_tcp"],
        res["vs_equal_tp_same_tables"],
        res["vs_equal_tp_round_median"],
    ]


# ---- a group of cases: raw Mooncake vs tspd, interleaved round by round ----------------------


class _CaseRun:
    """One case's clusters (auto, and maybe never-staging) and its raw-Mooncake writer."""

    def __init__(
        self,
        case: Case,
        tokens: int,
        stack: contextlib.ExitStack,
        device: str = "cpu",
        net: Network | None = None,
        slots: PdTunables | None = None,
        raw: bool = True,
        cpu: bool = False,
    ) -> None:
        self.case, pages = case, tokens // PAGE
        self.with_raw = raw
        #: CPU seconds of the tspd rooms by process/thread (--cpu), summed over rounds.
        self.cpu: dict[str, float] | None = {} if cpu else None
        p_specs = [_spec(case, case.p_tp, r, pages) for r in range(case.p_tp)]
        d_specs = [_spec(case, case.d_tp, r, pages) for r in range(case.d_tp)]
        variants = {"auto": PdTunables()}
        if case.direct_too:
            variants["direct"] = PdTunables(stage_below_bytes=0)
        if slots is not None and case.p_tp > 1:
            variants["slots"] = slots
        print(f"{case.name}: {len(variants)} cluster(s) of {case.p_tp} P + {case.d_tp} D",
              flush=True)  # fmt: skip
        self.clusters = {
            name: stack.enter_context(LoopbackCluster(p_specs, d_specs, tunables=t, device=device))
            for name, t in variants.items()
        }
        if case.veth_too and net is not None:
            print(f"{case.name}: the same across the veth (P and D on two hosts)", flush=True)
            self.clusters["veth"] = stack.enter_context(
                _veth_cluster(net, p_specs, d_specs, device)
            )
        self.writers = {}
        for name, cluster in self.clusters.items():
            for rank in cluster.p:
                rank.arena.random_(0, 256)
            self.writers[name] = _RawWriter(
                cluster, case, _tables(cluster, pages, case.scrambled), tokens
            )
            cluster.drive([self.writers[name].room_plan(-1, PAGE)], timeout_s=120)  # warm-up
        self.raw = self.writers["auto"]
        if raw:
            self.raw.warm_up()
        self.best = dict.fromkeys(["raw", *self.clusters], 0.0)
        self.rounds: list[float] = []  # tspd (auto) bytes/s of each round, for paired ratios
        self.line: list[str] = []  # this round's tspd figure, printed with its baselines
        self.veth_rounds: list[float] = []  # the veth cluster's, paired with self.rounds
        self.staged_before = self._staged()

    def tspd_round(self, n: int) -> None:
        """The case's tspd room (the cluster that picks staging itself)."""
        seconds = _tspd_once(self.clusters["auto"], self.writers["auto"], n, self.cpu)
        rate = self.raw.nbytes / seconds
        self.best["auto"] = max(self.best["auto"], rate)
        self.rounds.append(rate)
        self.line = [f"tspd-auto {rate / GB:.3f}"]

    def baseline_round(self, n: int) -> None:
        """The same round's baselines: raw Mooncake, and the other clusters (never staging,
        other slot cuts, across the veth)."""
        # Twice: the first write after an idle spell runs measurably slower (connection
        # warm-up inside Mooncake); the baseline gets the better of the two.
        line = list(self.line)
        if self.with_raw:
            raw = max(self.raw.nbytes / self.raw.write() for _ in range(2))
            self.best["raw"] = max(self.best["raw"], raw)
            line.insert(0, f"raw {raw / GB:.3f}")
        for name, cluster in self.clusters.items():
            if name == "auto":
                continue
            seconds = _tspd_once(cluster, self.writers[name], n)
            self.best[name] = max(self.best[name], self.raw.nbytes / seconds)
            line.append(f"tspd-{name} {self.raw.nbytes / seconds / GB:.3f}")
            if name == "veth":
                self.veth_rounds.append(self.raw.nbytes / seconds)
        print(f"  {self.case.name} round {n} (GB/s): {', '.join(line)}", flush=True)

    def result(self) -> dict[str, object]:
        raw, best = self.raw, self.best
        out: dict[str, object] = {
            "bytes": raw.nbytes,
            "descriptors": raw.descriptors,
            "raw_gbps": best["raw"] / GB if self.with_raw else None,
            "tspd_gbps": best["auto"] / GB,
            "tspd_vs_raw": best["auto"] / best["raw"] if self.with_raw else None,
            "staged": float(self._staged() > self.staged_before),
            "rounds_gbps": [r / GB for r in self.rounds],
        }
        if self.cpu is not None and self.rounds:
            moved = raw.nbytes * len(self.rounds) / GB
            out["cpu_s_per_gb"] = {k: v / moved for k, v in self.cpu.items() if v > 0}
        if "slots" in best:
            out["tspd_slots_gbps"] = best["slots"] / GB
        if "direct" in best:
            out["tspd_direct_gbps"] = best["direct"] / GB
            out["tspd_direct_vs_raw"] = best["direct"] / best["raw"] if self.with_raw else None
        if "veth" in best:
            out["veth_gbps"] = best["veth"] / GB
            out["veth_vs_loopback"] = best["veth"] / best["auto"]
            paired = zip(self.veth_rounds, self.rounds, strict=True)
            out["veth_vs_loopback_round_median"] = statistics.median(a / b for a, b in paired)
            out["veth_rounds_gbps"] = [r / GB for r in self.veth_rounds]
        return out

    def _staged(self) -> float:
        return sum(rank.peer.counters()["staged_jobs"] for rank in self.clusters["auto"].p)


def _run_group(
    group: list[Case],
    tokens: int,
    rounds: int,
    device: str = "cpu",
    net: Network | None = None,
    slots: PdTunables | None = None,
    raw: bool = True,
    cpu: bool = False,
) -> dict[str, dict[str, Any]]:
    print()
    with contextlib.ExitStack() as stack:
        runs = [_CaseRun(case, tokens, stack, device, net, slots, raw, cpu) for case in group]
        for run_ in runs:
            for writer in run_.writers.values():
                stack.callback(writer.close)
        for n in range(rounds):
            # The group's tspd rooms back to back, then their baselines: each tspd room follows
            # the other cases' rooms, not a baseline's seconds of raw writes (measured here: a
            # TP 1 -> 1 room right after two raw writes ran at 2.3-3.2 GB/s, after the TP 2 -> 1
            # room at 1.3-1.8, so the order alone moved the ratios by up to 2x).
            for run_ in runs:
                run_.tspd_round(n)
            for run_ in runs:
                run_.baseline_round(n)
        return {run_.case.name: run_.result() for run_ in runs}


def _tspd_once(
    cluster: LoopbackCluster, writer: _RawWriter, n: int, cpu: dict[str, float] | None = None
) -> float:
    """One room through the peers: P's hand-over -> D's RemotePrefill, checked byte-exact.
    ``cpu``: add the CPU seconds every process of this run spent on it, by process/thread."""
    plan = writer.room_plan(n)
    pids = procstat.descendants(os.getpid()) if cpu is not None else []
    before = procstat.by_thread(pids)
    outcome = cluster.drive([plan], timeout_s=600)
    if cpu is not None:
        procstat.add_since(cpu, before, pids)
    seconds = outcome.done_at[plan.rid] - outcome.handed_at[plan.rid]
    problems = writer.verify()
    if problems:
        raise SystemExit(f"D pages differ from P's: {problems[:3]}")
    return seconds


# ---- across two hosts (network namespaces joined by veth pairs) -------------------------------


def _two_hosts(stack: contextlib.ExitStack) -> Network | None:
    """Hosts "p" and "d" (namespaces on one bridge), or None with the reason printed."""
    why = unavailable()
    if why:
        print(f"runs across two hosts skipped: {why}", flush=True)
        return None
    clean_leftovers()
    return stack.enter_context(Network(("p", "d")))


def _veth_cluster(
    net: Network, p_specs: list[ArenaSpec], d_specs: list[ArenaSpec], device: str
) -> LoopbackCluster:
    """The bootstrap server and the P ranks on host "p", the D rank on "d": each rank's worker
    is spawned by a thread inside its host's namespace."""
    return LoopbackCluster(
        p_specs, d_specs, tunables=PdTunables(), host=net.hosts["p"].address, device=device,
        d_host=net.hosts["d"].address, within=net.call, start_method="spawn",
    )  # fmt: skip


def _veth_tcp(net: Network, nbytes: int, tries: int) -> float:
    """Bytes per second of one TCP stream from host "p" to host "d", the best of ``tries``."""
    address = net.hosts["d"].address
    best = 0.0
    for _ in range(tries):
        server = net.call("d", lambda: socket.create_server((address, 0)))
        with server:
            target = (address, server.getsockname()[1])
            send = functools.partial(_send, target, nbytes)
            sender = threading.Thread(target=net.call, args=("p", send))
            sender.start()
            best = max(best, _receive(server, nbytes))
            sender.join()
    print(f"TCP across the veth, one stream: {best / GB:.3f} GB/s", flush=True)
    return best


def _print_veth(tcp: float, veth_tcp: float, cases: dict[str, dict[str, Any]]) -> None:
    rows: list[list[object]] = [["TCP, one stream", tcp / GB, veth_tcp / GB, veth_tcp / tcp, "-"]]
    for name, res in cases.items():
        if "veth_gbps" in res:
            rows.append([name, res["tspd_gbps"], res["veth_gbps"], res["veth_vs_loopback"],
                         res["veth_vs_loopback_round_median"]])  # fmt: skip
    print("\nacross two hosts (P and D in network namespaces joined by veth pairs), GB/s, best")
    print("round; veth/loop = best / best, rounds = median of the per-round ratios")
    print(table(["case", "loopback", "veth", "veth/loop", "rounds"], rows))


def _spec(case: Case, tp: int, rank: int, pages: int) -> ArenaSpec:
    order = {} if case.layout is None else {"page_layout": case.layout}
    return llama3_8b(tp, rank, num_pages=pages + 8, arrangement=case.arrangement,
                     kv_heads=case.kv_heads, **order)  # fmt: skip


def _tables(cluster: LoopbackCluster, pages: int, scrambled: bool) -> tuple[np.ndarray, ...]:
    count = cluster.p[0].view.contract.group("full_attention").page_count
    if not scrambled:
        return np.arange(1, pages + 1), np.arange(1, pages + 1)
    rng = np.random.default_rng(7)
    ids = np.arange(1, count)
    return rng.permutation(ids)[:pages], rng.permutation(ids)[:pages]


class _RawWriter:
    """Raw Mooncake: a dedicated process (like a transfer worker) with its own engine writes
    the case's descriptors from the P arenas into the D worker's arena."""

    def __init__(
        self, cluster: LoopbackCluster, case: Case, tables: tuple[np.ndarray, ...], tokens: int
    ) -> None:
        self.cluster, self.tokens = cluster, tokens
        self.p_table, self.d_table = tables
        p_contracts = [rank.view.contract for rank in cluster.p]
        d_contracts = [rank.view.contract for rank in cluster.d]
        route = plan_routes(p_contracts[0], case.p_tp, d_contracts[0], case.d_tp)
        src = [build_manifest(c, {"full_attention": self.p_table}, 0, tokens) for c in p_contracts]
        dst = [build_manifest(c, {"full_attention": self.d_table}, 0, tokens) for c in d_contracts]
        # tspd's direct path cuts long runs (PdTunables.max_run_bytes): raw writes the same.
        limit = PdTunables().max_run_bytes
        #: (P rank, D rank, descriptors) of every pair that moves bytes.
        self.copies = []
        for d in range(case.d_tp):
            for p in route.targets(d):
                c = plan_copies(route, p, d, src[p], dst[d])
                self.copies.append((p, d, split_runs(c.src, c.dst, c.length, limit)))
        self.nbytes = sum(int(c[2].sum()) for _, _, c in self.copies)
        self.descriptors = sum(len(c[0]) for _, _, c in self.copies)
        self._conn: Any = None
        self._proc: Any = None
        self.last = 0.0

    def _start(self) -> None:
        targets = []
        for rank in self.cluster.d:
            ready = rank.peer._worker.ready
            assert ready is not None
            targets.append((ready.session_id, ready.base_ptr))
        ctx = tmp.get_context("forkserver")
        self._conn, child = ctx.Pipe()
        arenas = [rank.arena for rank in self.cluster.p]
        self._proc = ctx.Process(target=_raw_main, args=(arenas, targets, self.copies, child))
        self._proc.start()
        self._conn.recv()  # ready

    def write(self, first_only: bool = False) -> float:
        if self._proc is None:
            self._start()
        self._conn.send(first_only)
        self.last = float(self._conn.recv())
        return self.last

    def warm_up(self) -> None:
        """One small write per P rank: Mooncake's handshake and connections, off the clock."""
        self.write(first_only=True)

    def close(self) -> None:
        if self._proc is not None:
            self._conn.send(None)
            self._proc.join(10)

    def room_plan(self, n: int, tokens: int = 0) -> RoomPlan:
        table = {"full_attention": self.p_table}
        d_table = {"full_attention": self.d_table}
        room = Room(1_000_003 * (n + 2))
        return RoomPlan(RequestId(f"bench-{n}"), room, tokens or self.tokens, 0, table, d_table, 11)

    def verify(self) -> list[str]:
        for rank in [*self.cluster.p, *self.cluster.d]:
            rank.mirror.pull()  # the arenas' bytes on the host (CUDA; on CPU they are)
        bad = []
        for p_rank, d_rank, (srcs, dsts, lens) in self.copies:
            p, d = self.cluster.p[p_rank].view.arena, self.cluster.d[d_rank].view.arena
            for s, t, n in zip(srcs.tolist(), dsts.tolist(), lens.tolist(), strict=True):
                if not np.array_equal(p[s : s + n], d[t : t + n]):
                    bad.append(f"src {s} -> dst {t} ({n} bytes)")
        return bad


def _raw_main(
    arenas: list[Any], targets: list[tuple[str, int]], jobs: list[Any], conn: Any
) -> None:
    """The raw-Mooncake process: write every job (P rank, D rank, descriptors) on request,
    one after another, answer with the seconds taken. ``targets``: each D rank's session and
    arena base."""
    quiet_mooncake_logs(debug=False)
    engine = MooncakeEngine("127.0.0.1", window=0)  # Mooncake's own batch call
    for arena in arenas:
        engine.register(arena.data_ptr(), arena.numel())
    absolute = []
    for p, d, (s, t, n) in jobs:
        session, d_base = targets[d]
        src, dst = (s + arenas[p].data_ptr()).astype(np.uint64), (t + d_base).astype(np.uint64)
        absolute.append((session, src, dst, n.astype(np.uint64)))
    conn.send("ready")
    while (first_only := conn.recv()) is not None:
        t0 = time.perf_counter()
        for session, s, d, n in absolute:
            k = 1 if first_only else len(s)
            engine.write(session, s[:k], d[:k], n[:k])
        conn.send(time.perf_counter() - t0)
    engine.close()


# ---- loopback TCP ------------------------------------------------------------------------------


def _loopback_tcp(nbytes: int) -> float:
    """Bytes per second of one loopback TCP stream (Python sendall / recv_into, 4 MiB chunks)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = threading.Thread(target=_send, args=(server.getsockname(), nbytes))
        sender.start()
        rate = _receive(server, nbytes)
        sender.join()
    return rate


CHUNK = 4 << 20


def _send(address: tuple[str, int], nbytes: int) -> None:
    payload = memoryview(os.urandom(CHUNK))
    with socket.create_connection(address) as conn:
        for _ in range(nbytes // CHUNK):
            conn.sendall(payload)


def _receive(server: socket.socket, nbytes: int) -> float:
    """Accept one stream on ``server`` and read ``nbytes`` of it; bytes per second."""
    sink = bytearray(CHUNK)
    conn, _ = server.accept()
    got, t0 = 0, time.perf_counter()
    with conn:
        while got < nbytes // CHUNK * CHUNK:
            n = conn.recv_into(sink)
            if not n:
                break
            got += n
    return got / (time.perf_counter() - t0)


# ---- one-page round trips ----------------------------------------------------------------------


#: Steps of a round trip as the engine side sees them (LoopbackCluster's marks).
STEPS = [
    ("register, zero + hand over manifest (D engine)", "start", "d_published"),
    ("look-up, pre-allocation -> P bootstrapped", "d_published", "p_bootstrapped"),
    ("stage + hand over (P engine)", "p_bootstrapped", "p_handed"),
    ("plan, write, Success -> RemotePrefill", "p_handed", "done"),
]
#: Round trips run in blocks of this many, alternating quiet and loaded (shared noise).
BLOCK = 10
TARGET_TRIP_MS = 3.0
#: A CPU-bound process: what a busy engine beside the transfer worker looks like to the OS.
SPIN = "print('spinning', flush=True)\nwhile True:\n    pass\n"

#: The round trip's stages from the trace stamps (--breakdown): "" is this process (both
#: engine sides), the workers are labelled by role. D's chain to P's Bootstrapped, then P's
#: (by flow), then the write and the way back; the side stages run alongside.
_D_CHAIN = [
    ("", "|decode.register"),
    ("D engine: build + validate the manifest", "|d.stage"),
    ("D engine: zero pages, hand over", "|d.handover"),
    ("pipe + wake-up: manifest -> D worker", "decode-worker|dw.cmd:PublishManifest"),
    ("D worker: send the pre-allocation", "decode-worker|dw.prealloc_send"),
    ("ZMQ D -> P: encode, I/O threads, wake-up", "prefill-worker|pw.prealloc"),
    ("P worker: checks -> Bootstrapped", "prefill-worker|pw.notify:BOOTSTRAPPED"),
]
_P_AFTER = [
    ("pipe: note read by the P engine", "|prefill.note:BOOTSTRAPPED"),
    ("P engine: poll -> Bootstrapped event", "|prefill.event:Bootstrapped"),
    ("P engine: stage + hand over", "|p.handover"),
    ("pipe + wake-up: chunk -> P worker", "prefill-worker|pw.cmd:SubmitChunk"),
    ("P worker: plan copies", "prefill-worker|pw.planned"),
]
_P_EARLY = [("P worker: plan copies of the held chunk", "prefill-worker|pw.planned")]
_TAIL = [
    ("P worker: start the write", "prefill-worker|pw.write"),
    ("Mooncake write (TCP round trip)", "prefill-worker|pw.written"),
    ("P worker: job done -> Success", "prefill-worker|pw.success_send"),
    ("ZMQ P -> D: encode, I/O threads, wake-up", "decode-worker|dw.status:SUCCESS"),
    ("D worker: complete the room", "decode-worker|dw.notify:SUCCESS"),
    ("pipe: Success note read by the D engine", "|decode.note:SUCCESS"),
    ("D engine: poll -> RemotePrefill event", "|decode.event:RemotePrefill"),
]
_SIDE = [
    ("(alongside) pipe + wake-up: TrackRoom -> D worker", "|decode.register",
     "decode-worker|dw.cmd:TrackRoom"),
    ("(alongside) D worker: look-up -> Bootstrapped", "decode-worker|dw.cmd:TrackRoom",
     "decode-worker|dw.notify:BOOTSTRAPPED"),
]  # fmt: skip
TRIP_STAGES = {
    "after": chain([*_D_CHAIN, *_P_AFTER, *_TAIL]) + _SIDE,
    "early": chain([*_D_CHAIN, *_P_EARLY, *_TAIL]) + _SIDE,
}
#: The P side's two flows: its hand-over after the Bootstrapped event (the engine holds the
#: prefill until D's pages are ready), or with the registration (PdConfig.prefill_early: the
#: forward ran meanwhile; the worker holds the chunk until Bootstrapped).
FLOWS = {"after": "P hands over after Bootstrapped", "early": "P prefilled early"}


class Spinners:
    """``count`` CPU-bound processes beside the round trips: running (:meth:`load`) or
    stopped with SIGSTOP (:meth:`quiet`), so quiet and loaded trips can alternate."""

    def __init__(self, count: int = 2) -> None:
        self.procs = [
            subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
            for _ in range(count)
        ]
        for proc in self.procs:
            assert proc.stdout is not None
            proc.stdout.readline()  # it runs
        self.quiet()

    def quiet(self) -> None:
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGSTOP)

    def load(self) -> None:
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGCONT)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def _round_trips(trips: int, device: str = "cpu", traced: Path | None = None) -> dict[str, object]:
    """One-page round trips (register -> RemotePrefill), quiet and with two busy processes
    beside them, in alternating blocks; per layout and P flow (:data:`FLOWS`): median and
    p99 of each condition, and with ``traced`` (where every process writes its stamps) the
    stages of each."""
    tiny = ArenaSpec(layers=2, kv_heads=2, head_dim=64, page_size=PAGE, num_pages=64)
    layouts = [
        ("tiny layout (control plane)", "tiny", tiny),
        ("8B layout, 1 page (2 MiB)", "8b", llama3_8b(num_pages=64)),
    ]
    out: dict[str, Any] = {"load_average_before": os.getloadavg()}
    rows, steps, stages = [], [], []
    spinners = Spinners(2)
    try:
        for i, (name, tag, spec) in enumerate(layouts):
            for j, (flow, what) in enumerate(FLOWS.items()):
                label = f"{tag}-{flow}"
                rooms = 1_000_000 * (2 * i + j + 1)
                res, split = _trips(spec, trips, device, spinners, label, rooms, flow == "early")
                out[f"{name}, {what}"] = res
                for cond in ("quiet", "loaded"):
                    r = res[cond]
                    rows.append([name, what, cond, r["trips"], r["median_ms"], r["p99_ms"],
                                 r["steal_pct"]])  # fmt: skip
                if flow == "after":
                    steps += [[name, k, statistics.median(v)] for k, v in split.items()]
                if traced is not None:
                    figs = _trip_breakdown(traced, label, TRIP_STAGES[flow])
                    res["breakdown"] = figs
                    stages.append((f"{name}, {what}", figs))
    finally:
        spinners.close()
    out["load_average_after"] = os.getloadavg()
    print(f"\none-page round trips, blocks of {BLOCK} alternating quiet / 2 busy processes; "
          f"load average {out['load_average_before']} -> {out['load_average_after']}")  # fmt: skip
    headers = ["register -> RemotePrefill", "P", "condition", "trips", "median ms", "p99 ms",
               "steal %"]  # fmt: skip
    print(table(headers, rows))
    control = {f: out[f"{layouts[0][0]}, {w}"]["loaded"]["median_ms"] for f, w in FLOWS.items()}
    # The target holds for the engine's default flow (PdConfig.prefill_early); both printed.
    out["meets_target"] = control["early"] <= TARGET_TRIP_MS
    print(f"target: control plane <= {TARGET_TRIP_MS:g} ms median with 2 busy processes, "
          "for the engine's default flow (P prefilled early): "
          + ", ".join(f"{FLOWS[f]} {v:.2f} ms" for f, v in control.items())
          + (" (met)" if out["meets_target"] else " (MISSED)"))  # fmt: skip
    print(table(["layout", f"step (engine side, {FLOWS['after']})", "median ms"], steps))
    for name, figs in stages:
        print(f"\nwhere the time goes, {name} (median / p90 ms of each stage):")
        print(_stage_table(figs))
    return out


def _trips(
    spec: ArenaSpec,
    trips: int,
    device: str,
    spinners: Spinners,
    tag: str,
    rooms: int,
    early_prefill: bool,
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    times: dict[str, list[float]] = {"quiet": [], "loaded": []}
    split: dict[str, list[float]] = {label: [] for label, _, _ in STEPS}
    # CPU time the hypervisor gave other guests while a condition's trips ran (a VM's
    # "steal"): a slow run with steal is the host's, not the code's.
    stolen = {"quiet": 0, "loaded": 0}
    spent = {"quiet": 0.0, "loaded": 0.0}
    cluster = LoopbackCluster([spec], [spec], device=device, early_prefill=early_prefill)
    with cluster:
        for n in range(-5, trips):  # the first ones pay for connections and the look-up
            cond = "loaded" if n >= 0 and (n // BLOCK) % 2 else "quiet"
            if n % BLOCK == 0 or n == -5:
                spinners.load() if cond == "loaded" else spinners.quiet()
            steal0, wall0 = _steal_ticks(), time.monotonic()
            plan = RoomPlan(
                RequestId(f"{tag}-{cond}-{n}"),
                Room(rooms + n + 5),
                PAGE,
                0,
                {"full_attention": np.array([1 + n % 32])},
                {"full_attention": np.array([1 + (n * 7) % 32])},
                5,
            )
            outcome = cluster.drive([plan], timeout_s=60)
            if n < 0:
                continue
            stolen[cond] += _steal_ticks() - steal0
            spent[cond] += time.monotonic() - wall0
            times[cond].append(outcome.done_at[plan.rid] - outcome.started)
            marks = {k: v for (rid, k), v in outcome.marks.items() if rid == plan.rid}
            marks |= {"start": outcome.started, "done": outcome.done_at[plan.rid]}
            for label, a, b in STEPS:
                split[label].append((marks[b] - marks[a]) * 1000)
        spinners.quiet()
    res: dict[str, Any] = {}
    tick, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    for cond, values in times.items():
        ms = sorted(t * 1000 for t in values)
        res[cond] = {
            "trips": len(ms),
            "median_ms": statistics.median(ms),
            "p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "steal_pct": round(100 * stolen[cond] / tick / max(spent[cond], 1e-9) / cores, 1),
        }
    return res, split


def _steal_ticks() -> int:
    """Clock ticks of every CPU stolen by the hypervisor so far (/proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0
    return int(fields[8]) if len(fields) > 8 and fields[0] == "cpu" else 0


def _trip_breakdown(
    directory: Path, tag: str, stages: list[tuple[str, str, str]]
) -> dict[str, list[dict[str, Any]]]:
    requests = by_request(trace.read(directory))
    out: dict[str, list[dict[str, Any]]] = {}
    for cond in ("quiet", "loaded"):
        # Warm-up trips are "<tag>-quiet--5" .. "<tag>-quiet--1": left out.
        prefix = f"{tag}-{cond}-"
        mine = [s for rid, s in requests.items() if rid.startswith(prefix) and "--" not in rid]
        out[cond] = [dataclasses.asdict(f) for f in figures(mine, stages)]
    return out


def _stage_table(figs: dict[str, list[dict[str, Any]]]) -> str:
    quiet, loaded = figs["quiet"], figs["loaded"]
    rows = [
        [q["name"], q["p50_ms"], q["p90_ms"], lo["p50_ms"], lo["p90_ms"]]
        for q, lo in zip(quiet, loaded, strict=True)
    ]
    chained = [
        (q, lo) for q, lo in zip(quiet, loaded, strict=True) if not q["name"].startswith("(")
    ]
    rows.append(["sum of the chain's medians", sum(float(q["p50_ms"]) for q, _ in chained), "",
                 sum(float(lo["p50_ms"]) for _, lo in chained), ""])  # fmt: skip
    return table(["stage", "quiet p50", "quiet p90", "loaded p50", "loaded p90"], rows)
