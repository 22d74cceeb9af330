"""Reference engine end to end: PD against colocated serving, and the device-feed decode loop
against the synchronous loop.

**PD vs colocated** (``--only pd``): two prefill nodes (each hosting its bootstrap server; one
hands its KV over after the forward, one streams it layerwise, ``--layerwise-interval 1``), a
decode node they share and a colocated node (each TP 1, every role a ``launch_pd.py``
process), and a router per mode. The same open-loop Poisson load (fixed request rate, seeded
prompt lengths, streamed completions with ``ignore_eos``) goes through each router in turn,
rotating the order over rounds, at each rate of ``--rates``; reported per rate: TTFT, TPOT and
end-to-end latency (p50 / p90) per mode, the PD/colocated ratios and the layerwise/PD ratios,
with the texts of every mode checked identical request by request. ``--model`` serves a real
model (``smollm2-135m``, a checkpoint directory or a GGUF file; prompts are then seeded token
ids, 64 to 512 of them) instead of the tiny seeded one.

**Device feed** (``--only feed``): both loops run the same model, scheduler and requests in
this process (TP 1, one torch thread) and must produce the same tokens (checked). Reported
per batch size: decode steps per second and tokens per second of each loop, the fed/sync
ratio, and where a step's time goes (model forward vs the host's scheduling and bookkeeping).

On CPU every torch op is synchronous, so the fed loop cannot hide host time behind device
work here: the ratio measures the cost of the feed's structure (cells, ring, events, a round
kept in flight). ``hidden bound`` is what the same loop could reach on a
device that runs the forward asynchronously: a step costs max(forward, host) instead of their
sum. Best of ``--repeat`` (5) alternating runs per point (the machine is shared).

``--device cuda`` runs both parts on the GPU: every node with ``--device cuda``, and the two
loops on the GPU. There the forward is asynchronous, so the ``forward`` column is the host's
time inside the forward call (launching its kernels), not the device's, and the fed/sync ratio
is what the feed buys.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "apps"))

import numpy as np
import torch
from common import table

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.model.build import resolve_model
from tspd_engine.model.checkpoint import save_checkpoint
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.source import model_name
from tspd_engine.model.tokenizer import ByteTokenizer
from tspd_engine.model.weights import full_random_state
from tspd_engine.node.cliargs import model_path
from tspd_router.loadgen import Timing, poisson_load, summarize
from tspd_router.supervisor import Supervisor

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


def _start_cluster(sup: Supervisor, model: list[str], device: str = "cpu") -> dict[str, str]:
    """Every role as a launcher process; the URLs of the three routers (one per mode)."""
    me, cancel = [sys.executable, str(LAUNCHER)], threading.Event()
    node = [*model, "--device", device]

    def start(name: str, role: str, *args: str) -> str:
        argv = [*me, role, "--port", "0", *args, *(node if role != "router" else [])]
        return sup.start(name, argv, 300, cancel)

    # Two prefill nodes, each hosting its bootstrap server: one hands its KV over after the
    # forward, one streams it layer by layer during the forward. They share the decode node.
    p = start("prefill", "prefill", "--bootstrap-port", "0", "--layerwise-interval", "0",
              *NODE_FLAGS)  # fmt: skip
    lw = start("prefill", "prefill", "--bootstrap-port", "0", "--layerwise-interval", "1",
               *NODE_FLAGS)  # fmt: skip
    d = start("decode", "decode", *NODE_FLAGS)
    c = start("colocated", "colocated", *NODE_FLAGS)
    # The routers tokenize with the nodes' model (--model DIR|FILE: its tokenizer).
    quiet = ["--log-level", "warning", *(["--tokenizer", model[1]] if model else [])]
    return {
        "pd": start("router", "router", "--prefill", p, "--decode", d, *quiet),
        "pd_layerwise": start("router", "router", "--prefill", lw, "--decode", d, *quiet),
        "colocated": start("router", "router", "--colocated", c, *quiet),
    }


def _bodies(
    n: int, max_tokens: int, seed: int, opts: argparse.Namespace
) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 512, n)
    if opts.model is not None:  # a real vocabulary: seeded token ids past the specials
        vocab = resolve_model(EngineConfig(checkpoint=opts.model)).vocab_size
        name = model_name(opts.model)
        return [
            {"model": name, "prompt": rng.integers(32, vocab, int(k)).tolist(),
             "max_tokens": max_tokens, "ignore_eos": True}
            for k in lengths
        ]  # fmt: skip
    return [
        {"model": "tspd-tiny", "prompt": f"{i:04d} " + "x" * int(k), "max_tokens": max_tokens,
         "ignore_eos": True}
        for i, k in enumerate(lengths)
    ]  # fmt: skip


MODES = ("colocated", "pd", "pd_layerwise")


def _pd_vs_colocated(opts: argparse.Namespace) -> dict[str, object]:
    n, rounds = (12, 1) if opts.quick else (opts.requests, opts.rounds)
    bodies = _bodies(n, opts.max_tokens, 0, opts)
    sup = Supervisor(out=io.StringIO(), stop_timeout_s=30)
    tmp = tempfile.TemporaryDirectory(prefix="bench-e2e-")
    points: list[dict[str, object]] = []
    try:
        urls = _start_cluster(sup, _checkpoint(opts, Path(tmp.name)), opts.device)
        for mode in MODES:  # warm every path up (first requests pay one-off costs)
            asyncio.run(poisson_load(urls[mode] + "/v1/completions", bodies[:4], 20.0, seed=1))
        points = [_at_rate(urls, bodies, rate, rounds, opts, n) for rate in opts.rates]
    finally:
        sup.stop_all()
        tmp.cleanup()
    return {"rates": opts.rates, "points": points}


def _at_rate(
    urls: dict[str, str],
    bodies: list[dict[str, object]],
    rate: float,
    rounds: int,
    opts: argparse.Namespace,
    n: int,
) -> dict[str, object]:
    timings: dict[str, list[Timing]] = {mode: [] for mode in MODES}
    texts: dict[str, list[str]] = {}
    for r in range(rounds):
        # Rotate the order, so no mode always runs first (or right after another).
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            got = asyncio.run(poisson_load(urls[mode] + "/v1/completions", bodies, rate, seed=r))
            timings[mode] += got
            texts.setdefault(mode, [t.text for t in got])
    for mode in MODES[1:]:
        if texts[mode] != texts["colocated"]:
            raise SystemExit(f"{mode} and colocated produced different texts for one request")
    return _report(timings, opts, n, rounds, rate)


def _report(
    timings: dict[str, list[Timing]], opts: argparse.Namespace, n: int, rounds: int, rate: float
) -> dict[str, object]:
    summary = {mode: summarize(ts) for mode, ts in timings.items()}
    co, pd, lw = summary["colocated"], summary["pd"], summary["pd_layerwise"]
    metrics = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "e2e_p50_ms",
               "e2e_p90_ms")  # fmt: skip
    rows = [[m, round(co[m], 2), round(pd[m], 2), round(lw[m], 2), round(pd[m] / co[m], 3),
             round(lw[m] / pd[m], 3)] for m in metrics]  # fmt: skip
    errors = " / ".join(str(int(summary[m]["errors"])) for m in MODES)
    what = model_name(opts.model) if opts.model else f"{opts.layers} layers x {opts.width} wide"
    print(f"PD (P TP1 -> D TP1; KV after the forward, or layerwise) vs colocated (TP1) on "
          f"{opts.device}, {what}: {n} requests x {rounds} rounds at {rate:g} req/s, "
          f"errors {errors}")  # fmt: skip
    headers = ["metric", "colocated", "pd", "pd layerwise", "pd/colocated", "layerwise/pd"]
    print(table(headers, rows))
    print("texts identical between modes: yes")
    model = {"name": what, "layers": opts.layers, "hidden": opts.width}
    return {"rate": rate, "requests": n, "rounds": rounds, "model": model,
            "device": opts.device, **summary}  # fmt: skip


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
    parser.add_argument("--only", choices=["pd", "feed"], help="run one part only")
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
    return out
