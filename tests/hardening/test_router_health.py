"""The router and a node that stops answering (issue 18.5: a SIGSTOPped prefill node took
12.5 s to be taken out, the docs said ~2 s; a stopped decode node held its streams until the
request timeout). Node doubles over real sockets script the silence exactly: ``/health``
answers, then never again. The real processes, stopped and killed, are the fault suite's
(test_faults.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from tspd_router.app import ROUTER, make_app
from tspd_router.config import RouterConfig


class SilentNode:
    """A node double whose ``/health`` goes silent on demand (a stopped process)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.silent = asyncio.Event()
        self.streaming = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/info", self._info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort", self._abort)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        if self.silent.is_set():
            await asyncio.sleep(3600)
        return web.json_response({"status": "ok"})

    async def _info(self, request: web.Request) -> web.Response:
        boot = {"bootstrap": "127.0.0.1:9"} if self.role == "prefill" else {}
        return web.json_response({"role": self.role, "model": "tiny"} | boot)

    async def _abort(self, request: web.Request) -> web.Response:
        return web.json_response({"aborted": True})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.role == "prefill":
            return web.json_response({"rid": body["rid"], "output_ids": [104]})  # D's first
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(json.dumps({"rid": body["rid"], "output_ids": [104]}).encode() + b"\n")
        self.streaming.set()
        await asyncio.sleep(3600)  # the first token went out; then the node stops
        return resp


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_a_silent_decode_node_is_taken_out_and_its_stream_ends_with_an_error() -> None:
    async def scenario() -> None:
        p, d = SilentNode("prefill"), SilentNode("decode")
        (p_run, p_url), (d_run, d_url) = await _serve(p.app()), await _serve(d.app())
        cfg = RouterConfig(prefill=(p_url,), decode=(d_url,), model="tiny",
                           health_interval_s=0.2, health_failures=2,
                           health_timeout_s=0.3)  # fmt: skip
        app = make_app(cfg)
        r_run, r_url = await _serve(app)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}
        events: list[dict[str, Any]] = []
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{r_url}/v1/completions", json=body) as resp,
            ):
                assert resp.status == 200
                await d.streaming.wait()
                d.silent.set()  # from now on D answers nothing: a stopped process
                events += [json.loads(line[6:]) async for line in resp.content
                           if line.startswith(b"data: ")]  # fmt: skip
            node = app[ROUTER].pool.nodes["decode"][0]  # type: ignore[index]
            assert (node.healthy, node.last_error) == (
                False,
                "no answer to GET /health within 0.3 s",
            )
        finally:
            for runner in (r_run, p_run, d_run):
                await runner.cleanup()
        assert events[0]["choices"][0]["text"] == "h"
        error = events[-1]["error"]
        assert error["code"] == "decode_node_down"
        assert error["message"] == (
            f"decode node {d_url} was taken out by the health checks: "
            "no answer to GET /health within 0.3 s"
        )

    asyncio.run(asyncio.wait_for(scenario(), 60))


class ScriptedHealth(SilentNode):
    """A node double whose ``/health`` answers what the test sets, counting the checks."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.answer: tuple[int, dict[str, Any]] = (200, {"status": "ok"})
        self.checks = 0

    async def _health(self, request: web.Request) -> web.Response:
        self.checks += 1
        status, body = self.answer
        return web.json_response(body, status=status)


async def _until(check: Any, what: str) -> None:
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.05)
    assert check(), what


def test_a_busy_node_stays_in_and_only_a_failed_one_is_taken_out() -> None:
    # Issue 35.5/6: busy must never read as dead. A node's /health is its liveness; should
    # one answer 503 with "busy": true (the node at capacity), the router keeps it in; a
    # plain 503 (a stopped rank) takes it out.
    async def scenario() -> None:
        p, d = ScriptedHealth("prefill"), ScriptedHealth("decode")
        (p_run, p_url), (d_run, d_url) = await _serve(p.app()), await _serve(d.app())
        cfg = RouterConfig(prefill=(p_url,), decode=(d_url,), model="tiny",
                           health_interval_s=0.1, health_failures=1)  # fmt: skip
        app = make_app(cfg)
        r_run, _ = await _serve(app)
        node = app[ROUTER].pool.nodes["decode"][0]  # type: ignore[index]
        try:
            await _until(lambda: node.healthy, "the decode node up")
            busy = {"status": "busy", "busy": True, "error": "node at capacity: 8 of 8"}
            d.answer, seen = (503, busy), d.checks
            await _until(lambda: d.checks >= seen + 5, "five checks of the busy node")
            assert (node.healthy, node.failures, node.last_error) == (True, 0, "")
            stopped = {"status": "unhealthy", "error": "replica 0: rank 0 has not run for 6 s"}
            d.answer = (503, stopped)
            await _until(lambda: not node.healthy, "the failed node taken out")
            assert node.last_error == "/health answered 503: replica 0: rank 0 has not run for 6 s"
        finally:
            for runner in (r_run, p_run, d_run):
                await runner.cleanup()

    asyncio.run(asyncio.wait_for(scenario(), 60))
