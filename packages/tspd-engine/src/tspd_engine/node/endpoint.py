"""The node HTTP endpoint in front of a node's engine replicas (aiohttp); the router's peer.

Routes (JSON in, JSON out; errors are ``{"error": "..."}`` with a 4xx/5xx status):

* ``GET /health`` → liveness: 200 ``{"status": "ok", "in_flight", "capacity"}`` while every
  rank process runs and progresses (its pulse beats: :mod:`tspd_engine.rank.pulse`) and the
  PD transfer workers work, else 503 with the reason. Answered from the ranks' pulses, never
  through an engine loop: a replica in a long prefill round is alive, a stopped one is not.
* ``GET /ready`` → readiness: 200 ``{"status": "ready", ...}`` while the node is alive and
  may take another request; at capacity 503 with ``Retry-After`` and ``{"error", "busy":
  true}``; a node that is not alive answers as ``/health`` does.
* ``GET /info`` → the node's role, model, TP/DP sizes, a prefill node's bootstrap address, ...
* ``GET /stats`` → ``{"replicas": [counters of each replica's rank 0]}`` (KV pool, queues, PD).
* ``GET /metrics`` → the same counters in the Prometheus text format (``tspd_node_*``:
  monotonic counts as counters named ``*_total``, levels as gauges; :mod:`.metrics`), then
  every rank's PD transfer peer metrics (``tspd_pd_*``: bytes, speed, latency, failures by
  cause, queues; labelled ``role``, ``replica``, ``rank``), scraped from the ranks' metrics
  threads, never through the engine loop; last ``process_start_time_seconds``.
* ``POST /generate`` with ``{"input_ids": [...]}`` or ``{"text": "..."}`` plus optional
  ``max_tokens`` (16), ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``rid``, ``stream``
  and ``pd`` (``{"room", "bootstrap_host", "bootstrap_port"}``: run this node's PD half of the
  request). Returns ``{"rid", "output_ids", "text", "finish_reason", "prompt_tokens",
  "cached_tokens"}``; with ``"stream": true`` the body is NDJSON, one object per chunk of new
  tokens, the last one carrying ``finish_reason``. A client that disconnects mid-stream aborts
  its request.
* ``POST /generate`` in SGLang's shape (``sampling_params``, top-level ``bootstrap_*``; what
  SGLang's model gateway and TokenSpeed's ``GenerateReqInput`` send): answered in SGLang's
  shape (:mod:`.sglang`).
* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``: OpenAI's API,
  as tspd's router serves it, with the PD half a top-level ``bootstrap_room`` names
  (:mod:`.oai`); ``GET /server_info``, ``/model_info``, ``/get_load``, ``/health_generate``,
  ``/flush_cache``, ``POST /abort_request``: what SGLang's gateway asks a worker
  (:mod:`.sglang_info`); ``GET /openapi.json``: those routes as an OpenAPI document.
* ``POST /abort`` with ``{"rid": "..."}`` → 200 ``{"aborted": true|false}`` (whether the node
  knew the request). A PD router adds ``"room"`` (0..2**63-1) in its abort to a prefill node:
  when the node does not know ``rid`` (it refused the request, or has not read it yet), it
  fails that room on its ranks so a D that pre-allocated it frees its pages now
  (:meth:`Node.fail_room`), answering ``{"aborted": false, "room_aborted": true|false}``. A
  room a request of the node holds is left alone: knowing a room ends no one else's request.

Statuses: a refused request (finish ``error``) is a 400, a failed PD transfer (finish
``transfer``) or a dead engine a 503 (in a stream: a last line with finish ``failed``). A
node holding all the requests it may (``NodeInfo.max_queued_requests``, running and queued)
refuses one more with 503, ``Retry-After: 1`` and ``{"error", "busy": true}`` before it
reaches an engine: nothing is lost, and it may be sent again. A prefill node that refuses a
body naming a valid room at its door (busy, or a 400) fails that room on its ranks
(:meth:`Node.refused`): D took its half at the same time and may hold pages for it. Requests
wait for their outputs on the event loop, no thread each
(:meth:`RequestStream.next_output_async`). Bad bodies get 400 (413 too large, 408 too slow:
:mod:`.http`) and never reach the engine; token ids outside the model's vocabulary and a
bootstrap server the node may not contact (:mod:`.allow`) are refused here too. Every error,
aiohttp's own included, is JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from tspd_core import trace
from tspd_core.ids import MAX_ROOM
from tspd_engine.errors import EngineDeadError, NodeBusyError
from tspd_engine.frames import MAX_RID_CHARS, FinishReason, Output, PdTarget, SamplingParams
from tspd_engine.node import oai, sglang, sglang_info
from tspd_engine.node.metrics import render as render_counters
from tspd_engine.node.openapi import openapi_document
from tspd_engine.node.replicas import PROBE_INTERVAL_S, RETRY_AFTER_S, Node, NodeInfo
from tspd_engine.rank.client import EngineClient, RequestStream
from tspd_serving.errors import RequestError
from tspd_serving.http import BodyError, HttpLimits, quiet_http2_probes, read_json
from tspd_serving.process_metrics import exposition as process_metrics
from tspd_serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)
NODE: web.AppKey[Node] = web.AppKey("node", Node)
TOKENIZER: web.AppKey[Tokenizer] = web.AppKey("tokenizer", Tokenizer)
LIMITS: web.AppKey[HttpLimits] = web.AppKey("limits", HttpLimits)
_STATUS = {FinishReason.ERROR: 400, FinishReason.TRANSFER: 503}


def make_app(
    node: Node | EngineClient, tokenizer: Tokenizer, limits: HttpLimits | None = None
) -> web.Application:
    """The endpoint for ``node`` (a bare client serves as a one-replica colocated node).
    Run it with ``limits.runner_kwargs()`` on its ``AppRunner`` (the header/idle limit) and
    ``handler_cancellation=True`` (a caller that goes away aborts its request)."""
    if isinstance(node, EngineClient):
        node = Node([node], NodeInfo())
    limits = limits or HttpLimits()
    quiet_http2_probes()  # SGLang's gateway probes its workers for gRPC
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[_guard])
    app[NODE], app[TOKENIZER], app[LIMITS] = node, tokenizer, limits
    app.cleanup_ctx.append(_prober)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/info", info)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort", abort)
    app.router.add_get("/openapi.json", openapi)
    oai.add_routes(app, node, tokenizer, limits)
    sglang_info.add_routes(app, node, limits)
    return app


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _busy(message: str) -> web.Response:
    """The refusal of a node at capacity (the router tries another node or answers 429)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return web.json_response({"error": message, "busy": True}, status=503, headers=headers)


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as ``{"error": ...}``: a refused body with its status, aiohttp's
    own (404, 405, 413) and, logged with its traceback, anything unexpected (500)."""
    try:
        return await handler(request)
    except BodyError as exc:
        response = _error(exc.status, exc.message)
        if exc.status in (408, 413):
            response.force_close()  # the rest of the body is not worth reading
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path}"[:300])
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal error; see the node's log")


async def _prober(app: web.Application) -> AsyncIterator[None]:
    """Probe the replicas in the background, for ``/health`` (:meth:`Node.probe`)."""

    async def loop() -> None:
        while True:
            await asyncio.to_thread(app[NODE].probe)
            await asyncio.sleep(PROBE_INTERVAL_S)

    task = asyncio.create_task(loop(), name="tspd-node-probe")
    yield
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task


async def health(request: web.Request) -> web.Response:
    node = request.app[NODE]
    problem = node.health()
    if problem:
        return web.json_response({"status": "unhealthy", "error": problem}, status=503)
    return web.json_response({"status": "ok"} | _load(node))


async def ready(request: web.Request) -> web.Response:
    node = request.app[NODE]
    problem = node.health()
    if problem:
        return web.json_response({"status": "unhealthy", "error": problem}, status=503)
    busy = node.busy()
    if busy:
        return _busy(busy)
    return web.json_response({"status": "ready"} | _load(node))


def _load(node: Node) -> dict[str, int]:
    return {"in_flight": node.in_flight(), "capacity": node.info.max_queued_requests}


async def info(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response(node.info.to_json() | {"in_flight": node.in_flight()})


async def stats(request: web.Request) -> web.Response:
    try:
        replicas = await asyncio.to_thread(request.app[NODE].stats)
    except (EngineDeadError, TimeoutError) as exc:
        return _error(503, str(exc))
    return web.json_response({"replicas": replicas})


async def metrics(request: web.Request) -> web.Response:
    node = request.app[NODE]
    # Both at once: the engine counters wait for a round, the peers' for their workers.
    stats, peers = asyncio.to_thread(node.stats), asyncio.to_thread(node.peer_metrics)
    try:
        replicas, peer_text = await asyncio.gather(stats, peers)
    except (EngineDeadError, TimeoutError) as exc:
        return _error(503, str(exc))
    text = render_counters(node.info.role.value, replicas) + peer_text + process_metrics()
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


def parse_request(
    body: Any, tokenizer: Tokenizer, vocab_size: int = 0
) -> tuple[list[int], SamplingParams, str | None, PdTarget | None]:
    """Prompt ids, sampling parameters, optional id and PD target of a /generate body
    (:class:`RequestError` saying what is wrong); ids must lie below ``vocab_size`` (0: the
    engine checks)."""
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
    if not ids:
        raise RequestError("prompt must hold at least one token id")
    if vocab_size and not all(0 <= t < vocab_size for t in ids):
        raise RequestError(f"prompt token ids must lie in 0..{vocab_size - 1}")
    stop = body.get("stop_token_ids", [])
    if not isinstance(stop, list) or not all(type(t) is int for t in stop):
        raise RequestError("'stop_token_ids' must be a list of integers")
    counts = {k: body.get(k, d) for k, d in (("max_tokens", 16), ("min_tokens", 0))}
    for key, value in counts.items():
        if type(value) is not int:
            raise RequestError(f"'{key}' must be an integer")
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS):
        raise RequestError(f"'rid' must be a string of 1..{MAX_RID_CHARS} characters")
    params = SamplingParams(
        counts["max_tokens"], counts["min_tokens"], tuple(stop), bool(body.get("ignore_eos"))
    )
    return ids, params, rid, _pd(body.get("pd"))


def _pd(raw: Any) -> PdTarget | None:
    if raw is None:
        return None
    keys = ("room", "bootstrap_host", "bootstrap_port")
    if not isinstance(raw, dict) or sorted(raw) != sorted(keys):
        raise RequestError(f"'pd' must be an object with exactly the keys {list(keys)}")
    return PdTarget(raw["room"], raw["bootstrap_host"], raw["bootstrap_port"])


def _target(body: Any) -> PdTarget | None:
    """The PD target a body names, when it names a valid one (whatever else is wrong)."""
    if not isinstance(body, dict):
        return None
    try:
        return _pd(body.get("pd"))
    except RequestError:
        return None


def _body(out: Output, tokens: tuple[int, ...], tokenizer: Tokenizer) -> dict[str, Any]:
    body: dict[str, Any] = {"rid": out.rid, "output_ids": list(tokens)}
    try:
        body["text"] = tokenizer.decode(tokens)
    except RequestError:
        body["text"] = None  # ids outside the tokenizer's vocabulary (a checkpoint's own)
    if out.finished:
        body |= {
            "finish_reason": out.finish.name.lower(),
            "prompt_tokens": out.prompt_tokens,
            "cached_tokens": out.cached_tokens,
        }
        if out.error:
            body["error"] = out.error
    return body


async def generate(request: web.Request) -> web.StreamResponse:
    node, tokenizer = request.app[NODE], request.app[TOKENIZER]
    body = await read_json(request, request.app[LIMITS])
    if sglang.is_sglang(body):
        return await sglang.generate(request, node, tokenizer, body)
    try:
        if busy := node.busy():  # before the tokenizer's work; submit checks again, atomically
            raise NodeBusyError(busy)
        ids, params, rid, pd = parse_request(body, tokenizer, node.info.vocab_size)
        stream = node.submit(ids, params, rid, pd)
        trace.mark(stream.rid, "node.submit")
    except NodeBusyError as exc:
        node.refused(_target(body), "the prefill node was at capacity")
        return _busy(str(exc))
    except RequestError as exc:
        node.refused(_target(body), "the prefill node refused the request")
        return _error(400, str(exc))
    except EngineDeadError as exc:  # its intake takes nothing: a room failure would not go
        return _error(503, str(exc))
    try:
        if body.get("stream"):
            return await _stream(request, stream, tokenizer)
        out = await stream.result_async()
        trace.mark(stream.rid, "node.answer")
    except EngineDeadError as exc:
        node.abort(stream.rid)  # should the engine still hold it, it ends now
        return _error(503, str(exc))
    except asyncio.CancelledError:
        node.abort(stream.rid)  # the caller went away (handler cancellation): free its pages
        raise
    finally:
        node.release(stream.rid)
    status = _STATUS.get(out.finish, 200)
    return web.json_response(_body(out, out.tokens, tokenizer), status=status)


async def _stream(
    request: web.Request, stream: RequestStream, tokenizer: Tokenizer
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)  # a caller already gone fails here: abort it too
        while stream.final is None:
            try:
                out = await stream.next_output_async()
            except EngineDeadError as exc:
                request.app[NODE].abort(stream.rid)
                line = {"rid": stream.rid, "output_ids": [], "finish_reason": "failed"}
                await response.write((json.dumps(line | {"error": str(exc)}) + "\n").encode())
                break
            trace.mark(stream.rid, "node.output")
            line_body = _body(out, out.tokens, tokenizer)
            await response.write((json.dumps(line_body) + "\n").encode())
    except asyncio.CancelledError:
        request.app[NODE].abort(stream.rid)  # the caller went away: free its pages
        raise
    except ConnectionResetError:
        # The caller closed the stream (a router that already has its answer, or a client
        # that left): an ordinary end, not a server error worth a traceback in the log.
        request.app[NODE].abort(stream.rid)
        log.info("%s: the client closed the stream; request aborted", stream.rid)
        return response
    await response.write_eof()
    return response


async def openapi(request: web.Request) -> web.Response:
    """The SGLang-shaped and OpenAI routes as an OpenAPI 3.0 document (:mod:`.openapi`)."""
    return web.json_response(openapi_document(request.app[NODE].info.model))


async def abort(request: web.Request) -> web.Response:
    body = await read_json(request, request.app[LIMITS])
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str) or not rid:
        return _error(400, "'rid' must be a non-empty string")
    room = body.get("room")
    if room is not None and (type(room) is not int or not 0 <= room <= MAX_ROOM):
        return _error(400, "'room' must be an integer in 0..2**63-1")
    node = request.app[NODE]
    answer = {"aborted": node.abort(rid)}
    if room is not None:  # known rid: its own abort ends its room; else the room goes alone
        why = "aborted before the prefill node took its request"
        answer["room_aborted"] = not answer["aborted"] and node.fail_room(room, why)
    return web.json_response(answer)


def serve_http(node: Node | EngineClient, tokenizer: Tokenizer, sock: socket.socket) -> None:
    """Run the endpoint on a bound socket (:func:`bind_socket`) until
    interrupted (blocks)."""
    limits = HttpLimits()
    app = make_app(node, tokenizer, limits)
    kwargs = limits.runner_kwargs()
    web.run_app(app, sock=sock, print=None, handler_cancellation=True, **kwargs)
