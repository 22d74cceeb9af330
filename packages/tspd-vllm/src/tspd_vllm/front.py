"""A PD front for vLLM nodes with ``TspdConnector``: one OpenAI-compatible address in front
of vLLM prefill (P) and decode (D) instances.

Two flows, per deployment (``--flow``); in both the front picks the request's room:

* ``sequential`` (the default) — vLLM's ``kv_transfer_params`` flow, with P's first token
  kept: the request goes to P with ``max_tokens`` 1, ``stream`` off and
  ``{"do_remote_decode": true, "bootstrap_room": room}``; P's first token goes to the client
  at once (a streamed request's first event) and, appended to the prompt's token ids, to D's
  ``/v1/completions`` with P's ``kv_transfer_params`` and the rest of the budget; D's tokens
  follow, relayed in the client's shape (:mod:`.relay`). Greedy outputs equal a colocated
  vLLM's token for token.
* ``concurrent`` — tspd's rendezvous: the front sends both at once (P as above; D with P's
  bootstrap address, which ``--prefill URL@HOST:PORT`` names, and the room), so D's look-up
  and pre-allocation overlap P's prefill and P writes the moment it is done; D recomputes the
  last prompt token itself (as in vLLM's own PD), so a greedy output may leave a colocated
  one's at a near-tie. If P refuses the request, D's request is cancelled (vLLM aborts it;
  tspd ends the room).

A room P may hold that D did not pull to the end — the client went away (its handler is
cancelled, whether P had answered yet or not), D refused or failed, or P's first token ended
the request so D was never asked — is given up on P at once: the front sends P a one-token
request naming it (``abort_room``, :mod:`.params`), and P fails the room and frees its
blocks, instead of holding them until its bootstrap timeout (120 s). TokenSpeed's wire has
no D → P abort; the front is the one that knows.

P and D instances are taken in turn (round robin). An upstream's error (status and body) is
the client's answer; a P answer without ``kv_transfer_params`` is a 502. One event loop
owns everything (aiohttp's); no state is shared across requests but the turn counters and
the room aborts in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp
from aiohttp import web

from tspd_core.ids import MAX_ROOM
from tspd_vllm import relay
from tspd_vllm.errors import SettingsError
from tspd_vllm.params import Rendezvous

log = logging.getLogger(__name__)

PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 4 << 20  #: bytes of one request body


class Flow(StrEnum):
    SEQUENTIAL = "sequential"
    CONCURRENT = "concurrent"


@dataclass(frozen=True, slots=True)
class Prefill:
    """A P instance: its URL and (for the concurrent flow) its bootstrap server."""

    url: str
    bootstrap: tuple[str, int] | None = None

    @classmethod
    def parse(cls, spec: str) -> Prefill:
        """``URL`` or ``URL@HOST:PORT``."""
        url, _, boot = spec.partition("@")
        if not url.startswith(("http://", "https://")):
            raise SettingsError(f"--prefill {spec!r}: expected http(s)://host:port[@HOST:PORT]")
        if not boot:
            return cls(url.rstrip("/"))
        host, _, port = boot.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise SettingsError(f"--prefill {spec!r}: the bootstrap address is not HOST:PORT")
        return cls(url.rstrip("/"), (host, int(port)))


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


def prefill_body(body: dict[str, Any], room: int | None) -> dict[str, Any]:
    """P's copy of a request: one token, not streamed, its KV to go to a D."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    params: dict[str, object] = {"do_remote_decode": True}
    if room is not None:
        params["bootstrap_room"] = room
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params=params)
    return out


@dataclass(slots=True)
class _Held:
    """One request's room on P: ``settled`` once P holds nothing for it (P refused, or
    answered no hand-over) or D answered to the end (D pulled the KV, or the room failed).
    A room not settled when the request ends is given up on P (``Front._give_up``)."""

    room: int
    settled: bool = False


class Front:
    """The front's handlers (see the module docstring)."""

    def __init__(self, prefills: list[Prefill], decodes: list[str], flow: Flow) -> None:
        if not prefills or not decodes:
            raise SettingsError("a front needs at least one prefill and one decode instance")
        if flow == Flow.CONCURRENT and any(p.bootstrap is None for p in prefills):
            raise SettingsError("the concurrent flow needs every --prefill as URL@HOST:PORT")
        self.flow = flow
        self._prefills = itertools.cycle(prefills)
        self._decodes = itertools.cycle([d.rstrip("/") for d in decodes])
        self._session: aiohttp.ClientSession | None = None
        self._aborts: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        for path in PATHS:
            app.router.add_post(path, self._handler(path))
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        del app
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def _close(self, app: web.Application) -> None:
        del app
        if self._aborts:
            await asyncio.wait(self._aborts, timeout=5)
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the front's app has not started"
        return self._session

    def _give_up(self, p: Prefill, room: int, model: object) -> None:
        """P may hold the KV of ``room`` and no D pulled it: have P fail the room now (P
        remembers a room it does not know yet as failed). A task of its own, so that a
        cancelled handler (the client went away) still sends it."""
        task = asyncio.get_running_loop().create_task(self._abort_room(p, room, model))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_room(self, p: Prefill, room: int, model: object) -> None:
        body = {"model": model, "prompt": [0], "max_tokens": 1,
                "kv_transfer_params": {"abort_room": room}}  # fmt: skip
        try:
            async with self.session.post(f"{p.url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    why = (await resp.text())[:500]
                    log.warning("room %d: %s refused the abort (%d): %s", room, p.url,
                                resp.status, why)  # fmt: skip
                    return
                await resp.read()
        except aiohttp.ClientError as exc:
            log.warning("room %d: abort not delivered to %s: %s", room, p.url, exc)

    async def _health(self, request: web.Request) -> web.Response:
        del request
        return web.Response(text="OK")

    async def _models(self, request: web.Request) -> web.Response:
        del request
        async with self.session.get(f"{next(self._decodes)}/v1/models") as resp:
            return web.Response(
                body=await resp.read(), status=resp.status, content_type="application/json"
            )

    def _handler(self, path: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                body = json.loads(await request.read())
            except (ValueError, UnicodeDecodeError) as exc:
                return _error(400, f"the body is not JSON: {exc}")
            if not isinstance(body, dict):
                return _error(400, "the body must be a JSON object")
            if body.get("n", 1) != 1:
                return _error(400, "n must be 1 (one sequence per PD request)")
            return await self._serve(request, path, body)

        return handle

    async def _serve(
        self, request: web.Request, path: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        p, d = next(self._prefills), next(self._decodes)
        held = _Held(secrets.randbelow(MAX_ROOM + 1))
        try:
            if self.flow == Flow.CONCURRENT:
                assert p.bootstrap is not None
                meet = Rendezvous(p.bootstrap[0], p.bootstrap[1], held.room)
                p_body = prefill_body(body, held.room)
                prefill = asyncio.ensure_future(self._prefill(p, path, p_body))
                d_body = dict(body, kv_transfer_params=meet.as_params())
                return await self._decode(request, d, path, d_body, prefill, held)
            return await self._sequential(request, p, d, path, body, held)
        finally:
            if not held.settled:
                self._give_up(p, held.room, body.get("model"))

    async def _sequential(
        self,
        request: web.Request,
        p: Prefill,
        d: str,
        path: str,
        body: dict[str, Any],
        held: _Held,
    ) -> web.StreamResponse:
        """P's first token to the client at once and into D's prompt (:mod:`.relay`)."""
        chat = path.endswith("/chat/completions")
        p_body = prefill_body(body, held.room) | {"return_token_ids": True}
        answer = await self._prefill_answer(p, path, p_body)
        if isinstance(answer, web.Response):
            held.settled = True  # P refused: it holds nothing
            return answer
        first = relay.first_token(answer, chat)
        prompt = relay.prompt_ids(answer)
        params = answer.get("kv_transfer_params")
        held.settled = not params  # P hands nothing over
        if first is None or prompt is None:
            return _error(502, f"prefill instance {p.url} answered no token", "upstream_error")
        token, text, finish = first
        budget = relay.max_new(body)
        ids = bool(body.get("return_token_ids"))
        stream = bool(body.get("stream"))
        done = finish == "stop" or (budget is not None and budget <= 1) or not params
        if done and not stream:
            return web.json_response(relay.p_only_answer(chat, answer))
        d_body = relay.decode_body(body, body.get("model"), [*prompt, token], budget, params)
        if not stream:
            merged, held.settled = await self._merged(d, d_body, chat, (token, text),
                                                      len(prompt), ids)  # fmt: skip
            return merged
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        head = relay.first_chunk(chat, (token, text), body.get("model"), str(answer.get("id")),
                                 ids, finish if done else None)  # fmt: skip
        await _event(out, head)
        if not done:
            held.settled = await self._relay_stream(out, d, d_body, chat, len(prompt))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _merged(
        self,
        d: str,
        d_body: dict[str, Any],
        chat: bool,
        first: tuple[int, str],
        prompt_len: int,
        ids: bool,
    ) -> tuple[web.Response, bool]:
        """The client's answer, and whether D answered it whole."""
        try:
            async with self.session.post(f"{d}/v1/completions", json=d_body) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    error = web.Response(body=raw, status=resp.status,
                                         content_type="application/json")  # fmt: skip
                    return error, False
                d_answer = json.loads(raw)
        except (aiohttp.ClientError, ValueError) as exc:
            return _error(502, f"decode instance {d}: {exc}", "upstream_error"), False
        merged = relay.merged_answer(chat, d_answer, first, prompt_len, ids)
        return web.json_response(merged), True

    async def _relay_stream(
        self, out: web.StreamResponse, d: str, d_body: dict[str, Any], chat: bool, prompt_len: int
    ) -> bool:
        """D's stream events, converted; an error mid-stream ends it with an error event.
        True when D's stream ran to its end."""
        try:
            async with self.session.post(f"{d}/v1/completions", json=d_body) as resp:
                if resp.status != 200:
                    await _event(out, {"error": {"message": (await resp.text())[:2000],
                                                 "code": resp.status}})  # fmt: skip
                    return False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[len(b"data: ") :])
                    await _event(out, relay.relay_chunk(chat, chunk, prompt_len))
                return True
        except (aiohttp.ClientError, ValueError) as exc:
            await _event(out, {"error": {"message": f"decode instance {d}: {exc}", "code": 502}})
            return False

    async def _prefill_answer(
        self, p: Prefill, path: str, body: dict[str, Any]
    ) -> dict[str, Any] | web.Response:
        """P's whole answer, or the error response for the client."""
        try:
            async with self.session.post(f"{p.url}{path}", json=body) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return web.Response(
                        body=raw, status=resp.status, content_type="application/json"
                    )
            answer = json.loads(raw)
        except aiohttp.ClientError as exc:
            return _error(502, f"prefill instance {p.url}: {exc}", "upstream_error")
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            return _error(
                502, f"prefill instance {p.url} answered no JSON object", "upstream_error"
            )
        return answer

    async def _prefill(
        self, p: Prefill, path: str, body: dict[str, Any]
    ) -> dict[str, Any] | web.Response:
        """P's ``kv_transfer_params``, or the error response for the client."""
        answer = await self._prefill_answer(p, path, body)
        if isinstance(answer, web.Response):
            return answer
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            why = f"prefill instance {p.url} answered no kv_transfer_params"
            return _error(502, why, "upstream_error")
        return params

    async def _decode(
        self,
        request: web.Request,
        d: str,
        path: str,
        body: dict[str, Any],
        prefill: asyncio.Future[dict[str, Any] | web.Response],
        held: _Held,
    ) -> web.StreamResponse:
        """D's answer relayed to the client (a P that refused cancels it)."""
        decode = asyncio.ensure_future(self.session.post(f"{d}{path}", json=body))
        resp = None
        try:
            answer = await prefill
            if isinstance(answer, web.Response):
                held.settled = True  # P refused: it holds nothing
                return answer
            resp = await decode
        except aiohttp.ClientError as exc:
            return _error(502, f"decode instance {d}: {exc}", "upstream_error")
        finally:
            if resp is None:
                _drop(decode)  # closing D's connection aborts the request there
        async with resp:
            if resp.status != 200 or not body.get("stream"):
                raw = await resp.read()
                held.settled = resp.status == 200
                return web.Response(body=raw, status=resp.status, content_type=resp.content_type)
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            held.settled = True
            await out.write_eof()
            return out


def _drop(decode: asyncio.Future[aiohttp.ClientResponse]) -> None:
    """Give D's request up: cancel it, or close its answer if it came already."""
    if not decode.done():
        decode.cancel()
    elif not decode.cancelled() and decode.exception() is None:
        decode.result().close()


async def _event(out: web.StreamResponse, payload: dict[str, Any]) -> None:
    await out.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def serve(front: Front, host: str, port: int, ready: Callable[[int], None]) -> None:
    """Serve until cancelled; ``ready`` gets the bound port."""
    # A client that goes away cancels its handler: D's request is closed (vLLM aborts it)
    # and a room P holds is given up at once (Front._give_up).
    runner = web.AppRunner(front.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # the bound port, also when port is 0
    assert server is not None
    sockets = getattr(server, "sockets", None) or []
    ready(sockets[0].getsockname()[1] if sockets else port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
