"""Trace replay against a running cluster (``tspd-launch replay``): every request of a trace
sent to the router at its arrival time, its prompt synthesised to its exact length, timed as
its client sees it, and written as the simulator's own per-request table — so
``tspd-sim fidelity --real`` can replay the same requests in the simulator and compare.

* **Open loop.** Request i is sent ``arrival_s[i]`` after the first one, whatever the answers
  before it are doing (a slow cluster queues, as it would for real users); the send lag (how
  late the client's event loop sent it) is reported, not hidden.
* **Prompts** are token ids (``/v1/completions`` takes them), ``input_len`` of them, drawn
  from :data:`PROMPT_IDS` (printable ASCII bytes: ordinary tokens of the byte tokenizer and
  of a BPE vocabulary alike) by a generator seeded with (``seed``, request): a run is
  repeatable, and no two prompts share a page by accident. A trace with prefix identities
  (Mooncake ``hash_ids``) gets the same tokens for the same block id, so its prefix hits
  happen on the real prefix caches too.
* **Outputs**: ``max_tokens`` = ``output_len`` with ``ignore_eos``, so every request makes
  exactly its trace's output; one that comes back shorter is recorded as failed.
* **Timing** (seconds from the first arrival, on the client's monotonic clock): the first
  token's and the second's (the simulator's ``first_step_end_s``) arrival and the last
  token's, read from the stream's ``token_ids``; a request that fails keeps its error (HTTP
  status and message) in ``reject_reason``.

Writes ``--out`` (``requests.parquet``, or ``.csv``) and, beside it, ``replay.json``: the run's
settings, wall-clock start and end (to cut the nodes' step logs to the run), the machine's
load average before and after, the send lag, and the counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from tspd_sim.measured import write_requests
from tspd_sim.traces import Trace

#: Token ids prompts are drawn from: printable ASCII (32..126).
PROMPT_IDS = (32, 127)
#: Most bytes one stream line may carry (a chunk of a few tokens is ~300 bytes).
MAX_LINE = 1 << 16


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """Where and how to replay: the router's base URL and served model name, the prompt
    seed, each request's time limit and the warm-up requests (sent one by one first, not
    recorded: a fresh cluster's first forwards are slower than the rest)."""

    url: str
    model: str
    seed: int = 0
    timeout_s: float = 600.0
    warmup: int = 1


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it (times from the replay's first arrival)."""

    sent_s: float = float("nan")
    first_token_s: float = float("nan")
    second_token_s: float = float("nan")
    finish_s: float = float("nan")
    tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class ReplayReport:
    """What ``replay.json`` holds."""

    url: str
    model: str
    trace: str
    requests: int
    seed: int
    warmup: int
    started_unix: float = 0.0
    ended_unix: float = 0.0
    loadavg_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loadavg_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    send_lag_max_s: float = 0.0
    send_lag_p50_s: float = 0.0
    completed: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def synth_prompts(trace: Trace, seed: int = 0) -> list[list[int]]:
    """Each request's prompt: ``input_len`` ids of :data:`PROMPT_IDS`, the same tokens for the
    same prefix block id (a trace with ``hash_ids``), the rest seeded by (seed, request)."""
    lo, hi = PROMPT_IDS
    prompts = []
    for i, n in enumerate(trace.input_len.tolist()):
        parts: list[np.ndarray[Any, np.dtype[np.int64]]] = []
        for block in trace.hashes(i).tolist() if trace.has_prefixes else []:
            gen = np.random.default_rng([seed, 1, block])
            parts.append(gen.integers(lo, hi, trace.block_tokens))
        have = sum(len(p) for p in parts)
        if have < n:
            parts.append(np.random.default_rng([seed, 0, i]).integers(lo, hi, n - have))
        prompts.append(np.concatenate(parts)[:n].tolist())
    return prompts


async def _one(
    session: aiohttp.ClientSession,
    spec: ReplaySpec,
    prompt: list[int],
    max_tokens: int,
    clock: float,
    out: Outcome,
) -> None:
    """Stream one completion into ``out`` (times relative to ``clock``)."""
    body = {
        "model": spec.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }  # fmt: skip
    out.sent_s = time.monotonic() - clock
    try:
        async with session.post(f"{spec.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.content.read(MAX_LINE)).decode(errors="replace")
                out.error = f"HTTP {resp.status}: {_message(text)}"
                return
            async for raw in resp.content:
                _event(raw, time.monotonic() - clock, out)
                if out.error:
                    return
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    if out.tokens != max_tokens and not out.error:
        out.error = f"returned {out.tokens} of {max_tokens} tokens"


def _event(raw: bytes, now: float, out: Outcome) -> None:
    line = raw.decode(errors="replace").strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[6:])
    if not isinstance(event, dict):
        raise ValueError("a stream event that is not an object")
    if "error" in event:
        out.error = f"stream error: {_message(json.dumps(event))}"
        return
    choices = event.get("choices") or []
    if not isinstance(choices, list):
        raise ValueError("'choices' is not a list")
    for choice in choices:
        ids = (choice.get("token_ids") or []) if isinstance(choice, dict) else []
        if not isinstance(ids, list):
            raise ValueError("'token_ids' is not a list")
        for _ in ids:
            out.tokens += 1
            if out.tokens == 1:
                out.first_token_s = now
            elif out.tokens == 2:
                out.second_token_s = now
        if ids:
            out.finish_s = now


def _message(text: str) -> str:
    """The ``error.message`` of an OpenAI error body, else the text, one line, bounded."""
    try:
        doc = json.loads(text)
        msg = doc["error"]["message"] if isinstance(doc, dict) else text
    except (ValueError, KeyError, TypeError):
        msg = text
    return " ".join(str(msg).split())[:300]


async def replay(
    trace: Trace, spec: ReplaySpec, on_done: Any = None
) -> tuple[list[Outcome], ReplayReport]:
    """Replay ``trace`` against the router (see the module docstring); the outcomes in
    request order and the run's report. ``on_done(i, outcome)`` is called as each finishes."""
    prompts = synth_prompts(trace, spec.seed)
    arrivals = (trace.arrival_s - trace.arrival_s[0]).tolist() if len(trace) else []
    report = ReplayReport(spec.url, spec.model, trace.name, len(trace), spec.seed, spec.warmup)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout, read_bufsize=MAX_LINE
    ) as session:
        for k in range(spec.warmup):  # request k's length, other tokens, 4 tokens out
            warm = Outcome()
            prompt = synth_prompts(trace.select(np.array([k % len(trace)])), spec.seed + 1)[0]
            await _one(session, spec, prompt, 4, time.monotonic(), warm)
            if warm.error:
                raise ReplayError(f"the warm-up request failed: {warm.error}")
        report.loadavg_before = os.getloadavg()
        report.started_unix = time.time()
        clock = time.monotonic()
        outcomes = [Outcome() for _ in prompts]

        async def run(i: int) -> None:
            await _one(session, spec, prompts[i], int(trace.output_len[i]), clock, outcomes[i])
            if on_done is not None:
                on_done(i, outcomes[i])

        tasks = []
        for i, due in enumerate(arrivals):
            delay = clock + due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run(i)))
        await asyncio.gather(*tasks)
    report.ended_unix = time.time()
    report.loadavg_after = os.getloadavg()
    lags = np.array([o.sent_s - a for o, a in zip(outcomes, arrivals, strict=True)])
    report.send_lag_max_s = float(lags.max()) if len(lags) else 0.0
    report.send_lag_p50_s = float(np.median(lags)) if len(lags) else 0.0
    report.failed = sum(bool(o.error) for o in outcomes)
    report.completed = len(outcomes) - report.failed
    for o in outcomes:
        if o.error:
            key = o.error.split(":", 1)[0]
            report.errors[key] = report.errors.get(key, 0) + 1
    return outcomes, report


class ReplayError(Exception):
    """A replay that cannot start (no router, a refused warm-up, a bad trace)."""


async def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The model the router at ``url`` serves (``GET /v1/models``); :class:`ReplayError` when
    it cannot be reached or serves none yet."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{url}/v1/models") as resp,
        ):
            doc = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ReplayError(f"cannot reach the router at {url}: {exc}") from None
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
        raise ReplayError(f"the router at {url} serves no model yet (GET /v1/models)")
    return str(cards[0].get("id"))


def select_trace(
    trace: Trace,
    start_s: float = 0.0,
    requests: int | None = None,
    rate: float | None = None,
    input_scale: float = 1.0,
    output_scale: float = 1.0,
) -> Trace:
    """The requests to replay: those arriving from ``start_s`` on (re-based to 0), the first
    ``requests`` of them, their arrivals rescaled to a mean ``rate`` (requests per second:
    (n − 1) / span, the bursts' shape kept), their lengths scaled."""
    if start_s < 0 or (requests is not None and requests < 1):
        raise ReplayError("--start must be >= 0 and --requests >= 1")
    picked = trace.window(start_s, float("inf")) if start_s else trace
    if requests is not None:
        picked = picked.head(requests)
    if len(picked) == 0:
        raise ReplayError(f"trace {trace.name!r} has no request from {start_s:g} s on")
    if rate is not None:
        if not rate > 0 or picked.rate == 0:
            raise ReplayError("--rate needs a rate > 0 and at least two distinct arrivals")
        picked = picked.scale_rate(rate / picked.rate)
    if (input_scale, output_scale) != (1.0, 1.0):
        picked = picked.scale_lengths(input_scale, output_scale)
    return picked


def write_replay(
    path: Path, trace: Trace, outcomes: Sequence[Outcome], report: ReplayReport
) -> list[Path]:
    """The per-request table at ``path`` and ``replay.json`` beside it."""
    arrivals = (trace.arrival_s - trace.arrival_s[0]).tolist() if len(trace) else []
    columns: dict[str, Sequence[Any]] = {
        "idx": list(range(len(outcomes))),
        "arrival_s": arrivals,
        "input_len": trace.input_len.tolist(),
        "output_len": trace.output_len.tolist(),
        "first_token_s": [o.first_token_s for o in outcomes],
        "first_step_end_s": [o.second_token_s for o in outcomes],
        "finish_s": [o.finish_s for o in outcomes],
        "reject_reason": [o.error for o in outcomes],
    }
    table = write_requests(path, columns)
    meta = path.with_name("replay.json")
    meta.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return [table, meta]
