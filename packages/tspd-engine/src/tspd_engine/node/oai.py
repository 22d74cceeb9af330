"""OpenAI's routes on a node: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` and ``GET /v1/models/{id}``, answered exactly as tspd's router answers
them (the same parsing, chat templates, limits, detokenizer, stop strings and bodies:
:mod:`tspd_serving.openai`), for clients and gateways that talk to nodes directly.

SGLang's model gateway in PD mode sends these bodies to P and D at once with top-level
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (:mod:`tspd_engine.node.target`)
and passes D's answer on: each node then serves its half (P prefills and answers with the
first token, D decodes the whole answer from the KV P sends), so such a request carries one
prompt. Without a room the node generates the request itself, one choice per prompt.

Errors are OpenAI's body with the status: 400 a bad body or the engine's refusal, 404 another
model, 408/413 the body's time or size, 503 busy (``Retry-After``, ``"busy": true``), a failed
PD transfer (``transfer_failed``) or a dead engine. Streams (SSE) open with their first text,
so an error before it is a real status; after it, a last ``data: {"error": ...}`` event and no
``[DONE]``. Parsing and tokenizing run off the event loop. Event loop only.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any

from aiohttp import web

from tspd_engine.frames import PdTarget, SamplingParams
from tspd_engine.node import runs
from tspd_engine.node.replicas import Node
from tspd_engine.node.sse import Sse
from tspd_engine.node.target import reached_host, top_level_target
from tspd_engine.rank.client import RequestStream
from tspd_serving.errors import RequestError
from tspd_serving.http import BodyError, HttpLimits, read_json
from tspd_serving.openai.api import ApiDefaults, GenParams, parse_chat, parse_completion
from tspd_serving.openai.errors import ApiError, BadRequest
from tspd_serving.openai.limits import ModelLimits, check_prompts
from tspd_serving.openai.shape import Answer, Shape
from tspd_serving.openai.text import TextStream
from tspd_serving.tokenizer import Tokenizer

OPTIONS = ApiDefaults()
_Event = tuple[int, Answer | ApiError | None]


def add_routes(app: web.Application, node: Node, tokenizer: Tokenizer, limits: HttpLimits) -> None:
    """Serve the OpenAI routes on ``app`` for ``node``."""
    front = _Front(node, tokenizer, limits)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.chat)
    app.router.add_get("/v1/models", front.models)
    app.router.add_get("/v1/models/{model}", front.model)


def model_card(node: Node) -> dict[str, object]:
    return {"id": node.info.model, "object": "model", "created": _STARTED, "owned_by": "tspd"}


_STARTED = int(time.time())


class _Front:
    """The routes' shared state (the node, its tokenizer, its body limits)."""

    def __init__(self, node: Node, tokenizer: Tokenizer, limits: HttpLimits) -> None:
        self.node, self.tokenizer, self.limits = node, tokenizer, limits

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card(self.node)]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.node.info.model:
            name = request.match_info["model"][:200]
            error = BadRequest(f"the model {name!r} does not exist here", "model",
                               "model_not_found")  # fmt: skip
            return web.json_response(error.body(), status=404)
        return web.json_response(model_card(self.node))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        node, target = self.node, None
        try:
            body = await _body(request, self.limits)
            if isinstance(body, dict):
                target = top_level_target(body, node.info, reached_host(request.host))
            if busy := node.busy():  # before the tokenizer's work; submit checks again
                raise runs.NodeBusy(busy)
            shape = await asyncio.to_thread(self._parse, body, chat)
            if target is not None and len(shape.api.prompts) != 1:
                raise BadRequest("a PD request (bootstrap_room) carries exactly one prompt",
                                 shape.api.param)  # fmt: skip
            streams = self._admit(shape, target)
        except (RequestError, ApiError) as exc:
            error = runs.refused(exc)
            if error.cause != "engine_dead":
                runs.check_room(node, target, error)
            return runs.response(error)
        if shape.api.stream:
            return await self._stream(request, shape, streams)
        try:
            answers = await self._collect(shape, streams)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
        return web.json_response(shape.response(answers))

    def _parse(self, body: Any, chat: bool) -> Shape:
        """The checked request (thread work: reads only immutable state)."""
        info = self.node.info
        limits = ModelLimits(info.vocab_size, info.max_model_len)
        parse = parse_chat if chat else parse_completion
        api = parse(body, info.model, self.tokenizer, OPTIONS, limits)
        check_prompts(api.prompts, limits, api.param)
        return Shape.of(api, self.tokenizer)

    def _admit(self, shape: Shape, target: PdTarget | None) -> list[RequestStream]:
        """One request per prompt; if one is refused, the ones before it are taken back."""
        params = _sampling(shape.api.params)
        streams: list[RequestStream] = []
        try:
            for prompt in shape.api.prompts:
                streams.append(runs.admit(self.node, list(prompt), params, None, target))  # noqa: PERF401
        except ApiError:
            for stream in streams:
                self.node.abort(stream.rid)
                self.node.release(stream.rid)
            raise
        return streams

    async def _choice(
        self, shape: Shape, i: int, stream: RequestStream, each: asyncio.Queue[_Event] | None
    ) -> Answer:
        """Follow choice ``i`` to its end; each piece of text goes to ``each`` as it comes."""
        params = shape.api.params
        text = TextStream(self.tokenizer, shape.api.prompts[i], params.stop)
        parts: list[str] = []
        ids: list[int] = []
        async with aclosing(runs.outputs(self.node, stream)) as outs:
            async for out in outs:
                step = text.feed(out.tokens, runs.finish_name(out))
                parts.append(step.text)
                ids.extend(out.tokens)
                piece = Answer(step.text, step.finish or "", len(ids), out.tokens)
                if each is not None and (step.text or step.finish or params.return_token_ids):
                    await each.put((i, piece))
                if step.finish is not None:
                    return Answer("".join(parts), step.finish, len(ids), tuple(ids))
        raise AssertionError("a request's outputs end with its final one")

    async def _collect(self, shape: Shape, streams: list[RequestStream]) -> list[Answer]:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._choice(shape, i, s, None))
                         for i, s in enumerate(streams)]  # fmt: skip
        except* ApiError as errors:
            raise errors.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _stream(
        self, request: web.Request, shape: Shape, streams: list[RequestStream]
    ) -> web.StreamResponse:
        events: asyncio.Queue[_Event] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                await self._choice(shape, i, stream, events)
            except ApiError as exc:
                await events.put((i, exc))
            await events.put((i, None))

        async def opening() -> None:
            if shape.api.chat:
                for i in range(len(streams)):
                    await sse.write(shape.chunk(i, None, None))

        sse = Sse(request, opening)
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            error, tokens = await _relay(sse, shape, events, len(tasks))
        except ConnectionResetError:
            return sse.response or web.StreamResponse()  # the caller left
        finally:
            for task in tasks:
                task.cancel()  # a finished pump ignores it; the others abort their requests
        if error is not None:
            return await sse.fail(error)
        if shape.api.include_usage:
            await sse.write(shape.usage_chunk(tokens))
        return await sse.done()


async def _relay(
    sse: Sse, shape: Shape, events: asyncio.Queue[_Event], left: int
) -> tuple[ApiError | None, int]:
    """Forward every choice's pieces; the first error ends the stream. The error, if any, and
    the tokens the choices generated."""
    started: set[int] = set()
    tokens = 0
    while left:
        i, item = await events.get()
        if item is None:
            left -= 1
        elif isinstance(item, ApiError):
            return item, tokens
        else:
            echo = "" if i in started else shape.echoes[i]  # echo leads a choice's first text
            started.add(i)
            await sse.send(shape.chunk(i, echo + item.text, item.finish or None, item.ids))
            tokens += item.tokens if item.finish else 0
    return None, tokens


async def _body(request: web.Request, limits: HttpLimits) -> Any:
    try:
        return await read_json(request, limits)
    except BodyError as exc:
        error = BadRequest(exc.message, cause="body_too_large" if exc.status == 413 else
                           "body_timeout" if exc.status == 408 else "bad_request")  # fmt: skip
        error.status = exc.status
        raise error from None


def _sampling(params: GenParams) -> SamplingParams:
    return SamplingParams(
        params.max_tokens, params.min_tokens, params.stop_token_ids, params.ignore_eos
    )
