"""TspdConnector vs vLLM's own MooncakeConnector (TCP), side by side on this machine: real vLLM
(CPU build) prefill and decode processes serving SmolLM2-135M, the same prompts, 1 and 4
concurrent streams. Per request: TTFT (client → D's first streamed token) and the KV
hand-over (P's answer → D's first token: D's look-up, the transfer, D's one-token step).

``tspd`` and ``mooncake`` run the concurrent flow both designs expect: the client sends P
(one token, ``do_remote_decode``) and D (streamed) at once — tspd with a room and P's
bootstrap address, Mooncake with a ``transfer_id`` and P's engine id and bootstrap address.
tspd also runs the front's default flow (``tspd first-token``): P first, whose first token
is the client's first token (its TTFT) and goes into D's prompt; its hand-over is P's answer
→ D's first token. A connector that cannot run here is reported with its error (the node's
log) instead of figures.

Every (level, flow) sends prompts of its own, and the warm-up another set: a request never
meets a prefix an earlier one left in P's or D's cache (a P that hits it prefills one forward).

``tspd-layerwise`` is ``tspd`` with P streaming layerwise (``layerwise_interval``,
``--interval``): the same flows, so ``--connectors tspd,tspd-layerwise`` measures layerwise
on against off. It only streams prompts of several forwards (``--prefill-chunk``: P's
``--max-num-batched-tokens``; vLLM's default, 2048 here, prefills these prompts in one).

Needs vLLM: run it in `nox -s vllm`'s environment (`.nox/vllm/bin/python
benchmarks/bench_vllm.py`, or `nox -s bench -- vllm`, which runs it there). JSON to
bench-results/vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parent
VLLM_PYTHON = ROOT / ".nox" / "vllm" / "bin" / "python"
MODEL_DIR = ROOT / ".nox" / "vllm-models" / "smollm2-135m"
TOPIC = ["the harbour", "a mountain pass", "the old library", "a night train", "the market"]


def prompts(count: int, words: int, start: int = 0) -> list[str]:
    """Distinct prompts of about ``words`` words (no shared prefix past a few tokens);
    ``start`` numbers them, so sets of other starts share nothing with this one."""
    out = []
    for i in range(start, start + count):
        body = " ".join(f"{TOPIC[(i + j) % 5]} {i * 31 + j}" for j in range(words // 3))
        out.append(f"Story {i}: {body}. Summarise the story in one sentence:")
    return out


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    handover_s: float


@dataclass(frozen=True)
class Row:
    connector: str
    streams: int
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    handover_p50_ms: float
    handover_p90_ms: float


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


ParamsFor = Callable[[], tuple[dict[str, Any], dict[str, Any]]]


async def _one(session: Any, p_url: str, d_url: str, prompt: str, params: ParamsFor) -> Sample:
    p_params, d_params = params()
    base = {"model": "smollm2", "prompt": prompt, "temperature": 0}
    p_body = base | {"max_tokens": 1, "kv_transfer_params": p_params}
    d_body = base | {"max_tokens": 8, "stream": True, "kv_transfer_params": d_params}
    t0 = time.perf_counter()
    p_done: list[float] = []

    async def prefill() -> None:
        async with session.post(f"{p_url}/v1/completions", json=p_body) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"prefill answered {resp.status}")
        p_done.append(time.perf_counter())

    first = None
    if p_params.get("bootstrap_room") is None and "transfer_id" not in p_params:
        # tspd's sequential flow (tspd-vllm front's default): P first; its first token is
        # the client's first token, and goes into D's prompt with P's kv_transfer_params.
        async with session.post(
            f"{p_url}/v1/completions", json=p_body | {"return_token_ids": True}
        ) as resp:
            answer = await resp.json()
        p_done.append(time.perf_counter())
        choice = answer["choices"][0]
        d_body = d_body | {"prompt": [*choice["prompt_token_ids"], *choice["token_ids"]],
                           "kv_transfer_params": answer["kv_transfer_params"]}  # fmt: skip
        async with session.post(f"{d_url}/v1/completions", json=d_body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"decode answered {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
        assert first is not None, "the decode stream carried no token"
        return Sample(p_done[0] - t0, first - p_done[0])
    task = asyncio.ensure_future(prefill())
    async with session.post(f"{d_url}/v1/completions", json=d_body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"decode answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    await task
    assert first is not None, "the decode stream carried no token"
    return Sample(first - t0, first - p_done[0])


async def _level(
    p_url: str, d_url: str, texts: list[str], streams: int, params: ParamsFor
) -> list[Sample]:
    import aiohttp

    samples: list[Sample] = []
    queue = list(texts)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def worker() -> None:
            while queue:
                samples.append(await _one(session, p_url, d_url, queue.pop(0), params))

        await asyncio.gather(*(worker() for _ in range(streams)))
    return samples


Configs = tuple[dict[str, Any], dict[str, Any], ParamsFor]


def _tspd(boot: int, sequential: bool = False, interval: int = 0) -> Configs:
    from tspd_testing.vllm_nodes import tspd_kv_config

    def params() -> tuple[dict[str, Any], dict[str, Any]]:
        if sequential:
            return {"do_remote_decode": True}, {}
        room = secrets.randbelow(1 << 62)
        d = {"do_remote_prefill": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
             "bootstrap_room": room}  # fmt: skip
        return {"do_remote_decode": True, "bootstrap_room": room}, d

    extra = {"layerwise_interval": interval} if interval else {}
    return tspd_kv_config("kv_producer", boot, **extra), tspd_kv_config("kv_consumer"), params


def _mooncake(boot: int) -> tuple[dict[str, Any], dict[str, Any], ParamsFor]:
    def config(role: str, engine: str) -> dict[str, Any]:
        return {"kv_connector": "MooncakeConnector", "kv_role": role, "engine_id": engine,
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}  # fmt: skip

    def params() -> tuple[dict[str, Any], dict[str, Any]]:
        xfer = secrets.token_hex(8)
        d = {"do_remote_prefill": True, "remote_engine_id": "bench-p",
             "remote_bootstrap_addr": f"http://127.0.0.1:{boot}", "transfer_id": xfer}  # fmt: skip
        return {"do_remote_decode": True, "transfer_id": xfer}, d

    return config("kv_producer", "bench-p"), config("kv_consumer", "bench-d"), params


@dataclass
class Pair:
    """One connector's P and D and the flows they serve."""

    p: Any
    d: Any
    flows: dict[str, ParamsFor]

    def stop(self) -> None:
        self.p.stop()
        self.d.stop()


def _start_pair(name: str, logs: Path, chunk: int, interval: int) -> Pair:
    """Start one connector's P and D (not waited for)."""
    from tspd_testing.vllm_nodes import free_port, start_vllm

    boot = free_port()
    if name in ("tspd", "tspd-layerwise"):
        every = interval if name == "tspd-layerwise" else 0
        p_cfg, d_cfg, concurrent = _tspd(boot, interval=every)
        flows = {f"{name} concurrent": concurrent, f"{name} first-token": _tspd(boot, True)[2]}
    else:
        p_cfg, d_cfg, pull = _mooncake(boot)
        flows = {"mooncake concurrent": pull}
    p_env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)}
    d_env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())}
    p_args = ("--max-num-batched-tokens", str(chunk), "--max-num-seqs", str(min(chunk, 256)))
    p = start_vllm(f"{name}-prefill", MODEL_DIR, logs, kv_config=p_cfg, env=p_env,
                   extra_args=p_args if chunk else ())  # fmt: skip
    d = start_vllm(f"{name}-decode", MODEL_DIR, logs, kv_config=d_cfg, env=d_env)
    return Pair(p, d, flows)


#: A set of prompts by its key: every (level, flow) measures prompts of its own, so no
#: request meets a prefix an earlier one left in P's or D's cache (a P that prefills a
#: prefix hit computes one forward; the warm-up has its own set too).
Texts = Callable[[int], list[str]]
WARM_UP = 99


def _ready(pair: Pair, texts: list[str]) -> dict[str, Any] | None:
    """Wait for the pair and warm it up (every prompt once per flow: the first passes over
    new shapes are slow); the error (with the nodes' logs) if it cannot run."""
    try:
        pair.p.wait_ready()
        pair.d.wait_ready()
        for params in pair.flows.values():
            asyncio.run(_level(pair.p.url, pair.d.url, texts, 1, params))
    except Exception as exc:  # reported, not raised: the other connector still runs
        return {"error": f"{type(exc).__name__}: {exc}", "prefill_log": pair.p.log_tail(3000),
                "decode_log": pair.d.log_tail(3000)}  # fmt: skip
    return None


def _row(flow: str, streams: int, samples: list[Sample]) -> Row:
    ttft = [s.ttft_s for s in samples]
    hand = [s.handover_s for s in samples]
    return Row(flow, streams, len(samples), _pct(ttft, 0.5), _pct(ttft, 0.9),
               _pct(hand, 0.5), _pct(hand, 0.9))  # fmt: skip


def _measure(
    name: str, texts: Texts, levels: list[int], logs: Path, chunk: int, interval: int
) -> dict[str, Any]:
    """One connector's P and D; tspd's nodes serve both of its flows, in turn per level."""
    pair = _start_pair(name, logs, chunk, interval)
    try:
        error = _ready(pair, texts(WARM_UP))
        if error is not None:
            return error
        rows = []
        for li, streams in enumerate(levels):
            for fi, (flow, params) in enumerate(pair.flows.items()):
                mine = texts(li * 10 + fi)
                samples = asyncio.run(_level(pair.p.url, pair.d.url, mine, streams, params))
                rows.append(_row(flow, streams, samples))
        return {"rows": [asdict(r) for r in rows]}
    finally:
        pair.stop()


def _measure_interleaved(
    names: list[str],
    texts: Texts,
    levels: list[int],
    logs: Path,
    chunk: int,
    interval: int,
    rounds: int,
) -> dict[str, Any]:
    """Every connector's P and D at once, measured in turn: each level's prompts are split
    into ``rounds`` shares and every flow of every pair serves each share before the next
    (the order reversed every other round), so a shared machine's load drifts over all
    alike (``--interleave``)."""
    pairs = {name: _start_pair(name, logs, chunk, interval) for name in names}
    try:
        for name, pair in pairs.items():
            error = _ready(pair, texts(WARM_UP))
            if error is not None:
                return {name: error}
        samples: dict[tuple[str, int], list[Sample]] = {}
        for li, streams in enumerate(levels):
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    pair = pairs[name]
                    for fi, (flow, params) in enumerate(pair.flows.items()):
                        share = texts(li * 10 + fi)[r::rounds]
                        got = asyncio.run(_level(pair.p.url, pair.d.url, share, streams, params))
                        samples.setdefault((flow, streams), []).extend(got)
        rows = [_row(flow, streams, got) for (flow, streams), got in samples.items()]
        return {"rows": [asdict(r) for r in rows]}
    finally:
        for pair in pairs.values():
            pair.stop()


def main(argv: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench_vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per level")
    parser.add_argument("--words", type=int, default=300, help="prompt length in words")
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--connectors", default="tspd,mooncake")
    parser.add_argument("--quick", action="store_true", help="4 requests per level")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="P's --max-num-batched-tokens (0: vLLM's default)")  # fmt: skip
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="run every connector's nodes at once, in turn over ROUNDS shares "
                        "of the prompts (for a shared machine)")  # fmt: skip
    parser.add_argument("--interval", type=int, default=1,
                        help="tspd-layerwise's layerwise_interval (layers per write)")  # fmt: skip
    opts = parser.parse_args(argv)
    from tspd_vllm.model import export_model

    export_model(MODEL_DIR)
    levels = [int(s) for s in opts.streams.split(",")]
    count = 4 if opts.quick else opts.requests

    def texts(key: int) -> list[str]:
        return prompts(count, opts.words, start=key * count)

    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results: dict[str, object] = {
        "prompt_words": opts.words,
        "requests": count,
        "logs": str(logs),
        "load_before": os.getloadavg(),
        "prefill_chunk": opts.prefill_chunk,
        "layerwise_interval": opts.interval,
        "interleave": opts.interleave,
    }
    names = opts.connectors.split(",")
    if opts.interleave:
        print(f"-- {', '.join(names)}, interleaved over {opts.interleave} rounds", flush=True)
        together = _measure_interleaved(names, texts, levels, logs, opts.prefill_chunk,
                                        opts.interval, opts.interleave)  # fmt: skip
        for name in names:
            rows = [r for r in together.get("rows", []) if r["connector"].startswith(f"{name} ")]
            results[name] = together.get(name) or {"rows": rows}
    for name in [] if opts.interleave else names:
        print(f"-- {name}", flush=True)
        results[name] = _measure(name, texts, levels, logs, opts.prefill_chunk, opts.interval)
    results["load_after"] = os.getloadavg()
    from common import table

    print(f"load average before {results['load_before']}, after {results['load_after']}")

    rows = [r for n in opts.connectors.split(",") for r in results[n].get("rows", [])]  # type: ignore[attr-defined]
    if rows:
        print(table(list(rows[0]), [list(r.values()) for r in rows]))
    for n in opts.connectors.split(","):
        err = results[n].get("error")  # type: ignore[attr-defined]
        if err:
            print(f"{n}: could not run: {err}")
    return results


def run(args: list[str]) -> dict[str, object]:
    """`benchmarks/run.py vllm`: run in `nox -s vllm`'s environment (it has vLLM)."""
    if VLLM_PYTHON.exists() and Path(sys.executable) != VLLM_PYTHON:
        out = ROOT / "bench-results" / "vllm.json"
        env = dict(os.environ, PYTHONPATH=str(HERE))
        subprocess.run([str(VLLM_PYTHON), __file__, "--json", str(out), *args], check=True, env=env)
        return dict(json.loads(out.read_text()))
    try:
        import vllm  # noqa: F401
    except ImportError:
        why = "needs vLLM: run `./nox -s vllm` once (it builds .nox/vllm)"
        print(f"bench vllm: skipped, {why}")
        return {"skipped": why}
    return main(args)


if __name__ == "__main__":
    argv = sys.argv[1:]
    json_out = None
    if "--json" in argv:
        i = argv.index("--json")
        json_out = Path(argv[i + 1])
        del argv[i : i + 2]
    sys.path.insert(0, str(HERE))
    result = main(argv)
    if json_out is not None:
        json_out.parent.mkdir(exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2))
