"""Reference engine end to end: PD against colocated serving, and the device-feed decode loop
against the synchronous loop.

**PD vs colocated** (``--only pd``): three prefill nodes (each hosting its bootstrap server;
two hand their KV over after the forward, one streams it layerwise, ``--layerwise-interval``
1 unless the benchmark's own flag of that name says otherwise), a decode node they share and a
colocated node (each TP 1, every role a ``launch_pd.py`` process), and a router per mode:
``pd`` (the router passes P's first token on at once),
``pd_held`` (``--hold-first-token``: it waits for D's) and ``pd_layerwise``. The same
open-loop Poisson load (fixed request rate, seeded prompt lengths, streamed completions with
``ignore_eos``) goes through each router in turn, rotating the order over rounds, at each
rate of ``--rates``; reported per rate: TTFT, TPOT and end-to-end latency (p50 / p90) per
mode, the PD/colocated ratios and the layerwise/PD ratios, with the texts of every mode
checked identical request by request. ``--model`` serves a real
model (``smollm2-135m``, a checkpoint directory or a GGUF file; prompts are then seeded text
of 64 to 512 common words, about a token each: SGLang's gateway takes text prompts only)
instead of the tiny seeded one.

**Device feed** (``--only feed``): both loops run the same model, scheduler and requests in
this process (TP 1, one torch thread) and must produce the same tokens (checked). Reported
per batch size: decode steps per second and tokens per second of each loop, the fed/sync
ratio, and where a step's time goes (model forward vs the host's scheduling and bookkeeping).

On CPU every torch op is synchronous, so the fed loop cannot hide host time behind device
work here: the ratio measures the cost of the feed's structure (cells, ring, events, a round
kept in flight). ``hidden bound`` is what the same loop could reach on a
device that runs the forward asynchronously: a step costs max(forward, host) instead of their
sum. Best of ``--repeat`` (5) alternating runs per point (the machine is shared).

``--breakdown`` (PD vs colocated) also says where each TTFT goes, stage by stage (router
hop, node HTTP, rank intake, D's admission and bootstrap, the P forward, the transfer, the
first decode step, the way back), from ``tspd_core.trace`` stamps every process writes
(``benchmarks/breakdown.py``); the same tool before and after a change.

**Idle CPU** (``--only idle``): an idle ``launch_pd.py local`` cluster (prefill TP 2 hosting
its bootstrap server, decode TP 1, router) after two warm-up requests; the CPU each process
uses over ``--idle-s`` seconds (utime + stime from ``/proc/<pid>/stat``), summed per node
(the node process, its ranks, their transfer workers and forkservers). Target: < 2 % of a
core per node: nothing may busy-poll while no request is in flight.

``--device cuda`` runs both parts on the GPU: every node with ``--device cuda``, and the two
loops on the GPU. There the forward is asynchronous, so the ``forward`` column is the host's
time inside the forward call (launching its kernels), not the device's, and the fed/sync ratio
is what the feed buys.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from breakdown import by_request, chain, client_stamps, figures, point_time
from common import table
from gateway import Gateway, start_gateway

from tspd_core import trace
from tspd_core.trace import Stamp
from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.model.checkpoint import save_checkpoint
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.weights import full_random_state
from tspd_launch.loadgen import Timing, poisson_load, summarize
from tspd_launch.supervisor import Supervisor
from tspd_serving.cliargs import model_path
from tspd_serving.models import model_name
from tspd_serving.tokenizer import ByteTokenizer

LAUNCHER = Path(__file__).resolve().parent.parent / "apps" / "launch_pd.py"
NODE_FLAGS = ["--num-pages", "2048", "--max-running", "64", "--log-level", "warning"]


@dataclass(frozen=True, slots=True)
class Point:
    loop: str
    rows: int
    steps: int
    tokens: int
    wall_s: float
    forward_s: float
    output: tuple[tuple[int, ...], ...]

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def host_s(self) -> float:
        return self.wall_s - self.forward_s


def _config(feed: bool, hidden: int, device: str = "cpu") -> EngineConfig:
    model = ModelConfig(
        hidden_size=hidden, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        head_dim=hidden // 8, intermediate_size=hidden * 3,
    )  # fmt: skip
    return EngineConfig(model=model, page_size=16, num_pages=2048, max_running=64,
                        device_feed=feed, prefix_cache=False, device=device)  # fmt: skip


def _timed_forward(engine: Engine) -> list[float]:
    """Wrap the runner's forward to accumulate its wall time (it is synchronous on CPU) and
    count its calls: ``[seconds, calls]``."""
    spent = [0.0, 0.0]
    runner = engine.core.runner
    inner = runner._forward

    def forward(ids: torch.Tensor, meta: Any, after_layer: Any = None) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return inner(ids, meta, after_layer)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    runner._forward = forward  # type: ignore[method-assign]
    return spent


def measure(feed: bool, rows: int, max_tokens: int, hidden: int, device: str = "cpu") -> Point:
    engine = Engine(_config(feed, hidden, device))
    tok = ByteTokenizer()
    prompts = [tok.encode(f"request {i}: decode steps per second") for i in range(rows)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add(p, params)
    engine.step()  # prefill every prompt (and its first decode step) before timing
    spent = _timed_forward(engine)
    t0 = time.perf_counter()
    while engine.core.has_work:
        engine.step()
    wall = time.perf_counter() - t0
    results = engine.run()
    output = tuple(results[r].tokens for r in sorted(results))
    # Decode steps = forwards run while timed (on CPU a launch runs its forward at once, so
    # both loops are timed over the same steps: max_tokens - 2 after the untimed first round).
    steps = int(spent[1])
    return Point("fed" if feed else "sync", rows, steps, rows * steps, wall, spent[0], output)


def _feed(opts: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(1)
    batches = [1, 8] if opts.quick else [1, 8, 32]
    max_tokens = 16 if opts.quick else 64
    repeat = 1 if opts.quick else opts.repeat
    results: dict[str, object] = {"hidden": opts.hidden, "max_tokens": max_tokens, "points": [],
                                  "device": opts.device}  # fmt: skip
    rows_out = []
    for rows in batches:
        best: dict[str, Point] = {}
        for _ in range(repeat):
            for feed in (False, True):
                p = measure(feed, rows, max_tokens, opts.hidden, opts.device)
                if p.loop not in best or p.steps_per_s > best[p.loop].steps_per_s:
                    best[p.loop] = p
        sync, fed = best["sync"], best["fed"]
        if sync.output != fed.output:
            raise SystemExit(f"rows={rows}: fed and sync loops produced different tokens")
        for p in (sync, fed):
            bound = p.steps / max(p.forward_s, p.host_s)
            rows_out.append([
                rows, p.loop, p.steps, round(p.steps_per_s, 1),
                round(p.tokens / p.wall_s, 1), f"{100 * p.forward_s / p.wall_s:.0f}%",
                round(1e3 * p.host_s / p.steps, 3), round(fed.steps_per_s / sync.steps_per_s, 3),
                round(bound / p.steps_per_s, 2),
            ])  # fmt: skip
            results["points"].append({  # type: ignore[attr-defined]
                "rows": rows, "loop": p.loop, "steps": p.steps, "wall_s": p.wall_s,
                "forward_s": p.forward_s, "steps_per_s": p.steps_per_s,
                "tokens_per_s": p.tokens / p.wall_s, "hidden_bound_steps_per_s": bound,
            })  # fmt: skip
    headers = ["rows", "loop", "steps", "steps/s", "tok/s", "forward", "host ms/step",
               "fed/sync", "hidden bound x"]  # fmt: skip
    print(table(headers, rows_out))
    print("tokens identical between loops: yes")
    return results


# -- PD vs colocated ----------------------------------------------------------------------


def _checkpoint(opts: argparse.Namespace, directory: Path) -> list[str]:
    """The nodes' model flags: ``--model``, the tiny default, or a seeded checkpoint of
    ``--layers`` layers and ``--width`` width written to ``directory`` (heads of 32 dims, 2 KV
    heads)."""
    if opts.model is not None:
        return ["--model", str(opts.model)]
    tiny = ModelConfig()
    if (opts.layers, opts.width) == (tiny.num_hidden_layers, tiny.hidden_size):
        return []
    cfg = ModelConfig(num_hidden_layers=opts.layers, hidden_size=opts.width, head_dim=32,
                      num_attention_heads=opts.width // 32, num_key_value_heads=2,
                      intermediate_size=2 * opts.width)  # fmt: skip
    save_checkpoint(directory, cfg, full_random_state(cfg, seed=0))
    return ["--model", str(directory)]


def _start_cluster(
    sup: Supervisor, model: list[str], device: str = "cpu", interval: int = 1
) -> tuple[dict[str, str], Gateway]:
    """Every role as a launcher process and SGLang's gateway; the URL of each mode's front."""
    me, cancel = [sys.executable, str(LAUNCHER)], threading.Event()
    node = [*model, "--device", device]

    def start(name: str, role: str, *args: str) -> str:
        argv = [*me, role, "--port", "0", *args, *(node if role != "router" else [])]
        return sup.start(name, argv, 300, cancel)

    # Two prefill nodes, each hosting its bootstrap server: one hands its KV over after the
    # forward, one streams it layer by layer during the forward. They share the decode node.
    p = start("prefill", "prefill", "--bootstrap-port", "0", "--layerwise-interval", "0",
              *NODE_FLAGS)  # fmt: skip
    lw = start("prefill", "prefill", "--bootstrap-port", "0", "--layerwise-interval",
               str(interval), *NODE_FLAGS)  # fmt: skip
    # pd_held's P node is pd's twin: sharing pd's would hand it pd's prefix-cache hits.
    held = start("prefill", "prefill", "--bootstrap-port", "0", "--layerwise-interval", "0",
                 *NODE_FLAGS)  # fmt: skip
    # The gateway's P node is pd's twin too.
    gw = start("prefill", "prefill", "--bootstrap-port", "0", "--layerwise-interval", "0",
               *NODE_FLAGS)  # fmt: skip
    d = start("decode", "decode", *NODE_FLAGS)
    c = start("colocated", "colocated", *NODE_FLAGS)
    # The routers tokenize with the nodes' model (--model DIR|FILE: its tokenizer).
    quiet = ["--log-level", "warning", *(["--tokenizer", model[1]] if model else [])]
    urls = {
        "pd": start("router", "router", "--prefill", p, "--decode", d, *quiet),
        "pd_held": start(
            "router", "router", "--prefill", held, "--decode", d, "--hold-first-token", *quiet
        ),
        "pd_layerwise": start("router", "router", "--prefill", lw, "--decode", d, *quiet),
        "colocated": start("router", "router", "--colocated", c, *quiet),
    }
    gateway = start_gateway(gw, d)  # last: a failed start above leaves none to stop
    return urls | {"gateway": gateway.url}, gateway


#: The words a real model's prompts are made of (each about one token in a BPE vocabulary).
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "number night point home water room mother area money story fact month lot right study "
    "book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city name team minute idea kid body information back parent "
    "face level office door health person art war history party result change morning reason"
)
WORDS = _WORD_TEXT.split()


def _bodies(
    n: int, max_tokens: int, seed: int, opts: argparse.Namespace
) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 512, n)
    if opts.model is not None:
        # A real vocabulary: seeded text of common words, about one token each. Text, not
        # token ids: SGLang's gateway takes a prompt only as a string (or strings).
        name = model_name(opts.model)
        return [
            {"model": name, "prompt": " ".join(rng.choice(WORDS, int(k))),
             "max_tokens": max_tokens, "ignore_eos": True}
            for k in lengths
        ]  # fmt: skip
    return [
        {"model": "tspd-tiny", "prompt": f"{i:04d} " + "x" * int(k), "max_tokens": max_tokens,
         "ignore_eos": True}
        for i, k in enumerate(lengths)
    ]  # fmt: skip


#: pd_held: the pd nodes behind a router that holds P's first token until D's (the default
#: passes it on at once): what passing it on buys, in the same run. gateway: SGLang's model
#: gateway in front of the same kind of nodes.
MODES = ("colocated", "pd", "pd_held", "pd_layerwise", "gateway")


def _pd_vs_colocated(opts: argparse.Namespace) -> dict[str, object]:
    n, rounds = (12, 1) if opts.quick else (opts.requests, opts.rounds)
    bodies = _bodies(n, opts.max_tokens, 0, opts)
    sup = Supervisor(out=io.StringIO(), stop_timeout_s=30)
    tmp = tempfile.TemporaryDirectory(prefix="bench-e2e-")
    points: list[dict[str, object]] = []
    runs: list[dict[str, list[Timing]]] = []
    stamps = Path(tmp.name) / "trace"
    if opts.breakdown:
        trace.enable(stamps)  # every role inherits it
    gateway: Gateway | None = None
    try:
        urls, gateway = _start_cluster(
            sup, _checkpoint(opts, Path(tmp.name)), opts.device, opts.layerwise_interval
        )
        for mode in MODES:  # warm every path up (first requests pay one-off costs)
            asyncio.run(poisson_load(urls[mode] + "/v1/completions", bodies[:4], 20.0, seed=1))
        for rate in opts.rates:
            timings = _at_rate(urls, bodies, rate, rounds)
            points.append(_report(timings, opts, n, rounds, rate))
            runs.append(timings)
    finally:
        if gateway is not None:
            gateway.stop()
        sup.stop_all()
        trace.disable()
        if opts.breakdown:
            for point, timings, rate in zip(points, runs, opts.rates, strict=False):
                point["breakdown"] = _ttft_breakdown(stamps, timings, rate)
        tmp.cleanup()
    return {"rates": opts.rates, "points": points}


def _at_rate(
    urls: dict[str, str], bodies: list[dict[str, object]], rate: float, rounds: int
) -> dict[str, list[Timing]]:
    timings: dict[str, list[Timing]] = {mode: [] for mode in MODES}
    first: dict[str, list[Timing]] = {}
    for r in range(rounds):
        # Rotate the order, so no mode always runs first (or right after another).
        k = r % len(MODES)
        for mode in MODES[k:] + MODES[:k]:
            got = asyncio.run(poisson_load(urls[mode] + "/v1/completions", bodies, rate, seed=r))
            timings[mode] += got
            first.setdefault(mode, got)
    for mode in MODES[1:]:
        pairs = zip(first[mode], first["colocated"], strict=True)
        for i, (t, c) in enumerate(pairs):
            if t.text != c.text:
                why = f"error {t.error!r}" if t.error else f"{t.text[:60]!r} != {c.text[:60]!r}"
                raise SystemExit(
                    f"{mode} and colocated produced different texts for request {i}: {why}"
                )
    return timings


def _report(
    timings: dict[str, list[Timing]], opts: argparse.Namespace, n: int, rounds: int, rate: float
) -> dict[str, object]:
    summary = {mode: summarize(ts) for mode, ts in timings.items()}
    co, pd, lw = summary["colocated"], summary["pd"], summary["pd_layerwise"]
    held, gw = summary["pd_held"], summary["gateway"]
    metrics = ("ttft_p50_ms", "ttft_p90_ms", "first_text_p50_ms", "first_text_p90_ms",
               "tpot_p50_ms", "tpot_p90_ms", "e2e_p50_ms", "e2e_p90_ms")  # fmt: skip
    rows = [[m, round(co[m], 2), round(pd[m], 2), round(held[m], 2), round(lw[m], 2),
             round(gw[m], 2), round(pd[m] / co[m], 3), round(held[m] / co[m], 3),
             round(lw[m] / pd[m], 3), round(gw[m] / held[m], 3)]
            for m in metrics]  # fmt: skip
    errors = " / ".join(str(int(summary[m]["errors"])) for m in MODES)
    what = model_name(opts.model) if opts.model else f"{opts.layers} layers x {opts.width} wide"
    print(f"PD (P TP1 -> D TP1; KV after the forward, or layerwise; tspd's router or SGLang's "
          f"gateway) vs colocated (TP1) on {opts.device}, {what}: {n} requests x {rounds} "
          f"rounds at {rate:g} req/s, errors {errors}")  # fmt: skip
    headers = ["metric", "colocated", "pd", "pd held", "pd layerwise", "gateway",
               "pd/colocated", "held/colocated", "layerwise/pd", "gateway/held"]  # fmt: skip
    print(table(headers, rows))
    side = [[front, *(round(summary[mode][f"{m}_{q}_ms"], 2) for m in ("ttft", "tpot")
                      for q in ("p50", "p90"))]
            for front, mode in (("tspd router (P's first token at once)", "pd"),
                                ("tspd router (--hold-first-token)", "pd_held"),
                                ("SGLang gateway", "gateway"))]  # fmt: skip
    print("tspd's router vs SGLang's gateway, same nodes' kind, same load (ms):")
    print(table(["front", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"], side))
    print("texts identical between modes: yes")
    added = {q: pd[f"ttft_{q}_ms"] - co[f"ttft_{q}_ms"] for q in ("p50", "p90")}
    added_held = {q: held[f"ttft_{q}_ms"] - co[f"ttft_{q}_ms"] for q in ("p50", "p90")}
    added_text = {q: pd[f"first_text_{q}_ms"] - co[f"first_text_{q}_ms"] for q in ("p50", "p90")}
    met = "met" if added["p50"] <= TARGET_ADDED_TTFT_MS else "MISSED"
    print(f"PD's added TTFT: p50 {added['p50']:+.2f} ms (target <= {TARGET_ADDED_TTFT_MS:g} ms: "
          f"{met}), p90 {added['p90']:+.2f} ms (issue 22's before: {BEFORE_P90_GAP_MS:g} ms; "
          f"target <= half); holding the first token until D's: p50 "
          f"{added_held['p50']:+.2f}, p90 {added_held['p90']:+.2f} ms; to the first text: p50 "
          f"{added_text['p50']:+.2f}, p90 {added_text['p90']:+.2f} ms; load average "
          f"{os.getloadavg()}")  # fmt: skip
    model = {"name": what, "layers": opts.layers, "hidden": opts.width}
    return {"rate": rate, "requests": n, "rounds": rounds, "model": model,
            "device": opts.device, "added_ttft_ms": added, "added_ttft_held_ms": added_held,
            "added_first_text_ms": added_text,
            "load_average": os.getloadavg(),
            **summary}  # fmt: skip


#: Issue 22's targets: PD adds at most this much to the median TTFT of a short prompt.
TARGET_ADDED_TTFT_MS = 5.0
#: The p90 gap (PD - colocated) measured before issue 22 (40.7 - 16.4 ms); the target halves it.
BEFORE_P90_GAP_MS = 24.3

#: P's way from the client's send to the end of its prefill forward (both PD routers).
_P_POINTS = [
    ("", "client|client.sent"),
    ("client -> router: HTTP, parse", "router|router.choice"),
    ("router: pick nodes, post to P", "router|router.p_post"),
    ("router -> P node: HTTP, parse, submit", "prefill-node|node.submit"),
    ("P node -> P rank 0 intake (ZMQ)", "prefill-rank|rank.intake"),
    ("P rank: to the loop's round, admit", "prefill-rank|engine.admitted"),
    ("P rank: to the prefill forward", "prefill-rank|engine.prefill"),
    ("P rank: the prefill forward", "prefill-rank|engine.prefilled"),
]
#: The KV's way from P's hand-over to D's first token at the router (its last point: which
#: router stamp marks D's first token).
_KV_POINTS = [
    ("P rank: hand over", "prefill-rank|p.handover"),
    ("P worker: pipe, wake-up", "prefill-worker|pw.cmd:SubmitChunk"),
    ("P worker: D's pre-allocation (if later), plan", "prefill-worker|pw.planned"),
    ("P worker: Mooncake write (or staged)", "prefill-worker|pw.written"),
    ("P worker: Success", "prefill-worker|pw.success_send"),
    ("ZMQ P -> D", "decode-worker|dw.status:SUCCESS"),
    ("D worker: complete the room", "decode-worker|dw.notify:SUCCESS"),
    ("D rank: wake-up, poll -> RemotePrefill", "decode-rank|decode.event:RemotePrefill"),
    ("D rank: first decode step, output", "decode-rank|rank.send"),
    ("D rank -> D node: ZMQ, waiter thread", "decode-node|node.output"),
]
_TO_CLIENT = [
    ("router: detokenize, SSE", "router|router.sent"),
    ("router -> client", "client|client.first"),
]
#: D's registration and pre-allocation, alongside P's forward.
_D_ALONGSIDE = [
    ("(D, alongside) router -> D node: HTTP, submit", "router|router.post",
     "decode-node|node.submit"),
    ("(D, alongside) D node -> admitted, registered", "decode-node|node.submit",
     "decode-rank|decode.register"),
    ("(D, alongside) register -> pre-allocation at P", "decode-rank|decode.register",
     "prefill-worker|pw.prealloc"),
    ("(alongside) P prefilled -> D's pre-allocation at P", "prefill-rank|engine.prefilled",
     "prefill-worker|pw.prealloc"),
]  # fmt: skip
#: Where a PD request's TTFT (to its first token: the client asks for token ids) goes. P
#: prefills at once (PdConfig.prefill_early) and its answer carries the first token, which
#: the router passes on at once (RouterConfig.early_first_token): the chain below. The KV's
#: way to D and D's first decode step run alongside (a first token that is only part of a
#: character, as the tiny model's byte tokens often are, shows its text with D's next
#: token). Points: breakdown.py.
PD_STAGES = [
    *chain([
        *_P_POINTS,
        ("P rank: hand over, output", "prefill-rank|rank.send"),
        ("P rank -> P node: ZMQ, waiter thread", "prefill-node|node.answer"),
        ("P node -> router: HTTP answer", "router|router.p_answer"),
        *_TO_CLIENT,
    ]),
    *((f"(KV, alongside) {name}", start, end) for name, start, end in chain([
        ("", _P_POINTS[-1][1]),
        *_KV_POINTS,
        ("D node -> router: HTTP stream", "router|router.kv_arrived"),
    ])),
    *_D_ALONGSIDE,
]  # fmt: skip
#: The same with the router holding the first token until D's (``--hold-first-token``): the
#: TTFT runs through the KV's way to D and D's first decode step.
PD_HELD_STAGES = [
    *chain([
        *_P_POINTS, *_KV_POINTS, ("D node -> router: HTTP stream", "router|router.piece"),
        *_TO_CLIENT,
    ]),
    *_D_ALONGSIDE,
]  # fmt: skip
COLOCATED_STAGES = chain(
    [
        ("", "client|client.sent"),
        ("client -> router: HTTP, parse", "router|router.choice"),
        ("router: pick node, post", "router|router.post"),
        ("router -> node: HTTP, parse, submit", "colocated-node|node.submit"),
        ("node -> rank 0 intake (ZMQ)", "colocated-rank|rank.intake"),
        ("rank: to the loop's round, admit", "colocated-rank|engine.admitted"),
        ("rank: to the prefill forward", "colocated-rank|engine.prefill"),
        ("rank: the prefill forward", "colocated-rank|engine.prefilled"),
        ("rank: first decode step, output", "colocated-rank|rank.send"),
        ("rank -> node: ZMQ, waiter thread", "colocated-node|node.output"),
        ("node -> router: HTTP stream", "router|router.piece"),
        ("router: detokenize, SSE", "router|router.sent"),
        ("router -> client", "client|client.first"),
    ]
)


def _ttft_breakdown(
    directory: Path, timings: dict[str, list[Timing]], rate: float
) -> dict[str, object]:
    """Stage figures of the colocated and PD requests of one rate (printed, and returned),
    and where the PD requests' first text came from."""
    requests = by_request(trace.read(directory))
    out: dict[str, object] = {}
    modes = (("colocated", COLOCATED_STAGES), ("pd", PD_STAGES), ("pd_held", PD_HELD_STAGES))
    for mode, stages in modes:
        mine = [
            requests.get(t.rid, []) + client_stamps(t.rid, t.sent_s, t.sent_s + t.ttft_s)
            for t in timings[mode]
            if t.ok and t.rid
        ]
        figs = figures(mine, stages)
        out[mode] = [dataclasses.asdict(f) for f in figs]
        chained = [f for f in figs if not f.name.startswith("(")]
        total = sum(f.p50_ms for f in chained if f.count)
        rows = [[f.name, f.count, f.p50_ms, f.p90_ms] for f in figs]
        rows.append(["sum of the chain's medians", "", total, ""])
        print(f"\nwhere the TTFT goes, {mode} at {rate:g} req/s (ms):")
        print(table(["stage", "requests", "p50", "p90"], rows))
        if mode == "pd":
            texts = [(t.sent_s, t.first_text_s) for t in timings[mode] if t.ok and t.rid]
            out["pd_first_text"] = _first_text_sources(mine, texts)
    return out


def _first_text_sources(
    requests: list[list[Stamp]], texts: list[tuple[float, float]]
) -> dict[str, object]:
    """How many PD requests showed their first text with P's token (at the client before D's
    first token reached the router) and how many waited for D's (a first token that is part
    of a character), with the median time to first text of each (``texts``: the requests'
    send time and time to first text, in order, seconds); and how much earlier P's first
    token reached the router than D's."""
    early: list[float] = []
    late: list[float] = []
    ahead: list[float] = []
    for stamps, (sent_s, text_s) in zip(requests, texts, strict=True):
        kv = point_time(stamps, "router|router.kv_arrived")
        passed = point_time(stamps, "router|router.early")
        if passed is not None and kv is not None:
            ahead.append((kv - passed) / 1e6)
        if kv is not None and text_s == text_s:  # (NaN: no text at all)
            (early if (sent_s + text_s) * 1e9 < kv else late).append(text_s * 1e3)

    def p50(values: list[float]) -> float:
        return float(np.median(values)) if values else float("nan")

    print(
        f"first text with P's token: {len(early)} requests (p50 {p50(early):.2f} ms); waited "
        f"for D's next token: {len(late)} (p50 {p50(late):.2f} ms); P's first token reached "
        f"the router {p50(ahead):.2f} ms (p50) before D's"
    )
    return {
        "with_p_token": len(early),
        "with_d_token": len(late),
        "first_text_p50_ms_p": p50(early),
        "first_text_p50_ms_d": p50(late),
        "p_token_ahead_p50_ms": p50(ahead),
    }


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates are positive numbers, e.g. 0.5,1,2; got {text!r}")
    return rates


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    parser.add_argument("--only", choices=["pd", "feed", "idle"], help="run one part only")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="pd: where each TTFT goes, stage by stage (tspd_core.trace stamps of every process)",
    )
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle: seconds measured")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (both parts)")
    parser.add_argument("--repeat", type=int, default=5, help="feed: runs per point")
    parser.add_argument("--hidden", type=int, default=256, help="feed: model hidden size")
    parser.add_argument("--rates", type=_rates,
                        help="pd: request rates per second, comma-separated (default: 4 for the "
                             "tiny model, 0.5,1,2 for a real one)")  # fmt: skip
    parser.add_argument(
        "--model",
        type=model_path,
        metavar="DIR|FILE.gguf|NAME",
        help="pd: serve this model (e.g. smollm2-135m) instead of the tiny one",
    )
    parser.add_argument("--layerwise-interval", type=int, default=1, metavar="N",
                        help="pd: the streaming prefill node's layers per interval (default: "
                             "%(default)s; at least the model's layers: one interval, the KV "
                             "going once the last layer wrote it)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=48, help="pd: requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="pd: rounds per mode")
    parser.add_argument("--max-tokens", type=int, default=32, help="pd: tokens per request")
    parser.add_argument(
        "--layers",
        type=int,
        default=ModelConfig().num_hidden_layers,
        help="pd: model layers (else than the tiny model's: a seeded checkpoint)",
    )
    parser.add_argument("--width", type=int, default=ModelConfig().hidden_size,
                        help="pd: model hidden size (a multiple of 32)")  # fmt: skip
    opts = parser.parse_args(args)
    if opts.rates is None:
        opts.rates = [4.0] if opts.model is None else [0.5, 1.0, 2.0]
    out: dict[str, object] = {}
    if opts.only in (None, "pd"):
        out["pd_vs_colocated"] = _pd_vs_colocated(opts)
    if opts.only in (None, "feed"):
        out["device_feed"] = _feed(opts)
    if opts.only in (None, "idle"):
        out["idle_cpu"] = idle_cpu(opts.idle_s, opts.device)
    return out


# -- idle CPU ------------------------------------------------------------------------------

#: Issue 22: an idle node (node process, ranks, workers) uses less than this share of a core.
TARGET_IDLE_CORE_PCT = 2.0


def idle_cpu(seconds: float, device: str = "cpu") -> dict[str, object]:
    """CPU use of every process of an idle ``launch_pd.py local`` cluster over ``seconds``,
    per process and summed per node (see the module docstring)."""
    sup = Supervisor(out=io.StringIO(), stop_timeout_s=30)
    ports = [f"--{r}-port" for r in ("router", "prefill", "decode", "bootstrap")]
    argv = [sys.executable, str(LAUNCHER), "local", *(x for p in ports for x in (p, "0")),
            "--log-level", "warning", "--device", device]  # fmt: skip
    try:
        url = sup.start("local", argv, 300, threading.Event())
        body = {"model": "tspd-tiny", "prompt": "warm up " * 8, "max_tokens": 4}
        asyncio.run(poisson_load(url + "/v1/completions", [body, body], 20.0))
        time.sleep(2.0)  # let the warm-up's stragglers (releases, logs) settle
        root = sup.children[0].proc.pid
        before, t0 = _cpu_ticks(root), time.monotonic()
        time.sleep(seconds)
        after, wall = _cpu_ticks(root), time.monotonic() - t0
    finally:
        sup.stop_all()
    tick = os.sysconf("SC_CLK_TCK")
    procs: list[dict[str, Any]] = []
    for pid, (group, kind, ticks) in sorted(after.items()):
        if pid in before:
            pct = 100.0 * (ticks - before[pid][2]) / tick / wall
            procs.append({"pid": pid, "group": group, "kind": kind, "core_pct": pct})
    groups: dict[str, float] = {}
    for p in procs:
        groups[p["group"]] = groups.get(p["group"], 0.0) + p["core_pct"]
    rows = [[p["group"], p["kind"], p["pid"], round(p["core_pct"], 3)] for p in procs]
    print(f"\nidle CPU over {wall:.1f} s of an idle `launch_pd.py local` cluster "
          f"(load average {os.getloadavg()}), % of one core:")  # fmt: skip
    print(table(["node", "process", "pid", "% core"], rows))
    nodes = {g: v for g, v in groups.items() if g != "router"}
    worst = max(nodes.values(), default=0.0)
    met = "met" if worst < TARGET_IDLE_CORE_PCT else "MISSED"
    summary = ", ".join(f"{g} {v:.2f} %" for g, v in groups.items())
    print(f"per node: {summary}; target < {TARGET_IDLE_CORE_PCT:g} % per node: {met}")
    return {"seconds": wall, "processes": procs, "per_node_pct": groups,
            "meets_target": worst < TARGET_IDLE_CORE_PCT}  # fmt: skip


def _cpu_ticks(root: int) -> dict[int, tuple[str, str, int]]:
    """utime + stime (clock ticks) of every descendant of ``root``, with its node (the
    launcher role it runs under) and what it is (node, rank, transfer worker, ...)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parent[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    out: dict[int, tuple[str, str, int]] = {}
    for pid in ticks:
        chain_up = [pid]
        while chain_up[-1] in parent and chain_up[-1] != root and chain_up[-1] > 1:
            chain_up.append(parent[chain_up[-1]])
        if chain_up[-1] != root or pid == root:
            continue
        role = _role(_cmdline(chain_up[-2]).split(" "))
        out[pid] = (role, _kind(pid, chain_up, parent), ticks[pid])
    return out


def _role(argv: list[str]) -> str:
    """The launcher role a top-level child runs (``launch_pd.py <role> ...``)."""
    for i, arg in enumerate(argv):
        if arg.endswith("launch_pd.py") and i + 1 < len(argv):
            return argv[i + 1]
    return "?"


def _kind(pid: int, chain_up: list[int], parent: dict[int, int]) -> str:
    depth = len(chain_up) - 2  # 0: the role's own process
    if depth == 0:
        return "node process" if _role(_cmdline(pid).split(" ")) != "router" else "router"
    line = _cmdline(pid)
    if "resource_tracker" in line:
        return "resource tracker"
    if "forkserver" in line and "forkserver" not in _cmdline(parent.get(pid, 0)):
        return "forkserver"
    comm = _comm(pid)  # ranks and workers name themselves (tspd_core.procname)
    if "-xfer" in comm:
        return f"transfer worker ({comm})"
    if "rank" in comm:
        return f"rank ({comm})"
    return "rank process" if depth == 1 else f"process (depth {depth})"


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
