"""The load generator's client (``tspd_launch.loadgen``) against a real HTTP server: an error
answer is reported with what it says, JSON or not (a proxy's plain-text 502 used to crash the
whole load with a JSON decoding error)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tspd_launch.loadgen import stream_completion


async def _ask(status: int, body: bytes, content_type: str) -> tuple[bool, str]:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=status, body=body, content_type=content_type)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            t = await stream_completion(session, url, {"prompt": "hi", "max_tokens": 2})
    finally:
        await runner.cleanup()
    return t.ok, t.error


def test_an_openai_error_is_reported_by_its_message() -> None:
    body = b'{"error": {"message": "the decode node is full", "type": "busy"}}'
    got = asyncio.run(_ask(503, body, "application/json"))
    assert got == (False, "503 the decode node is full")


def test_a_plain_text_error_is_reported_as_its_text() -> None:
    got = asyncio.run(_ask(502, b"Bad Gateway: upstream closed\n", "text/plain"))
    assert got == (False, "502 Bad Gateway: upstream closed")


def test_an_empty_error_body_still_names_the_status() -> None:
    assert asyncio.run(_ask(500, b"", "text/plain")) == (False, "500 ")
