"""Reference engine end to end: the device-feed decode loop against the synchronous loop.

Both loops run the same model, scheduler and requests in this process (TP 1, one torch thread)
and must produce the same tokens (checked). Reported per batch size: decode steps per second
and tokens per second of each loop, the fed/sync ratio, and where a step's time goes (model
forward vs the host's scheduling and bookkeeping).

On CPU every torch op is synchronous, so the fed loop cannot hide host time behind device
work here: the ratio measures the cost of the feed's structure (cells, ring, events, a round
kept in flight). ``hidden bound`` is what the same loop could reach on a
device that runs the forward asynchronously: a step costs max(forward, host) instead of their
sum. Best of ``--repeat`` (5) alternating runs per point (the machine is shared).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "apps"))

import torch
from common import table

from tspd_engine.config import EngineConfig, ModelConfig
from tspd_engine.engine import Engine
from tspd_engine.frames import SamplingParams
from tspd_engine.tokenizer import ByteTokenizer


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


def _config(feed: bool, hidden: int) -> EngineConfig:
    model = ModelConfig(
        hidden_size=hidden, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        head_dim=hidden // 8, intermediate_size=hidden * 3,
    )  # fmt: skip
    return EngineConfig(model=model, page_size=16, num_pages=2048, max_running=64,
                        device_feed=feed, prefix_cache=False)  # fmt: skip


def _timed_forward(engine: Engine) -> list[float]:
    """Wrap the runner's forward to accumulate its wall time (it is synchronous on CPU) and
    count its calls: ``[seconds, calls]``."""
    spent = [0.0, 0.0]
    runner = engine.core.runner
    inner = runner._forward

    def forward(ids: torch.Tensor, meta: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return inner(ids, meta)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    runner._forward = forward  # type: ignore[method-assign]
    return spent


def measure(feed: bool, rows: int, max_tokens: int, hidden: int) -> Point:
    engine = Engine(_config(feed, hidden))
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


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256, help="model hidden size")
    opts = parser.parse_args(args)
    torch.set_num_threads(1)
    batches = [1, 8] if opts.quick else [1, 8, 32]
    max_tokens = 16 if opts.quick else 64
    repeat = 1 if opts.quick else opts.repeat
    results: dict[str, object] = {"hidden": opts.hidden, "max_tokens": max_tokens, "points": []}
    rows_out = []
    for rows in batches:
        best: dict[str, Point] = {}
        for _ in range(repeat):
            for feed in (False, True):
                p = measure(feed, rows, max_tokens, opts.hidden)
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
