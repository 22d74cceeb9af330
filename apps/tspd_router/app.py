"""The router's aiohttp application: OpenAI-compatible endpoints over PD (or colocated) nodes.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming over SSE with
``stream: true``, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` (200 while every role has a healthy node, else 503) and ``GET /metrics``
(Prometheus text; see :mod:`tspd_router.metrics`).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 bad input
or a node's refusal, 404 unknown model, 503 no healthy node, 502 a failed KV transfer or a
failed node, 504 the request timeout. A stream sends its HTTP status only with its first
token, so a request that fails before it (every PD transfer failure) gets a real error
status; a failure after it ends the stream with an SSE ``data: {"error": ...}`` event and no
``[DONE]``. A client that goes away aborts its request on the nodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import suppress

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from tspd_engine.errors import RequestError
from tspd_engine.model.tokenizer import ByteTokenizer, Tokenizer
from tspd_router.api import ApiRequest, parse_chat, parse_completion
from tspd_router.completions import Answer, Choice, Delta, Shape, run_choice
from tspd_router.config import RouterConfig
from tspd_router.dispatch import Dispatcher
from tspd_router.errors import BadRequest, NoRoute, RouterError, TimedOut
from tspd_router.metrics import RouterMetrics
from tspd_router.nodes import NodePool, Role

log = logging.getLogger(__name__)


class Router:
    """The application's state: config, nodes, dispatcher, metrics (event loop only)."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.started = int(time.time())
        self.session: aiohttp.ClientSession | None = None
        self.pool: NodePool
        self.dispatcher: Dispatcher
        self._health: asyncio.Task[None] | None = None

    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.nodes_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # one connection per request in flight
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self.pool = NodePool(self.cfg, self.session)
        self.dispatcher = Dispatcher(self.pool, self.session)
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


ROUTER: web.AppKey[Router] = web.AppKey("router", Router)


def make_app(cfg: RouterConfig, tokenizer: Tokenizer | None = None) -> web.Application:
    """The router app; run it with ``web.run_app`` or an ``AppRunner`` with
    ``handler_cancellation=True`` (so a client that disconnects aborts its request)."""
    router = Router(cfg, tokenizer or ByteTokenizer())
    app = web.Application(client_max_size=16 << 20, middlewares=[_no_route])
    app[ROUTER] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


@web.middleware
async def _no_route(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths and methods answer in OpenAI's error shape too (a client that calls an
    endpoint this router lacks, e.g. /v1/embeddings, gets a message, not an empty 404)."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        error = NoRoute(request.method, request.path, exc.status)
        return web.json_response(error.body(), status=error.status)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    router = request.app[ROUTER]
    received = time.monotonic()
    endpoint = "chat/completions" if chat else "completions"
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _fail(router, endpoint, BadRequest("the body is not valid JSON"))
    try:
        parse = parse_chat if chat else parse_completion
        api = parse(body, router.pool.model, router.tokenizer, router.cfg)
        shape = _shape(api, router.tokenizer)
    except RouterError as exc:
        return _fail(router, endpoint, exc)
    if api.stream:
        return await _stream(request, router, shape, received, endpoint)
    try:
        async with asyncio.timeout(router.cfg.request_timeout_s):
            choices = await _collect_all(router, shape, received)
    except TimeoutError:
        return _fail(router, endpoint, _timed_out(router))
    except RouterError as exc:
        return _fail(router, endpoint, exc)
    router.metrics.answered(endpoint, 200)
    return web.json_response(shape.response(choices))


def _shape(api: ApiRequest, tokenizer: Tokenizer) -> Shape:
    prefix = "chatcmpl-" if api.chat else "cmpl-"
    try:
        echoes = tuple(tokenizer.decode(p) if api.echo else "" for p in api.prompts)
    except RequestError as exc:  # token-id prompts outside the vocabulary
        raise BadRequest(str(exc), "prompt") from exc
    return Shape(api, prefix + secrets.token_hex(12), int(time.time()), echoes)


def _fail(router: Router, endpoint: str, exc: RouterError) -> web.Response:
    router.metrics.failed(exc.cause)
    router.metrics.answered(endpoint, exc.status)
    return web.json_response(exc.body(), status=exc.status)


def _timed_out(router: Router) -> TimedOut:
    return TimedOut(f"no answer within {router.cfg.request_timeout_s:g} s", "timeout")


def _choice(router: Router, shape: Shape, i: int) -> Choice:
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
    except* RouterError as errors:
        raise errors.exceptions[0] from None
    return [t.result() for t in tasks]


async def _stream(
    request: web.Request, router: Router, shape: Shape, received: float, endpoint: str
) -> web.StreamResponse:
    """SSE: the status goes out with the first text, so early failures are real errors."""
    events: asyncio.Queue[tuple[int, Delta | RouterError | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        choice = _choice(router, shape, i)
        try:
            async for delta in run_choice(router.dispatcher, router.metrics, choice, received):
                await events.put((i, delta))
        except RouterError as exc:
            await events.put((i, exc))
        await events.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(shape.api.prompts))]
    sse = _Sse(request, shape)
    status, cause = 200, ""
    try:
        async with asyncio.timeout(router.cfg.request_timeout_s):
            error = await _relay(sse, events, len(tasks))
    except TimeoutError:
        error = _timed_out(router)
    except (ConnectionResetError, asyncio.CancelledError):
        status, cause = 499, "client_gone"  # nginx's "client closed request"
        raise
    finally:
        for task in tasks:
            task.cancel()
        if cause:
            router.metrics.failed(cause)
            router.metrics.answered(endpoint, status)
    return await _close(router, endpoint, sse, error)


async def _close(
    router: Router, endpoint: str, sse: _Sse, error: RouterError | None
) -> web.StreamResponse:
    """Count the outcome; an error before the first event is a plain error response."""
    if error is None:
        router.metrics.answered(endpoint, 200)
        assert sse.response is not None
        return sse.response
    router.metrics.failed(error.cause)
    router.metrics.answered(endpoint, error.status)
    if sse.response is None:
        return web.json_response(error.body(), status=error.status)
    with suppress(ConnectionResetError):
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
    sse: _Sse, events: asyncio.Queue[tuple[int, Delta | RouterError | None]], choices: int
) -> RouterError | None:
    """Forward every choice's deltas; the first error ends the stream (returned)."""
    shape, tokens, started = sse.shape, 0, set()
    while choices:
        i, item = await events.get()
        if item is None:
            choices -= 1
        elif isinstance(item, RouterError):
            return item
        else:
            echo = "" if i in started else shape.echoes[i]  # echo leads a choice's first text
            started.add(i)
            await sse.send(shape.chunk(i, echo + item.text, item.finish, item.ids))
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


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    return web.Response(text=router.metrics.render(router.pool), content_type="text/plain")
