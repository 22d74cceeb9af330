"""Client-side timing of streamed completions, and an open-loop Poisson load (bench, demo).

TTFT is measured from sending the request to the first SSE chunk carrying a token (its
``token_ids``: the request asks for them, vLLM's ``return_token_ids``, as the replay does; or
text, from a server that sends no ids), and separately to the first chunk carrying text (a
first token that is only part of a character, a byte tokenizer's, shows none: its text comes
with the next token). TPOT is (last chunk - first token) / (tokens - 1), the token count
coming from the stream's usage chunk (``stream_options.include_usage``), so chunks that carry
several tokens count right.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np


@dataclass(frozen=True, slots=True)
class Timing:
    """One streamed request as its client saw it."""

    ok: bool
    text: str
    tokens: int
    ttft_s: float
    e2e_s: float
    error: str = ""
    #: The router's id of the (first) choice, ``<response id>-<index>`` ("" before any chunk).
    rid: str = ""
    #: When the request went out (``time.perf_counter()``, CLOCK_MONOTONIC on Linux: the
    #: clock of ``tspd_core.trace`` stamps, so client and server times line up).
    sent_s: float = 0.0
    #: Sending to the first chunk with text (NaN before any).
    first_text_s: float = float("nan")

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a one-token answer)."""
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


def _error_message(body: bytes) -> str:
    """What an error answer says: an OpenAI error object's message, else its text (a proxy's
    plain-text 502, say), cut to 200 characters."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:200]
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(message, str):
        return message[:200]
    return str(doc)[:200]


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> Timing:
    """POST a streamed completion to ``url`` (``.../v1/completions``) and time it."""
    body = body | {"stream": True, "stream_options": {"include_usage": True},
                   "return_token_ids": True}  # fmt: skip
    start = time.perf_counter()
    first = last = text_at = 0.0
    parts: list[str] = []
    tokens, rid = 0, ""
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            error = _error_message(await resp.read())
            return Timing(False, "", 0, 0.0, time.perf_counter() - start, f"{resp.status} {error}",
                          sent_s=start)  # fmt: skip
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Timing(False, "".join(parts), tokens, first - start,
                              time.perf_counter() - start, event["error"]["message"], rid,
                              start)  # fmt: skip
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            for choice in event["choices"]:
                text = choice.get("text") or choice.get("delta", {}).get("content") or ""
                last = time.perf_counter()
                if choice.get("token_ids") or text:  # (not a lone finish chunk)
                    first = first or last
                text_at = text_at or (last if text else 0.0)
                rid = rid or f"{event.get('id', '')}-{choice.get('index', 0)}"
                parts.append(text)
    return Timing(True, "".join(parts), tokens, first - start, last - start, "", rid, start,
                  text_at - start if text_at else float("nan"))  # fmt: skip


async def poisson_load(
    url: str, bodies: Sequence[dict[str, object]], rate: float, seed: int = 0
) -> list[Timing]:
    """Send ``bodies`` with exponential gaps of mean 1/``rate`` s (open loop: a slow answer
    never delays the next send); the timings in body order."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(bodies))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        for body, gap in zip(bodies, gaps.tolist(), strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(stream_completion(session, url, body)))
        return list(await asyncio.gather(*tasks))


def summarize(timings: Sequence[Timing]) -> dict[str, float]:
    """Medians and p90s (milliseconds) of the successful requests, and the error count."""
    ok = [t for t in timings if t.ok]
    out: dict[str, float] = {"requests": len(timings), "errors": len(timings) - len(ok)}
    for name, values in (
        ("ttft", [t.ttft_s for t in ok]),
        ("first_text", [t.first_text_s for t in ok if t.first_text_s == t.first_text_s]),
        ("tpot", [t.tpot_s for t in ok if t.tokens > 1]),
        ("e2e", [t.e2e_s for t in ok]),
    ):
        if values:
            out[f"{name}_p50_ms"] = 1e3 * float(np.percentile(values, 50))
            out[f"{name}_p90_ms"] = 1e3 * float(np.percentile(values, 90))
    return out
