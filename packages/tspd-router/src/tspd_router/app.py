"""The router's aiohttp application: OpenAI-compatible endpoints over PD (or colocated) nodes.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming over SSE with
``stream: true``, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` (200 while every role has a healthy node, else 503) and ``GET /metrics``
(Prometheus text; see :mod:`tspd_router.metrics`).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 bad input
or a node's refusal, 404 unknown model, 429 every node that could take the request is at
capacity (with ``Retry-After``; code ``overloaded``), 503 no healthy node, 502 a failed KV
transfer or a failed node, 504 the request timeout. A stream sends its HTTP status only with
its first token, so a request that fails before it (every PD transfer failure) gets a real
error status; a failure after it ends the stream with an SSE ``data: {"error": ...}`` event
and no ``[DONE]``. A client that goes away aborts its request on the nodes (counted as 499
``client_gone``, streamed or not).

Hardened front door: bodies are read under the header/body time limits and bounded in size
and depth (:mod:`tspd_serving.http`: 413, 408, 400); prompts are checked against the
nodes' vocabulary and context limit before any node sees them (:mod:`tspd_serving.openai.limits`),
prompt text before it is even tokenized; parsing, chat templates and tokenizing run on
``tokenizer_threads`` worker threads, so a long prompt never stalls the event loop (``/health``
and every other request go on); every error, aiohttp's own and an unexpected exception's
(500, logged) included, has OpenAI's shape. ``GET /openapi.json`` describes the API
(:mod:`tspd_router.openapi`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from tspd_core import trace
from tspd_core.procname import name_this_thread
from tspd_router.completions import Choice, Delta, run_choice
from tspd_router.config import RouterConfig
from tspd_router.dispatch import Dispatcher
from tspd_router.errors import ApiError, BadRequest, BodyRefused, Internal, NoRoute, TimedOut
from tspd_router.metrics import RouterMetrics
from tspd_router.nodes import NodePool, Role
from tspd_router.openapi import openapi_document
from tspd_serving.http import CLIENT_KEEPALIVE_S, BodyError, read_json
from tspd_serving.openai.api import parse_chat, parse_completion
from tspd_serving.openai.limits import ModelLimits, check_prompts
from tspd_serving.openai.shape import Answer, Shape
from tspd_serving.process_metrics import exposition as process_metrics
from tspd_serving.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)


class Router:
    """The application's state: config, nodes, dispatcher, metrics (event loop only), and
    the threads that parse and tokenize requests (pure work on immutable inputs)."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.started = int(time.time())
        self.session: aiohttp.ClientSession | None = None
        self.pool: NodePool
        self.dispatcher: Dispatcher
        self._health: asyncio.Task[None] | None = None
        self.tokenizing = ThreadPoolExecutor(
            cfg.tokenizer_threads,
            thread_name_prefix="tspd-router-tokenize",
            initializer=name_this_thread,
        )

    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.nodes_timeout_s)
        # One connection per request in flight; idle ones are dropped well before a node's
        # own idle limit, so the router never reuses a connection the node is closing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self.pool = NodePool(self.cfg, self.session)
        self.dispatcher = Dispatcher(self.pool, self.session, self.metrics)
        await self.pool.check_all()  # nodes that are up now take the very first requests
        self._health = asyncio.create_task(self.pool.run(), name="tspd-router-health")

    async def stop(self, app: web.Application) -> None:
        if self._health is not None:
            self._health.cancel()
            with suppress(asyncio.CancelledError):
                await self._health
        await self.dispatcher.close()
        if self.session is not None:
            await self.session.close()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)


ROUTER: web.AppKey[Router] = web.AppKey("router", Router)


def make_app(cfg: RouterConfig, tokenizer: Tokenizer | None = None) -> web.Application:
    """The router app; run it with ``web.run_app`` or an ``AppRunner`` with
    ``handler_cancellation=True`` (so a client that disconnects aborts its request) and
    ``cfg.http.runner_kwargs()`` (the header and idle time limit)."""
    router = Router(cfg, tokenizer or ByteTokenizer())
    app = web.Application(client_max_size=cfg.http.max_body_bytes, middlewares=[_guard])
    app[ROUTER] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error answers in OpenAI's shape: unknown paths and methods (a client that calls
    an endpoint this router lacks, e.g. /v1/embeddings, gets a message, not an empty 404),
    aiohttp's own refusals, and — logged with its traceback — anything unexpected (500)."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        error: ApiError = NoRoute(request.method, request.path, exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = BodyRefused(exc.status, exc.reason)
    except BodyError as exc:
        error = BodyRefused(exc.status, exc.message)
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        error = Internal()
    response = web.json_response(error.body(), status=error.status)
    if error.status in (408, 413):
        response.force_close()  # the rest of the body is not worth reading
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    router = request.app[ROUTER]
    received = time.monotonic()
    endpoint = "chat/completions" if chat else "completions"
    try:
        shape = await _parse(request, router, chat)
    except ApiError as exc:
        return _fail(router, endpoint, exc)
    if shape.api.stream:
        return await _stream(request, router, shape, received, endpoint)
    try:
        async with asyncio.timeout(router.cfg.request_timeout_s):
            choices = await _collect_all(router, shape, received)
    except TimeoutError:
        return _fail(router, endpoint, _timed_out(router))
    except ApiError as exc:
        return _fail(router, endpoint, exc)
    except asyncio.CancelledError:
        _gone(router, endpoint)  # the client went away: the choices were aborted
        raise
    router.metrics.answered(endpoint, 200)
    return web.json_response(shape.response(choices))


async def _parse(request: web.Request, router: Router, chat: bool) -> Shape:
    """The request's body as a checked request, ready to answer (:class:`ApiError`).
    Parsed, rendered and tokenized on a tokenizer thread: a cancelled request (its client
    left) that waits for one never starts; one already running finishes there unread."""
    try:
        body = await read_json(request, router.cfg.http)
    except BodyError as exc:
        raise BodyRefused(exc.status, exc.message) from None
    limits = ModelLimits.of(n.info for n in router.pool.all())
    work = functools.partial(_checked, body, chat, router.pool.model, router, limits)
    return await asyncio.get_running_loop().run_in_executor(router.tokenizing, work)


def _checked(
    body: Any, chat: bool, served: str | None, router: Router, limits: ModelLimits
) -> Shape:
    """:func:`_parse`'s thread work (reads only immutable state: config and tokenizer)."""
    parse = parse_chat if chat else parse_completion
    api = parse(body, served, router.tokenizer, router.cfg, limits)
    check_prompts(api.prompts, limits, api.param)
    return Shape.of(api, router.tokenizer)


def _gone(router: Router, endpoint: str) -> None:
    router.metrics.failed("client_gone")
    router.metrics.answered(endpoint, 499)  # nginx's "client closed request"


def _fail(router: Router, endpoint: str, exc: ApiError) -> web.Response:
    router.metrics.failed(exc.cause)
    router.metrics.answered(endpoint, exc.status)
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers())


def _timed_out(router: Router) -> TimedOut:
    return TimedOut(f"no answer within {router.cfg.request_timeout_s:g} s", "timeout")


def _choice(router: Router, shape: Shape, i: int) -> Choice:
    trace.mark(f"{shape.rid}-{i}", "router.choice")
    api = shape.api
    return Choice(f"{shape.rid}-{i}", api.prompts[i], api.params, router.tokenizer)


async def _collect_all(router: Router, shape: Shape, received: float) -> list[Answer]:
    async def one(i: int) -> Answer:
        parts: list[str] = []
        ids: list[int] = []
        finish, tokens = "length", 0
        choice = _choice(router, shape, i)
        async for delta in run_choice(router.dispatcher, router.metrics, choice, received):
            parts.append(delta.text)
            ids.extend(delta.ids)
            if delta.finish is not None:
                finish, tokens = delta.finish, delta.tokens
        return Answer("".join(parts), finish, tokens, tuple(ids))

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i)) for i in range(len(shape.api.prompts))]
    except* ApiError as errors:
        raise errors.exceptions[0] from None
    return [t.result() for t in tasks]


async def _stream(
    request: web.Request, router: Router, shape: Shape, received: float, endpoint: str
) -> web.StreamResponse:
    """SSE: the status goes out with the first text, so early failures are real errors."""
    events: asyncio.Queue[tuple[int, Delta | ApiError | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        choice = _choice(router, shape, i)
        try:
            async for delta in run_choice(router.dispatcher, router.metrics, choice, received):
                await events.put((i, delta))
        except ApiError as exc:
            await events.put((i, exc))
        except Exception:  # a bug: the stream ends with a 500's error, not a hang
            log.exception("choice %d of %s failed", i, shape.rid)
            await events.put((i, Internal()))
        await events.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(shape.api.prompts))]
    sse = _Sse(request, shape)
    gone = False
    try:
        async with asyncio.timeout(router.cfg.request_timeout_s):
            error = await _relay(sse, events, len(tasks))
    except TimeoutError:
        error = _timed_out(router)
    except (ConnectionError, asyncio.CancelledError):  # reset, broken pipe, aborted
        gone = True
        raise
    finally:
        # No await here: the handler may be cancelled again at any await (its connection lost
        # after a failed write), and the outcome must be counted. A cancelled choice sends
        # its aborts as it ends; a pump never fails otherwise (it reports every error).
        for task in tasks:
            task.cancel()
        if gone:
            _gone(router, endpoint)
    return await _close(router, endpoint, sse, error)


async def _close(
    router: Router, endpoint: str, sse: _Sse, error: ApiError | None
) -> web.StreamResponse:
    """Count the outcome; an error before the first event is a plain error response."""
    if error is None:
        router.metrics.answered(endpoint, 200)
        assert sse.response is not None
        return sse.response
    router.metrics.failed(error.cause)
    router.metrics.answered(endpoint, error.status)
    if sse.response is None:
        return web.json_response(error.body(), status=error.status, headers=error.headers())
    with suppress(ConnectionError):
        await sse.send(error.body())
        await sse.response.write_eof()
    return sse.response


class _Sse:
    """One SSE response, opened with the first event (chat names the role first)."""

    def __init__(self, request: web.Request, shape: Shape) -> None:
        self.request = request
        self.shape = shape
        self.response: web.StreamResponse | None = None

    async def send(self, payload: dict[str, object]) -> None:
        if self.response is None:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.response.prepare(self.request)
            if self.shape.api.chat and "error" not in payload:
                for i in range(len(self.shape.api.prompts)):
                    await self._write(self.shape.chunk(i, None, None))
        await self._write(payload)

    async def _write(self, payload: dict[str, object]) -> None:
        assert self.response is not None
        await self.response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def _relay(
    sse: _Sse, events: asyncio.Queue[tuple[int, Delta | ApiError | None]], choices: int
) -> ApiError | None:
    """Forward every choice's deltas; the first error ends the stream (returned)."""
    shape, tokens, started = sse.shape, 0, set()
    while choices:
        i, item = await events.get()
        if item is None:
            choices -= 1
        elif isinstance(item, ApiError):
            return item
        else:
            echo = "" if i in started else shape.echoes[i]  # echo leads a choice's first text
            started.add(i)
            await sse.send(shape.chunk(i, echo + item.text, item.finish, item.ids))
            trace.mark(f"{shape.rid}-{i}", "router.sent")
            tokens += item.tokens if item.finish is not None else 0
    if shape.api.include_usage:
        await sse.send(shape.usage_chunk(tokens))
    assert sse.response is not None, "every choice ends with a finish event"
    await sse.response.write(b"data: [DONE]\n\n")
    await sse.response.write_eof()
    return None


async def models(request: web.Request) -> web.Response:
    """The served model; an empty list while no node has told its name (none is up)."""
    router = request.app[ROUTER]
    name = router.pool.model
    cards = [_model_card(router, name)] if name is not None else []
    return web.json_response({"object": "list", "data": cards})


async def model(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    name = request.match_info["model"]
    if name != router.pool.model:
        exc = BadRequest(f"the model {name!r} does not exist here", "model", "model_not_found")
        return web.json_response(exc.body(), status=404)
    return web.json_response(_model_card(router, name))


def _model_card(router: Router, name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": router.started, "owned_by": "tspd"}


async def health(request: web.Request) -> web.Response:
    pool = request.app[ROUTER].pool
    roles = [Role.PREFILL, Role.DECODE] if pool.cfg.pd else [Role.COLOCATED]
    report = {}
    for role in roles:
        nodes = pool.nodes[role]
        report[role.value] = {"healthy": sum(n.healthy for n in nodes), "total": len(nodes)}
    ok = all(r["healthy"] for r in report.values())
    body = {"status": "ok" if ok else "unavailable"} | report
    return web.json_response(body, status=200 if ok else 503)


async def openapi(request: web.Request) -> web.Response:
    """This router's API as an OpenAPI 3.0 document (what a client generator or a fuzzer
    reads)."""
    return web.json_response(openapi_document(request.app[ROUTER].pool.model))


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    text = router.metrics.render(router.pool) + process_metrics()
    return web.Response(text=text, content_type="text/plain")
