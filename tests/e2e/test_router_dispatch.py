"""The dispatcher against real HTTP servers standing in as nodes (aiohttp apps on loopback
sockets): a node at capacity (503, ``"busy": true``, ``Retry-After``; the contract of issue
35.6) gets the request tried on another node of its role, and the client a 429 with the
longest ``Retry-After`` once every candidate was busy; a request cancelled at its first await
leaves nothing behind on the nodes and no task exception unretrieved.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tspd_router.app import ROUTER, make_app
from tspd_router.config import RouterConfig
from tspd_router.openapi import openapi_document
from tspd_serving.openai.api import GenParams

from .test_router_failures import FakeNode, Handler, decode_lines, ok_prefill, piece

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 8}
DONE = decode_lines(piece([104, 105], "length"))  # "hi", after P's first token "h"


def busy(retry_after: str | None) -> Handler:
    """A node at capacity: refused before anything reaches its engine."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        headers = {} if retry_after is None else {"Retry-After": retry_after}
        answer = {"error": "node at capacity: 4 requests held of 4", "busy": True}
        return web.json_response(answer, status=503, headers=headers)

    return handler


async def hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class Served:
    url: str  #: the router's
    app: web.Application  #: the router's
    nodes: dict[str, list[str]]  #: each role's node URLs, in the order given


@asynccontextmanager
async def serving(nodes: dict[str, list[FakeNode]], **cfg: Any) -> AsyncIterator[Served]:
    """The nodes and a router in front of them (PD or colocated by the roles given)."""
    runners: list[web.AppRunner] = []
    urls: dict[str, list[str]] = {}
    for role, group in nodes.items():
        urls[role] = []
        for node in group:
            runner = web.AppRunner(node.app(), shutdown_timeout=0.2)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            urls[role].append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    config = RouterConfig(prefill=tuple(urls.get("prefill", ())),
                          decode=tuple(urls.get("decode", ())),
                          colocated=tuple(urls.get("colocated", ())), model="tiny",
                          health_interval_s=0.05, **cfg)  # fmt: skip
    app = make_app(config)
    router = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.2)
    await router.setup()
    await web.TCPSite(router, "127.0.0.1", 0).start()
    try:
        yield Served(f"http://127.0.0.1:{router.addresses[0][1]}", app, urls)
    finally:
        await router.cleanup()
        for runner in runners:
            await runner.cleanup()


async def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        text = await r.text()
        payload = json.loads(text) if r.content_type == "application/json" else text
        return r.status, dict(r.headers), payload


async def _metrics(url: str) -> list[str]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        return (await r.text()).splitlines()


def _sse_text(text: str) -> str:
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events)


@pytest.mark.parametrize("stream", [False, True])
def test_a_busy_prefill_node_s_request_goes_to_the_next_one(stream: bool) -> None:
    async def scenario() -> None:
        p0, p1 = FakeNode("prefill", busy("3")), FakeNode("prefill", ok_prefill)
        d = FakeNode("decode", DONE)
        async with serving({"prefill": [p0, p1], "decode": [d]}) as served:
            url = served.url
            status, _, body = await _post(url, BODY | {"stream": stream})
            assert status == 200
            assert (_sse_text(body) if stream else body["choices"][0]["text"]) == "hi"
            # One attempt each on P0 (refused) and P1; D got both, each with its own rid and
            # room, and the first one aborted on both nodes.
            assert [len(p0.bodies), len(p1.bodies), len(d.bodies)] == [1, 1, 2]
            first, second = d.bodies
            assert p0.bodies[0]["rid"] == first["rid"]
            assert p1.bodies[0]["rid"] == second["rid"] == first["rid"] + "~1"
            assert first["pd"]["room"] != second["pd"]["room"]
            await asyncio.wait_for(asyncio.gather(p0.abort_seen.wait(), d.abort_seen.wait()), 5)
            assert p0.aborted == [first["rid"]]
            assert first["rid"] in d.aborted
            # P's abort names the room (a P that refused the request fails it: D may hold
            # pages for it); D's does not.
            assert p0.abort_bodies == [{"rid": first["rid"], "room": first["pd"]["room"]}]
            assert {"rid": first["rid"]} in d.abort_bodies
            assert all(set(body) == {"rid"} for body in d.abort_bodies)
            lines = await _metrics(url)
            assert 'tspd_router_busy_refusals_total{role="prefill"} 1' in lines
            assert not any(line.startswith("tspd_router_errors_total{") for line in lines)

    asyncio.run(scenario())


def test_a_busy_decode_node_s_request_goes_to_the_next_one() -> None:
    async def scenario() -> None:
        p = FakeNode("prefill", ok_prefill)
        d0, d1 = FakeNode("decode", busy("2")), FakeNode("decode", DONE)
        async with serving({"prefill": [p], "decode": [d0, d1]}) as served:
            url = served.url
            status, _, body = await _post(url, BODY)
            assert (status, body["choices"][0]["text"]) == (200, "hi")
            assert [len(p.bodies), len(d0.bodies), len(d1.bodies)] == [2, 1, 1]
            assert [b["rid"] for b in p.bodies] == [d0.bodies[0]["rid"], d1.bodies[0]["rid"]]
            await asyncio.wait_for(p.abort_seen.wait(), 5)
            assert p.aborted == [d0.bodies[0]["rid"]]  # the first attempt's P half
            assert 'tspd_router_busy_refusals_total{role="decode"} 1' in await _metrics(url)

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_every_node_busy_is_a_429_with_the_longest_retry_after(stream: bool) -> None:
    async def scenario() -> None:
        p0, p1 = FakeNode("prefill", busy("3")), FakeNode("prefill", busy("7"))
        d = FakeNode("decode", DONE)
        async with serving({"prefill": [p0, p1], "decode": [d]}) as served:
            url = served.url
            status, headers, body = await _post(url, BODY | {"stream": stream})
            assert (status, headers["Retry-After"]) == (429, "7")
            p0_url, p1_url = served.nodes["prefill"]
            reason = "is busy: node at capacity: 4 requests held of 4"
            assert body["error"] == {
                "message": "every node that could serve the request is busy (prefill node "
                f"{p0_url} {reason}; prefill node {p1_url} {reason})",
                "type": "overloaded",
                "param": None,
                "code": "overloaded",
            }
            assert [len(p0.bodies), len(p1.bodies), len(d.bodies)] == [1, 1, 2]
            lines = await _metrics(url)
            assert 'tspd_router_errors_total{cause="overloaded"} 1' in lines
            assert 'tspd_router_busy_refusals_total{role="prefill"} 2' in lines
            assert 'tspd_router_requests_total{endpoint="completions",status="429"} 1' in lines

    asyncio.run(scenario())


@pytest.mark.parametrize(("given", "passed_on"), [(None, "1"), ("0", "1"), ("soon", "1"),
                                                  ("86400", "60")])  # fmt: skip
def test_a_nodes_retry_after_is_passed_on_within_bounds(given: str | None, passed_on: str) -> None:
    async def scenario() -> None:
        nodes = {"colocated": [FakeNode("colocated", busy(given))]}
        async with serving(nodes) as served:
            url = served.url
            status, headers, body = await _post(url, BODY)
            assert (status, headers["Retry-After"], body["error"]["code"]) == (
                429,
                passed_on,
                "overloaded",
            )

    asyncio.run(scenario())


def test_a_busy_colocated_node_s_request_goes_to_the_next_one() -> None:
    async def scenario() -> None:
        c0 = FakeNode("colocated", busy("1"))
        c1 = FakeNode("colocated", decode_lines(piece([104, 105], "length")))
        async with serving({"colocated": [c0, c1]}) as served:
            url = served.url
            status, _, body = await _post(url, BODY)
            assert (status, body["choices"][0]["text"]) == (200, "hi")
            assert [len(c0.bodies), len(c1.bodies)] == [1, 1]

    asyncio.run(scenario())


def test_a_503_that_is_not_busy_still_fails_the_request() -> None:
    async def failed(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": "the engine died"}, status=503)

    async def scenario() -> None:
        p0, p1 = FakeNode("prefill", failed), FakeNode("prefill", ok_prefill)
        async with serving({"prefill": [p0, p1], "decode": [FakeNode("decode", DONE)]}) as served:
            url = served.url
            status, headers, body = await _post(url, BODY)
            assert (status, body["error"]["code"]) == (502, "prefill_failed")
            assert "Retry-After" not in headers
            assert p1.bodies == []  # a failed node is the health checks' business, not a retry

    asyncio.run(scenario())


def test_a_request_cancelled_at_its_first_await_leaves_nothing_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 35.1 at its cause: the dispatcher awaited once after creating P's half and
    before the cleanup that cancels it; a client gone at that moment left P's half running
    (P's room held until --bootstrap-timeout) and its failure unretrieved."""

    async def scenario() -> None:
        p, d = FakeNode("prefill", hang), FakeNode("decode", hang)
        async with serving({"prefill": [p], "decode": [d]}) as served:
            app = served.app
            dispatcher = app[ROUTER].dispatcher
            pieces = dispatcher.generate("cut-short", (104, 105), GenParams(8))
            first = asyncio.ensure_future(anext(pieces))
            await asyncio.sleep(0)  # one turn: it runs up to its first await (P's half exists)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            # P's half was cancelled before it was sent, or its node aborted; D too.
            await asyncio.wait_for(asyncio.gather(p.abort_seen.wait(), d.abort_seen.wait()), 5)
            assert p.aborted == ["cut-short"] == d.aborted
            await pieces.aclose()
            await dispatcher.close()
            pool = app[ROUTER].pool
            assert [n.in_flight for n in pool.all()] == [0, 0]
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_the_openapi_document_names_the_429_and_its_retry_after() -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        answer = openapi_document("tiny")["paths"][path]["post"]["responses"]["429"]
        assert answer["headers"]["Retry-After"]["schema"] == {"type": "integer", "minimum": 1}
        assert answer["content"]["application/json"]["schema"]["required"] == ["error"]
