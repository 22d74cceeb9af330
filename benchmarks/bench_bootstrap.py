"""Bootstrap server look-ups per second on loopback, with concurrent clients.

The server runs as its own process (``python -m tspd_bootstrap``), as in production, with a
complete deployment registered (DP 2 x TP 4, a ~32 KB canonical layout). Load comes from this
process: asyncio + aiohttp workers for the async rows, threads for the synchronous peer client.

Baselines measured in the same run:
* ``GET /health`` at the same concurrency: the floor of the HTTP stack, so ``vs health`` shows
  what the rank look-up and parallel-info logic cost on top of aiohttp itself.
* a TokenSpeed-style look-up (``requests.get`` without a session: one TCP connection per call)
  against :class:`BootstrapClient` (keep-alive session per thread).

Both processes share the machine's cores, so absolute numbers include the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import aiohttp
import requests
from common import table

from tspd_bootstrap import BootstrapClient

DP, TP = 2, 4
READY = re.compile(r"http://127\.0\.0\.1:(\d+) ")


def synthetic_layout(layers: int = 64) -> str:
    """A contract-shaped layout of realistic size (two fields per layer)."""
    fields = [
        {
            "group_id": "full_attention",
            "field_id": f"layer.{i}.{kv}",
            "plane_id": f"unit.{i}.{kv}",
            "shape": [16, 2, 128],
            "dtype": "bfloat16",
            "field_offset_bytes": 0,
            "page_stride_bytes": 8192,
        }
        for i in range(layers)
        for kv in ("k", "v")
    ]
    plan = {
        "prefix_granularity": 16,
        "lcm_block_bytes": 8192 * len(fields),
        "num_lcm_blocks": 4096,
        "groups": [],
        "planes": [],
        "fields": fields,
    }
    partition = {"axis": 1, "global_extent": 8, "global_parts": []}
    schema = {"fields": [{"field_id": f["field_id"], "partition": partition} for f in fields]}
    body = {
        "plan": plan,
        "group_specs": [{"group_id": "full_attention"}],
        "transfer_schema": schema,
    }
    return json.dumps(body, separators=(",", ":"))


def start_server() -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "tspd_bootstrap", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--log-level", "error"], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    match = READY.search(proc.stdout.readline())
    if match is None:
        proc.kill()
        raise SystemExit("bootstrap server did not report readiness")
    return proc, f"http://127.0.0.1:{match.group(1)}"


def register(url: str, layout: str) -> None:
    client = BootstrapClient(url)
    for rank in range(DP * TP):
        client.register_rank(
            engine_rank=rank,
            world_size=DP * TP,
            dp_size=DP,
            rank_ip="127.0.0.1",
            rank_port=30000 + rank,
            cache_layout=layout,
        )


async def _async_load(url: str, clients: int, seconds: float) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                async with session.get(url) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url}: {resp.status}")
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return latencies


def _thread_load(call: Callable[[], object], clients: int, seconds: float) -> list[float]:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop = time.perf_counter() + seconds

    def worker(mine: list[float]) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            call()
            mine.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker, args=(lat,)) for lat in latencies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [x for lat in latencies for x in lat]


@dataclass(slots=True)
class Row:
    scenario: str
    clients: int
    requests: int
    per_s: float
    p50_ms: float
    p99_ms: float
    ratio: str = "baseline"


def row(name: str, clients: int, rounds: list[tuple[float, list[float]]]) -> Row:
    """Throughput is the best round (noise on a shared machine only ever slows a round down);
    latency percentiles pool every round."""
    ordered = sorted(x for _, lat in rounds for x in lat)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    best = max(len(lat) / seconds for seconds, lat in rounds)
    median = 1000 * statistics.median(ordered)
    return Row(name, clients, len(ordered), best, median, 1000 * p99)


def measure(url: str, levels: list[int], seconds: float, rounds: int) -> list[Row]:
    """Scenarios of one concurrency level alternate round by round, so drifting background
    load hits the baseline and the measured path alike."""
    rank = f"{url}/route?engine_rank=3&target_dp_group=1"
    targets = {
        "async health": f"{url}/health",
        "async rank lookup": rank,
        "async parallel info": f"{url}/route?engine_rank=-1&target_dp_group=-1",
    }
    peer = BootstrapClient(url)
    calls: dict[str, Callable[[], object]] = {
        "sync BootstrapClient lookup": lambda: peer.rank_address(3, 1),
        "sync requests.get lookup (TokenSpeed style)": lambda: requests.get(rank, timeout=5).json(),
    }
    plan: list[tuple[int, dict[str, Callable[[int, float], list[float]]]]] = [
        (n, {k: _async_runner(t) for k, t in targets.items()}) for n in levels
    ]
    plan += [(n, {k: _thread_runner(c) for k, c in calls.items()}) for n in (1, 8)]
    rows: list[Row] = []
    for clients, scenarios in plan:
        got: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in scenarios}
        for _ in range(rounds):
            for name, runner in scenarios.items():
                got[name].append((seconds / rounds, runner(clients, seconds / rounds)))
        rows += [row(name, clients, got[name]) for name in scenarios]
    return rows


def _async_runner(url: str) -> Callable[[int, float], list[float]]:
    return lambda clients, seconds: asyncio.run(_async_load(url, clients, seconds))


def _thread_runner(call: Callable[[], object]) -> Callable[[int, float], list[float]]:
    return lambda clients, seconds: _thread_load(call, clients, seconds)


def ratios(rows: list[Row]) -> None:
    health = {r.clients: r.per_s for r in rows if r.scenario == "async health"}
    plain = {r.clients: r.per_s for r in rows if r.scenario.startswith("sync requests")}
    for r in rows:
        if r.scenario.startswith("async") and r.scenario != "async health":
            r.ratio = f"{r.per_s / health[r.clients]:.2f}x health"
        elif r.scenario.startswith("sync Bootstrap"):
            r.ratio = f"{r.per_s / plain[r.clients]:.2f}x requests.get"


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench bootstrap")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=None, help="per measurement")
    parser.add_argument("--clients", default="1,8,64", help="async concurrency levels")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per point")
    opts = parser.parse_args(args)
    seconds = opts.seconds or (0.6 if opts.quick else 3.0)
    rounds = opts.rounds or (2 if opts.quick else 3)
    levels = [int(x) for x in opts.clients.split(",")]
    layout = synthetic_layout()
    proc, url = start_server()
    try:
        register(url, layout)
        rows = measure(url, levels, seconds, rounds)
    finally:
        proc.terminate()
        proc.wait(15)
    ratios(rows)
    headers = ["scenario", "clients", "per_s", "p50_ms", "p99_ms", "ratio"]
    print(table(headers, [[getattr(r, h) for h in headers] for r in rows]))
    best = max(r.per_s for r in rows if r.scenario == "async rank lookup")
    print(f"layout {len(layout)} bytes; best rank look-ups/s: {best:.0f}; cpus {os.cpu_count()}")
    return {
        "seconds_per_point": seconds,
        "rounds": rounds,
        "layout_bytes": len(layout),
        "rows": [asdict(r) for r in rows],
        "best_rank_lookups_per_s": best,
    }
