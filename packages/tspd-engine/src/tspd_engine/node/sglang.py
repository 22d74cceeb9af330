"""SGLang's ``/generate`` on a node, next to the node's own shape: what SGLang's model gateway
and TokenSpeed's ``GenerateReqInput`` send, and what they read back.

A ``/generate`` body is SGLang's when it carries ``sampling_params`` or any top-level
``bootstrap_*`` key (a gateway adds them to every PD request); otherwise it is the node's own
(``max_tokens``, ``pd``: :mod:`tspd_engine.node.endpoint`).

Request: ``text`` or ``input_ids`` (one prompt: SGLang's lists of prompts are refused),
``sampling_params`` (``max_new_tokens``, default 128 as SGLang's; ``min_new_tokens``,
``stop`` (a string or up to 4), ``stop_token_ids``, ``ignore_eos``; ``n`` must be 1;
``temperature`` 0, or ``top_k`` 1, or neither given: the engine decodes greedily, so sampling
asked for is refused, as are penalties and structured output), ``stream``, ``rid`` (the
request's id on this node), ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``
(:mod:`tspd_engine.node.target`). Unknown keys are ignored (a gateway adds several).

Answer: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency"}}``; ``finish_reason`` is ``{"type":
"length", "length": n}``, ``{"type": "stop", "matched": token id or stop string}``, null
while a stream goes on. Streamed (``stream: true``): SSE, one event per output of the engine
whose ``text`` is the whole text so far and whose ``output_ids`` are the new ids (TokenSpeed's
stream), then ``data: [DONE]``. Text is detokenized incrementally and cut at stop strings
exactly as the OpenAI routes do (:mod:`tspd_serving.openai.text`); a matched stop string
aborts the request on the engine. Errors are OpenAI's body (a superset of SGLang's
``{"error": {"message"}}``) with the status: 400 a refusal, 503 busy (``Retry-After``,
``"busy": true``), a failed PD transfer or a dead engine; in a stream that already began, a
last ``data: {"error": ...}`` event without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tspd_core import trace
from tspd_engine.frames import MAX_RID_CHARS, Output, PdTarget, SamplingParams
from tspd_engine.node import runs
from tspd_engine.node.replicas import Node, NodeInfo
from tspd_engine.node.sse import Sse
from tspd_engine.node.target import reached_host, top_level_target
from tspd_engine.rank.client import RequestStream
from tspd_serving.errors import RequestError
from tspd_serving.openai.api import MAX_STOPS
from tspd_serving.openai.errors import ApiError, BadRequest
from tspd_serving.openai.limits import ModelLimits, check_prompts, check_text
from tspd_serving.openai.text import TextStream
from tspd_serving.tokenizer import Tokenizer

#: SGLang's default ``max_new_tokens``.
MAX_NEW_TOKENS = 128
#: ``sampling_params`` keys that ask for something a greedy engine cannot do, with the value
#: that asks for nothing.
_NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "logprobs": None,
}


def is_sglang(body: Any) -> bool:
    """Whether a ``/generate`` body is SGLang's (see the module docstring)."""
    keys = ("sampling_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
    return isinstance(body, dict) and any(key in body for key in keys)


@dataclass(frozen=True, slots=True)
class Generation:
    """One parsed SGLang request."""

    prompt: list[int]
    params: SamplingParams
    stops: tuple[str, ...] = ()
    rid: str | None = None
    stream: bool = False


def parse(body: dict[str, Any], tokenizer: Tokenizer, info: NodeInfo) -> Generation:
    """The request an SGLang body asks for (:class:`BadRequest` saying what is wrong). Pure:
    run it off the event loop (it tokenizes)."""
    limits = ModelLimits(info.vocab_size, info.max_model_len)
    prompt = _prompt(body, tokenizer, limits)
    check_prompts([prompt], limits, "input_ids" if "input_ids" in body else "text")
    raw = body.get("sampling_params")
    if raw is not None and not isinstance(raw, dict):
        raise BadRequest("'sampling_params' must be an object", "sampling_params")
    sp: dict[str, Any] = raw or {}
    _greedy(sp)
    stops = _stops(sp.get("stop"))
    ids = sp.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(type(t) is int for t in ids)):
        raise BadRequest("'stop_token_ids' must be a list of integers", "sampling_params")
    try:
        params = SamplingParams(
            _int(sp, "max_new_tokens", MAX_NEW_TOKENS, 1),
            _int(sp, "min_new_tokens", 0, 0),
            tuple(ids or ()),
            _flag(sp, "ignore_eos"),
        )
    except RequestError as exc:
        raise BadRequest(str(exc), "sampling_params") from None
    if _flag(body, "return_logprob"):
        raise BadRequest("'return_logprob' is not supported by this deployment", "return_logprob")
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS):
        raise BadRequest(f"'rid' must be a string of 1..{MAX_RID_CHARS} characters", "rid")
    return Generation(prompt, params, stops, rid, _flag(body, "stream"))


def _prompt(body: dict[str, Any], tokenizer: Tokenizer, limits: ModelLimits) -> list[int]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None) or body.get("input_embeds") is not None:
        raise BadRequest("give exactly one of 'text' and 'input_ids'", "text")
    if isinstance(text, str):
        least = len(tokenizer.encode("")) + tokenizer.least_tokens(text)
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        check_text(nbytes, least, tokenizer.max_token_bytes, limits, "the prompt", "text")
        return tokenizer.encode(text)
    if isinstance(ids, list) and all(type(t) is int for t in ids):
        return list(ids)
    raise BadRequest(
        "'text' must be a string or 'input_ids' a list of integers: one prompt per request "
        "(lists of prompts are not served here)",
        "text" if text is not None else "input_ids",
    )


def _greedy(sp: dict[str, Any]) -> None:
    """Refuse what a greedy engine cannot do (absent sampling knobs mean greedy)."""
    temperature, top_k, top_p = sp.get("temperature"), sp.get("top_k"), sp.get("top_p")
    for key, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (type(value) not in (int, float) or value < 0):
            raise BadRequest(f"'{key}' must be a number >= 0", "sampling_params")
    if top_k is not None and type(top_k) is not int:
        raise BadRequest("'top_k' must be an integer", "sampling_params")
    if (temperature or 0) > 0 and top_k != 1:
        raise BadRequest(
            "this deployment decodes greedily: set 'temperature' to 0 or 'top_k' to 1, or "
            f"leave both out (got temperature={temperature}, top_k={top_k})",
            "sampling_params",
            "sampling_not_supported",
        )
    n = sp.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise BadRequest("'n' must be 1: greedy decoding gives n equal answers", "sampling_params")
    for key, neutral in _NEUTRAL.items():
        given = sp.get(key)
        if given is not None and given != neutral:
            raise BadRequest(f"'{key}' is not supported by this deployment", "sampling_params")


def _stops(raw: Any) -> tuple[str, ...]:
    stops = (raw,) if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "sampling_params")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop strings", "sampling_params")
    return tuple(stops)


def _int(sp: dict[str, Any], key: str, default: int, low: int) -> int:
    value = sp.get(key)
    if value is None:
        return default
    if type(value) is not int or value < low:
        raise BadRequest(f"'{key}' must be an integer >= {low}", "sampling_params")
    return value


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false", key)
    return value


# -- answering ----------------------------------------------------------------------------


def _last(out: Output) -> int | None:
    """The token an EOS stop matched (the last one generated)."""
    return out.tokens[-1] if out.tokens else None


@dataclass(slots=True)
class _Progress:
    """What one request produced so far (the answer's fields)."""

    rid: str
    prompt_tokens: int
    started: float
    text: str = ""
    ids: int = 0
    finish: dict[str, Any] | None = None
    cached: int = 0

    def step(self, out: Output, text: TextStream) -> list[int]:
        """Take one output; the ids it brought (the stream's ``output_ids``)."""
        self.ids += len(out.tokens)
        step = text.feed(out.tokens, runs.finish_name(out))
        self.text += step.text
        if out.finished:
            self.cached = out.cached_tokens
        if step.finish == "length":
            self.finish = {"type": "length", "length": self.ids}
        elif step.finish == "stop":
            matched = step.stop_string if step.stop_string is not None else _last(out)
            self.finish = {"type": "stop", "matched": matched}
        return list(out.tokens)

    def body(self, output_ids: list[int]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.ids,
            "cached_tokens": self.cached,
        }
        if self.finish is not None:
            meta["e2e_latency"] = time.monotonic() - self.started
        return {"text": self.text, "output_ids": output_ids, "meta_info": meta}


async def generate(
    request: web.Request, node: Node, tokenizer: Tokenizer, body: dict[str, Any]
) -> web.StreamResponse:
    """Serve one SGLang ``/generate`` body (see the module docstring)."""
    target: PdTarget | None = None
    try:
        target = top_level_target(body, node.info, reached_host(request.host))
        if busy := node.busy():  # before the tokenizer's work; submit checks again
            raise runs.NodeBusy(busy)
        gen = await asyncio.to_thread(parse, body, tokenizer, node.info)
        stream = runs.admit(node, gen.prompt, gen.params, gen.rid, target)
        trace.mark(stream.rid, "node.submit")
    except (RequestError, ApiError) as exc:
        error = runs.refused(exc)
        if error.cause != "engine_dead":
            runs.check_room(node, target, error)
        return runs.response(error)
    progress = _Progress(stream.rid, len(gen.prompt), time.monotonic())
    if gen.stream:
        return await _stream(request, node, stream, gen, progress, tokenizer)
    ids: list[int] = []
    try:
        await _run(node, stream, gen, progress, tokenizer, ids.extend)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
    return web.json_response(progress.body(ids))


async def _run(
    node: Node,
    stream: RequestStream,
    gen: Generation,
    progress: _Progress,
    tokenizer: Tokenizer,
    each: Callable[[list[int]], Awaitable[None] | None],
) -> None:
    """Follow the request to its end (or its stop string), calling ``each(new_ids)`` (may be
    a coroutine function) after each output."""
    text = TextStream(tokenizer, gen.prompt, gen.stops)
    async with aclosing(runs.outputs(node, stream)) as outs:
        async for out in outs:
            new = progress.step(out, text)
            result = each(new)
            if asyncio.iscoroutine(result):
                await result
            if progress.finish is not None:
                return


async def _stream(
    request: web.Request,
    node: Node,
    stream: RequestStream,
    gen: Generation,
    progress: _Progress,
    tokenizer: Tokenizer,
) -> web.StreamResponse:
    sse = Sse(request)
    try:
        await _run(node, stream, gen, progress, tokenizer,
                   lambda new: sse.send(progress.body(new)))  # fmt: skip
    except ApiError as exc:
        return await sse.fail(exc)
    except ConnectionResetError:
        return sse.response or web.StreamResponse()  # the caller left: its request is aborted
    return await sse.done()
