"""A minimal per-node HTTP endpoint in front of one engine replica (aiohttp).

Routes (JSON in, JSON out; errors are ``{"error": "..."}`` with a 4xx/5xx status):

* ``GET /health`` → 200 ``{"status": "ok"}`` while every rank runs, else 503.
* ``POST /generate`` with ``{"input_ids": [...]}`` or ``{"text": "..."}`` plus optional
  ``max_tokens`` (16), ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``rid``, ``stream``.
  Returns ``{"rid", "output_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens"}``;
  with ``"stream": true`` the body is NDJSON, one object per chunk of new tokens, the last one
  carrying ``finish_reason``. A client that disconnects mid-stream aborts its request.

Bad bodies get 400 and never reach the engine; a dead engine gives 503. The router (a later
component) speaks to this endpoint; it is deliberately small.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from tspd_engine.client import EngineClient, RequestStream
from tspd_engine.errors import EngineDeadError, RequestError
from tspd_engine.frames import FinishReason, Output, SamplingParams
from tspd_engine.tokenizer import Tokenizer

CLIENT: web.AppKey[EngineClient] = web.AppKey("client", EngineClient)
TOKENIZER: web.AppKey[Tokenizer] = web.AppKey("tokenizer", Tokenizer)
MAX_BODY = 16 << 20


def make_app(client: EngineClient, tokenizer: Tokenizer) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[CLIENT], app[TOKENIZER] = client, tokenizer
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    return app


async def health(request: web.Request) -> web.Response:
    try:
        request.app[CLIENT].check_alive()
    except EngineDeadError as exc:
        return web.json_response({"status": "dead", "error": str(exc)}, status=503)
    return web.json_response({"status": "ok"})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def parse_request(body: Any, tokenizer: Tokenizer) -> tuple[list[int], SamplingParams, str | None]:
    """Prompt ids, sampling parameters and optional id of a /generate body (RequestError)."""
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    if ("text" in body) == ("input_ids" in body):
        raise RequestError("give exactly one of 'text' and 'input_ids'")
    if "text" in body:
        if not isinstance(body["text"], str):
            raise RequestError("'text' must be a string")
        ids = tokenizer.encode(body["text"])
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise RequestError("'input_ids' must be a list of integers")
    stop = body.get("stop_token_ids", [])
    if not isinstance(stop, list) or not all(type(t) is int for t in stop):
        raise RequestError("'stop_token_ids' must be a list of integers")
    counts = {k: body.get(k, d) for k, d in (("max_tokens", 16), ("min_tokens", 0))}
    for key, value in counts.items():
        if type(value) is not int:
            raise RequestError(f"'{key}' must be an integer")
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise RequestError("'rid' must be a non-empty string")
    params = SamplingParams(
        counts["max_tokens"], counts["min_tokens"], tuple(stop), bool(body.get("ignore_eos"))
    )
    return ids, params, rid


def _body(out: Output, tokens: tuple[int, ...], tokenizer: Tokenizer) -> dict[str, Any]:
    body: dict[str, Any] = {"rid": out.rid, "output_ids": list(tokens)}
    try:
        body["text"] = tokenizer.decode(tokens)
    except RequestError:
        body["text"] = None  # ids outside the tokenizer's vocabulary (a checkpoint's own)
    if out.finished:
        body |= {"finish_reason": out.finish.name.lower(), "prompt_tokens": out.prompt_tokens,
                 "cached_tokens": out.cached_tokens}  # fmt: skip
        if out.error:
            body["error"] = out.error
    return body


async def generate(request: web.Request) -> web.StreamResponse:
    client, tokenizer = request.app[CLIENT], request.app[TOKENIZER]
    try:
        body = await request.json()
        ids, params, rid = parse_request(body, tokenizer)
        stream = client.submit(ids, params, rid)
    except json.JSONDecodeError:
        return _error(400, "body is not valid JSON")
    except RequestError as exc:
        return _error(400, str(exc))
    try:
        if body.get("stream"):
            return await _stream(request, stream, tokenizer)
        out = await asyncio.to_thread(stream.result)
    except EngineDeadError as exc:
        return _error(503, str(exc))
    status = 400 if out.finish == FinishReason.ERROR else 200
    return web.json_response(_body(out, out.tokens, tokenizer), status=status)


async def _stream(
    request: web.Request, stream: RequestStream, tokenizer: Tokenizer
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        while stream.final is None:
            out = await asyncio.to_thread(stream.next_output)
            line = json.dumps(_body(out, out.tokens, tokenizer)) + "\n"
            await response.write(line.encode())
    except (ConnectionResetError, asyncio.CancelledError):
        request.app[CLIENT].abort(stream.rid)  # the caller went away: free its pages
        raise
    await response.write_eof()
    return response


def serve_http(client: EngineClient, tokenizer: Tokenizer, host: str, port: int) -> None:
    """Run the endpoint until interrupted (blocks)."""
    web.run_app(make_app(client, tokenizer), host=host, port=port, print=None)
