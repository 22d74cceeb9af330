"""The transfer benchmark's ``tokenspeed`` part: tspd beside the system it re-implements.

TokenSpeed's own PD peers (its Python managers from the interop fixture, a process per rank)
and tspd's (a process per rank too, :mod:`tspd_testing.interop.tspd_host`; or, with
``hosted=False``, every rank's engine side on this thread), on one machine over Mooncake's
TCP transport, with the same contracts (both
recipes' canonical JSON, checked equal) and the same block tables, driven alike
(:mod:`tspd_testing.interop.pairs`). Per shape — equal TP (1 -> 1), NHD 2 -> 1 and 4 -> 2
(Llama-3-8B's cache: 32 layers, 8 KV heads, head dim 128, bf16, 16-token pages) and MLA 2 -> 1
(a DeepSeek-style latent of 512 + 64, 32 layers; P rank 1 sends nothing) — four pairs:
TokenSpeed -> TokenSpeed, tspd -> tspd, and the mixed TokenSpeed -> tspd and tspd ->
TokenSpeed (which cannot stage: TokenSpeed's side offers and announces nothing).

* throughput: one room of ``tokens`` tokens per pair per round, pairs interleaved round by
  round (a shared machine's speed swings from minute to minute), P's first hand-over -> the
  last D rank's KV in, checked byte for byte (every destination page its room's identity,
  no other D byte changed); the best round and the median of the per-round ratios;
* latency: one-page rooms (register -> the last D rank's KV in), the pairs alternating room
  by room, median and p90; each system in its own engine's flow (tspd: D's manifest and P's
  prompt go with the registration, PdConfig.prefill_early; TokenSpeed: after Bootstrapped),
  and tspd -> tspd also in TokenSpeed's flow.

Targets: tspd -> tspd >= 1x TokenSpeed -> TokenSpeed everywhere (GB/s, and latency as
TokenSpeed's median / tspd's). Skipped with one line when TokenSpeed's runtime is not found.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
from common import table

from tspd_core.pd.config import PdTunables
from tspd_testing import procstat

GB = 1e9
PAGE = 16
#: (P system, D system) in the order they run within a round.
PAIRS = [("tokenspeed", "tokenspeed"), ("tspd", "tspd"), ("tokenspeed", "tspd"),
         ("tspd", "tokenspeed")]  # fmt: skip
SHORT = {"tokenspeed": "TS", "tspd": "tspd"}
TARGET = 1.0
#: tspd -> tspd's one-page rooms driven as TokenSpeed's executors drive theirs.
AFTER = "tspd -> tspd (after Bootstrapped)"


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    family: str  # "gqa" (Llama-3-8B's cache) or "mla"
    p_tp: int
    d_tp: int


SHAPES = [
    Shape("equal TP 1 -> 1", "gqa", 1, 1),
    Shape("NHD 2 -> 1", "gqa", 2, 1),
    Shape("NHD 4 -> 2", "gqa", 4, 2),
    Shape("MLA 2 -> 1", "mla", 2, 1),
]


def missing() -> str | None:
    """Why TokenSpeed's runtime cannot be used here (one line), or None."""
    from tspd_testing.interop import env

    return env.MISSING


def run(
    tokens: int,
    rounds: int,
    trips: int,
    tables: list[str],
    shapes: list[str] | None = None,
    variants: list[str] | None = None,
    *,
    hosted: bool = True,
    threads: bool = False,
) -> dict[str, object]:
    """Every shape (or those named), every pair, ``rounds`` rounds of a ``tokens``-token room
    per table kind and ``trips`` one-page rooms per pair; ``variants`` (:func:`variant`): also
    a tspd P so tuned, against TokenSpeed's D (the mixed pair whose sender tspd can tune).
    ``hosted``: tspd's ranks each in a child process, as TokenSpeed's; else on this thread.
    ``threads``: also each side's CPU per one-page room by process and thread name."""
    why = missing()
    if why:
        print(f"tokenspeed part skipped: {why}", flush=True)
        return {"skipped": why}
    from tspd_testing.interop.contracts import Model

    models = {
        "gqa": Model("llama3-8b", "mha", layers=32, kv_heads=8, head_dim=128, page=PAGE),
        "mla": Model("mla-576", "mla", layers=32, page=PAGE, kv_lora_rank=512, rope_dim=64),
    }
    where = "a process per rank" if hosted else "all on the benchmark's thread"
    print(f"\ntokenspeed part: {tokens}-token rooms, {rounds} round(s), {trips} one-page rooms "
          f"per pair; tspd's ranks: {where}; load average {os.getloadavg()}",
          flush=True)  # fmt: skip
    out: dict[str, Any] = {
        "tokens": tokens,
        "load_average_before": os.getloadavg(),
        "tspd_ranks": "process" if hosted else "bench",
        "shapes": {},
    }
    for shape in SHAPES:
        if shapes and shape.name not in shapes:
            continue
        out["shapes"][shape.name] = _shape(
            shape,
            models[shape.family],
            tokens,
            rounds,
            trips,
            tables,
            variants or [],
            hosted,
            threads,
        )
    out["load_average_after"] = os.getloadavg()
    _print(out)
    return out


def _shape(
    shape: Shape,
    model: Any,
    tokens: int,
    rounds: int,
    trips: int,
    tables: list[str],
    variants: list[str],
    hosted: bool,
    threads: bool,
) -> dict[str, Any]:
    from tspd_testing.interop import pairs
    from tspd_testing.interop.tspd_host import HostedInstance
    from tspd_testing.interop.tspd_side import start_prefill

    pages = tokens // PAGE
    pool = pages + max(8, pages // 4)  # room to scramble
    print(f"\n{shape.name}: starting both systems' instances", flush=True)
    with contextlib.ExitStack() as stack:
        inst = pairs.Instances.start(model, shape.p_tp, shape.d_tp, pool, hosted=hosted)
        stack.callback(inst.close)
        names = [f"{p} -> {d}" for p, d in PAIRS]
        runs: list[tuple[str, Any, Any]] = [(f"{p} -> {d}", inst.p[p], inst.d[d]) for p, d in PAIRS]
        for text in variants:
            tunables, mc_env = variant(text)
            contract = inst.p["tspd"].views[0].contract
            p_v: Any = (
                HostedInstance("p", contract, shape.p_tp, tunables, mc_env)
                if hosted
                else start_prefill(contract, shape.p_tp, tunables, mc_env)
            )
            stack.callback(p_v.close)
            runs.append((f"tspd[{text}] -> tokenspeed", p_v, inst.d["tokenspeed"]))
            runs.append((f"tspd[{text}] -> tspd", p_v, inst.d["tspd"]))
        names = [n for n, _, _ in runs]
        p_count, d_count = (c.group(pairs.GID).page_count for c in inst.contracts())
        rng = np.random.default_rng(11)
        room = _rooms()
        # Warm-up: one one-page room per pair (connections, look-ups), off the clock.
        for _, p, d in runs:
            r = pairs.room(next(room), PAGE, np.array([1]), np.array([1]))
            pairs.tag(p, [r])
            pairs.run(p, d, [r])
        res: dict[str, Any] = {"throughput": {}, "latency": {}}
        for kind in tables:
            if kind == "contiguous":
                src = dst = np.arange(1, pages + 1)
            else:
                src = rng.permutation(np.arange(1, p_count))[:pages]
                dst = rng.permutation(np.arange(1, d_count))[:pages]
            per: dict[str, list[float]] = {n: [] for n in names}
            descs: dict[str, int] = {}
            for n in range(rounds):
                line = []
                for name, p, d in runs:
                    r = pairs.room(next(room), tokens, src, dst)
                    pairs.tag(p, [r])
                    snaps = pairs.fill(d, n + 1)
                    t = pairs.run(p, d, [r], snapshots=snaps, timeout_s=600)
                    nbytes = _bytes(inst, tokens)
                    per[name].append(nbytes / t.transfer_s)
                    descs[name] = t.descriptors
                    line.append(f"{_short(name)} {nbytes / t.transfer_s / GB:.3f}")
                print(f"  {shape.name}, {kind}, round {n} (GB/s): {', '.join(line)}", flush=True)
            res["throughput"][kind] = {
                "bytes": _bytes(inst, tokens),
                "gbps_rounds": {k: [v / GB for v in vs] for k, vs in per.items()},
                "descriptors": descs,
            }
        # Each system's own flow (tspd's engine acts with the registration), and tspd -> tspd
        # also as TokenSpeed's executors act (after Bootstrapped).
        flows = [(n, p, d, True) for n, p, d in runs]
        flows.append((AFTER, inst.p["tspd"], inst.d["tspd"], False))
        lat: dict[str, list[float]] = {n: [] for n, _, _, _ in flows}
        # CPU per room of each side's processes, where every rank of both is a child of ours.
        sides = {n: (_pids(p), _pids(d)) for n, p, d, _ in flows}
        cpu = {n: [0.0, 0.0] for n, (ps, ds) in sides.items() if ps and ds}
        by_thread: dict[str, list[dict[str, float]]] = {n: [{}, {}] for n in cpu}
        for k in range(trips):
            for name, p, d, engine in flows:
                page = 1 + k % (min(p_count, d_count) - 1)
                r = pairs.room(next(room), PAGE, np.array([page]), np.array([d_count - page]))
                pairs.tag(p, [r])
                before = [procstat.cpu_s(x) for x in sides[name]] if name in cpu else []
                split = [procstat.by_thread(x) for x in sides[name]] if threads and before else []
                timed = pairs.run(p, d, [r], engine_flow=engine, count=False)
                lat[name].append(timed.latency_s * 1000)
                for i, x in enumerate(before):
                    cpu[name][i] += procstat.cpu_s(sides[name][i]) - x
                for i, was in enumerate(split):
                    procstat.add_since(by_thread[name][i], was, sides[name][i])
        res["latency"] = {
            name: {"median_ms": statistics.median(v), "p90_ms": _p90(v), "rooms": len(v)}
            | (
                {
                    "cpu_ms_per_room": {
                        "p": cpu[name][0] * 1000 / len(v),
                        "d": cpu[name][1] * 1000 / len(v),
                    }
                }
                | (
                    {
                        "cpu_ms_per_room_by_thread": {
                            side: {k: t * 1000 / len(v) for k, t in acc.items() if t > 0}
                            for side, acc in zip("pd", by_thread[name], strict=True)
                        }
                    }
                    if threads
                    else {}
                )
                if name in cpu
                else {}
            )
            for name, v in lat.items()
        }
        errors = inst.errors()
        if errors:
            res["tokenspeed_errors"] = errors[:5]
            print(f"  TokenSpeed logged {len(errors)} ERROR line(s), first: {errors[0]}")
    return res


#: --ts-try keys: PdTunables fields, or Mooncake's environment knobs (MC_*).
_KNOBS = {"window": "write_window", "batch": "max_batch", "inline": "inline_bytes",
          "inline_staged": "inline_staged_bytes", "stage_few_below": "stage_few_below_bytes",
          "stage_below": "stage_below_bytes", "stage_runs": "stage_min_runs",
          "lanes": "MC_TCP_LANES_PER_PEER"}  # fmt: skip


def variant(text: str) -> tuple[PdTunables, dict[str, str]]:
    """``window=256+lanes=8``: a tspd P's tunables and Mooncake environment (keys: window =
    descriptors in flight, 0 = Mooncake's batch call; batch = descriptors per such call;
    inline / inline_staged = the largest direct / staged job P's control thread starts, 0 =
    none; stage_below / stage_few_below / stage_runs = when a job is staged; lanes = Mooncake
    TCP connections per peer)."""
    fields: dict[str, int] = {}
    mc_env: dict[str, str] = {}
    for item in text.split("+"):
        key, _, value = item.partition("=")
        if key not in _KNOBS or not value.isdigit():
            raise SystemExit(f"--ts-try: {item!r} is not one of {sorted(_KNOBS)}=<number>")
        if _KNOBS[key].startswith("MC_"):
            mc_env[_KNOBS[key]] = value
        else:
            fields[_KNOBS[key]] = int(value)
    return PdTunables(**fields), mc_env


def _rooms() -> Any:
    n = 1
    while True:
        n += 1
        yield 7_000_003 * n


def _bytes(inst: Any, tokens: int) -> int:
    """Bytes that land on D (every D rank's share of the prompt's pages)."""
    total = 0
    for view in inst.d["tspd"].views:
        contract = view.contract
        total += sum(f.payload_bytes for f in contract.plan.fields) * (tokens // PAGE)
    return total


def _pids(inst: Any) -> list[int]:
    """Every process of an instance whose ranks are children of this one (none: a tspd
    instance on this thread, whose engine sides share the benchmark's process)."""
    pids = getattr(inst, "pids", None)
    return list(pids()) if pids is not None and procstat.available() else []


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


_TS, _OURS = "tokenspeed -> tokenspeed", "tspd -> tspd"


def _ms(figures: dict[str, float]) -> str:
    return f"{figures['median_ms']:.2f} / {figures['p90_ms']:.2f}"


def _short(name: str) -> str:
    for long, short in SHORT.items():
        name = name.replace(long, short)
    return name.replace(" -> ", "->")


def _print(out: dict[str, Any]) -> None:
    rows, lat_rows = [], []
    for shape, res in out["shapes"].items():
        for kind, t in res["throughput"].items():
            g = t["gbps_rounds"]
            ts, ours = g["tokenspeed -> tokenspeed"], g["tspd -> tspd"]
            paired = statistics.median(a / b for a, b in zip(ours, ts, strict=True))
            d = t["descriptors"]
            rows.append([f"{shape}, {kind}", f"{t['bytes'] / 2**20:.3g} MiB",
                         d["tokenspeed -> tokenspeed"], d["tspd -> tspd"], max(ts), max(ours),
                         max(ours) / max(ts), paired, max(g["tokenspeed -> tspd"]),
                         max(g["tspd -> tokenspeed"]),
                         *[f"{max(v):.4g}" for k, v in g.items() if "[" in k]])  # fmt: skip
        lt = res["latency"]
        ts_l, ours_l, after = lt[_TS], lt[_OURS], lt[AFTER]
        others = [_ms(v) for k, v in lt.items() if k not in (_TS, _OURS, AFTER)]
        lat_rows.append([shape, _ms(ts_l), _ms(ours_l), ts_l["median_ms"] / ours_l["median_ms"],
                         _ms(after), ts_l["median_ms"] / after["median_ms"], *others])  # fmt: skip
    if not rows:
        return
    first = next(iter(out["shapes"].values()))
    extra = [k for k in next(iter(first["throughput"].values()))["gbps_rounds"] if "[" in k]
    print(f"\ntspd beside TokenSpeed, GB/s (best round; rounds = median of the per-round "
          f"ratios); {out['tokens']}-token rooms; load average {out['load_average_before']} "
          f"-> {out['load_average_after']}")  # fmt: skip
    print(table(["shape, tables", "bytes", "TS descs", "tspd descs", "TS->TS", "tspd->tspd",
                 f"tspd/TS (≥ {TARGET:g})", f"rounds (≥ {TARGET:g})", "TS->tspd", "tspd->TS",
                 *[_short(k) for k in extra]], rows))  # fmt: skip
    lat_extra = [k for k in first["latency"] if k not in (_TS, _OURS, AFTER)]
    print("\none-page room, register -> KV in on D, ms (median / p90); each system in its own "
          "engine's flow, and tspd in TokenSpeed's (after Bootstrapped)")  # fmt: skip
    print(table(["shape", "TS->TS", "tspd->tspd", f"TS/tspd (≥ {TARGET:g})",
                 "tspd->tspd after", f"TS/after (≥ {TARGET:g})",
                 *[_short(k) for k in lat_extra]], lat_rows))  # fmt: skip
    pairs_cpu = [k for k, v in first["latency"].items() if "cpu_ms_per_room" in v]
    if pairs_cpu:
        print("\nCPU per one-page room, ms, P side / D side (every process and thread of each, "
              "while the room ran; the harness's own steps included alike)")  # fmt: skip
        cpu_rows = [
            [shape, *[_cpu(res["latency"][k]) for k in pairs_cpu]]
            for shape, res in out["shapes"].items()
        ]
        print(table(["shape", *[_short(k) for k in pairs_cpu]], cpu_rows))
    for shape, res in out["shapes"].items():
        for pair, figures in res["latency"].items():
            split = figures.get("cpu_ms_per_room_by_thread")
            if not split:
                continue
            print(f"\n{shape}, {_short(pair)}: CPU per one-page room by process/thread, ms "
                  f"(the {THREAD_ROWS} largest a side)")  # fmt: skip
            for side, acc in split.items():
                top = sorted(acc.items(), key=lambda kv: -kv[1])[:THREAD_ROWS]
                print(f"  {side.upper()}: " + ", ".join(f"{k} {t:.2f}" for k, t in top))


#: Threads per side the breakdown prints (--ts-cpu-threads).
THREAD_ROWS = 10


def _cpu(figures: dict[str, Any]) -> str:
    c = figures["cpu_ms_per_room"]
    return f"{c['p']:.2f} / {c['d']:.2f}"
