"""Simulator speed: the whole Mooncake conversation trace on 4 P + 4 D instances.

Target (docs/simulator.md, "Speed"): 12,031 requests (one hour, ~4.1 M output tokens) in
≤ 20 s of wall time on the development machine, with the real scheduler and layout planner in
the loop. The baseline, measured in the same process on the trace's first requests, is the
same simulator with one event per decode step (``decode_horizon=1``, identical results); the
ratio is the speed-up of macro-step decoding. A second whole-trace run without D's prefix
cache shows the share of D's prefix store (inserts, look-ups, evictions in
``tspd_core.sched``).

Memory (issue 19): per-request results stream to Parquet and finished requests are freed, so a
run's peak RSS should not grow with its length. Two synthetic replays, of N and 10·N requests,
each run alone in a fresh process (peak RSS is per process), print their peak RSS and CPU per
request; the ratios (10·N over N) are the figures: ~1 for RSS means flat memory, ~1 for CPU
per request means no per-request cost grows with the run.

``--quick``: the first 2,000 requests and a 300-request baseline; memory at 2k and 20k.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import table

from tspd_sim.metrics import Slo
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.traces import Trace, load_trace

TARGET_S = 20.0

#: One synthetic replay in a fresh process: prints its peak RSS and CPU seconds as JSON.
_CHILD = """
import json, resource, sys, time
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.traces import synthetic
n = int(sys.argv[1])
trace = synthetic(n, 4.0, "lognormal:2048:0.8", "lognormal:256:0.8", seed=0)
cpu = time.process_time()
Simulation(trace, SimConfig()).run().summary()
cpu = time.process_time() - cpu
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"requests": n, "cpu_s": cpu, "peak_rss_bytes": rss}))
"""


def _alone(n: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(n)], capture_output=True, text=True, check=True
    )
    got: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def _memory(quick: bool) -> dict[str, Any]:
    small, large = (2_000, 20_000) if quick else (10_000, 100_000)
    a, b = _alone(small), _alone(large)
    rows: list[list[object]] = []
    for r in (a, b):
        rss_mb = r["peak_rss_bytes"] / 1e6
        rows.append([int(r["requests"]), rss_mb, r["cpu_s"], r["cpu_s"] / r["requests"] * 1e6])
    rss_ratio = b["peak_rss_bytes"] / a["peak_rss_bytes"]
    cpu_ratio = (b["cpu_s"] / b["requests"]) / (a["cpu_s"] / a["requests"])
    rows.append(["ratio", rss_ratio, "-", cpu_ratio])
    print(table(["synthetic replay", "peak RSS MB", "cpu s", "cpu us / request"], rows))
    return {"small": a, "large": b, "rss_ratio": rss_ratio, "cpu_per_request_ratio": cpu_ratio}


def _timed(trace: Trace, config: SimConfig) -> tuple[float, float, dict[str, float]]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = Simulation(trace, config).run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, result.summary(Slo())


def run(args: list[str]) -> dict[str, Any]:
    quick = "--quick" in args
    full = load_trace("mooncake")
    trace = full.head(2000) if quick else full
    head = full.head(300 if quick else 800)
    config = SimConfig()
    base_wall, base_cpu, _ = _timed(head, replace(config, decode_horizon=1))
    fast_wall, fast_cpu, _ = _timed(head, config)
    wall, cpu, s = _timed(trace, config)
    # The same trace without D's prefix cache: shows what D's prefix store costs.
    cluster = config.cluster
    no_dcache = replace(
        config, cluster=replace(cluster, tuning=replace(cluster.tuning, decode_prefix_cache=False))
    )
    nd_wall, nd_cpu, _ = _timed(trace, no_dcache)
    rows: list[list[object]] = [
        ["per-step baseline", len(head), base_wall, base_cpu, len(head) / base_wall, 1.0],
        [
            "macro-steps",
            len(head),
            fast_wall,
            fast_cpu,
            len(head) / fast_wall,
            base_wall / fast_wall,
        ],
        [
            "whole trace" if not quick else "quick trace",
            len(trace),
            wall,
            cpu,
            len(trace) / wall,
            "-",
        ],
        ["  same, no D prefix cache", len(trace), nd_wall, nd_cpu, len(trace) / nd_wall, "-"],
    ]
    print(table(["run", "requests", "wall s", "cpu s", "sim req / wall s", "speed-up"], rows))
    print(
        f"simulated {s['span_s']:.0f} s, {s['output_tok_s'] * s['span_s'] / 1e6:.2f} M output "
        f"tokens, {int(s['decode_steps']):,} decode steps, {int(s['prefill_steps']):,} "
        f"prefill steps; target ≤ {TARGET_S:.0f} s wall for the whole trace: "
        f"{'met' if wall <= TARGET_S and not quick else 'NOT met' if not quick else 'n/a'}"
    )
    return {
        "cluster": config.cluster.label(),
        "requests": len(trace),
        "wall_s": wall,
        "cpu_s": cpu,
        "sim_requests_per_wall_s": len(trace) / wall,
        "target_wall_s": TARGET_S,
        "target_met": (wall <= TARGET_S) if not quick else None,
        "simulated_span_s": s["span_s"],
        "decode_steps": s["decode_steps"],
        "prefill_steps": s["prefill_steps"],
        "no_decode_prefix_cache_wall_s": nd_wall,
        "no_decode_prefix_cache_cpu_s": nd_cpu,
        "baseline_requests": len(head),
        "baseline_per_step_wall_s": base_wall,
        "baseline_macro_wall_s": fast_wall,
        "macro_step_speedup": base_wall / fast_wall,
        "memory": _memory(quick),
        "summary": s,
    }
