"""The router's failure paths against scripted node doubles, exactly: what the client gets
(status, OpenAI error body, SSE events) and which aborts reach the nodes.

These doubles script failures that real nodes produce only by chance of timing; the same
paths run against real nodes in test_openai_local.py and test_kill_prefill.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tspd_router.app import make_app
from tspd_router.config import RouterConfig

Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


class FakeNode:
    """A node double: healthy on demand, scripted /generate, records aborts."""

    def __init__(self, role: str, generate: Handler) -> None:
        self.role = role
        self.generate = generate
        self.healthy = True
        self.aborted: list[str] = []
        self.abort_bodies: list[dict[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []
        self.generate_seen = asyncio.Event()
        self.abort_seen = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/info", self._info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort", self._abort)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if self.healthy else "down"},
                                 status=200 if self.healthy else 503)  # fmt: skip

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "model": "tiny", "bootstrap": "10.1.1.1:77"})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.generate_seen.set()
        return await self.generate(request, body)

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.abort_bodies.append(body)
        self.aborted.append(body["rid"])
        self.abort_seen.set()
        return web.json_response({"aborted": True})


def prefill_answer(*first: object) -> Handler:
    """A prefill node that answers at once with ``first`` as its output ids (a real one
    answers with the one token it sampled, which D's stream then starts with)."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        answer = {"rid": body["rid"], "output_ids": list(first), "finish_reason": "length"}
        return web.json_response(answer)

    return handler


ok_prefill = prefill_answer(104)  # "h": the decode doubles below start with it


def decode_lines(*lines: dict[str, Any], hang: bool = False, cut: bool = False) -> Handler:
    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for line in lines:
            await resp.write((json.dumps(line) + "\n").encode())
        if cut:
            request.transport.close()  # type: ignore[union-attr]  # the node dies mid-stream
            return resp
        if hang:
            await asyncio.sleep(3600)
        return resp

    return handler


def piece(ids: list[int], finish: str | None = None, error: str = "") -> dict[str, Any]:
    line: dict[str, Any] = {"rid": "x", "output_ids": ids}
    if finish:
        line["finish_reason"] = finish
    if error:
        line["error"] = error
    return line


@asynccontextmanager
async def cluster(p: FakeNode, d: FakeNode, early: bool = True) -> AsyncIterator[str]:
    runners = []
    urls = []
    for node in (p, d):
        runner = web.AppRunner(node.app(), shutdown_timeout=0.2)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    cfg = RouterConfig(prefill=(urls[0],), decode=(urls[1],), model="tiny",
                       health_interval_s=0.05, health_failures=2,
                       early_first_token=early)  # fmt: skip
    router = web.AppRunner(make_app(cfg), handler_cancellation=True, shutdown_timeout=0.2)
    await router.setup()
    await web.TCPSite(router, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{router.addresses[0][1]}"
    finally:
        await router.cleanup()
        for runner in runners:
            await runner.cleanup()


BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 8}


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        text = await r.text()
        return r.status, (json.loads(text) if r.content_type == "application/json" else text)


async def _metric(url: str, sample: str) -> bool:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        return sample in (await r.text()).splitlines()


def test_prefill_refusal_is_a_400_and_aborts_decode() -> None:
    async def refuse(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": "prompt of 9000 tokens leaves no room"}, status=400)

    async def scenario() -> None:
        p, d = FakeNode("prefill", refuse), FakeNode("decode", decode_lines(hang=True))
        async with cluster(p, d) as url:
            status, body = await _post(url, BODY)
            assert status == 400
            assert body["error"] == {
                "message": "the prefill node refused the request: prompt of 9000 tokens "
                "leaves no room",
                "type": "invalid_request_error", "param": None, "code": "refused",
            }  # fmt: skip
            await asyncio.wait_for(d.abort_seen.wait(), 5)
            rid = p.bodies[0]["rid"]
            assert d.aborted == [rid] == [d.bodies[0]["rid"]]
            pd = p.bodies[0]["pd"]
            assert pd == d.bodies[0]["pd"]  # the same room and bootstrap to both halves
            assert (pd["bootstrap_host"], pd["bootstrap_port"]) == ("10.1.1.1", 77)
            assert 0 <= pd["room"] < 2**63
            assert await _metric(url, 'tspd_router_errors_total{cause="refused"} 1')

    asyncio.run(scenario())


def test_transfer_failure_holding_the_first_token_is_a_502_plain_and_streamed() -> None:
    failed = piece([], "transfer", "KV transfer failed: P rank 0 aborted the transfer")

    async def scenario() -> None:
        p, d = FakeNode("prefill", ok_prefill), FakeNode("decode", decode_lines(failed))
        async with cluster(p, d, early=False) as url:
            for stream in (False, True):
                status, body = await _post(url, BODY | {"stream": stream})
                assert status == 502  # a stream fails before its first token: a real status
                assert body["error"]["code"] == "transfer_failed"
                assert body["error"]["message"] == failed["error"]
            assert await _metric(url, 'tspd_router_errors_total{cause="transfer_failed"} 2')
            assert await _metric(
                url, 'tspd_router_requests_total{endpoint="completions",status="502"} 2'
            )

    asyncio.run(scenario())


def test_transfer_failure_after_p_s_first_token_is_a_502_or_the_stream_s_last_event() -> None:
    # P's first token went on at once (the default): a plain request still fails with a
    # status, a stream has begun with that token and ends with the error as an SSE event.
    failed = piece([], "transfer", "KV transfer failed: P rank 0 aborted the transfer")

    async def scenario() -> None:
        p, d = FakeNode("prefill", ok_prefill), FakeNode("decode", decode_lines(failed))
        async with cluster(p, d) as url:
            status, body = await _post(url, BODY)
            assert (status, body["error"]["code"]) == (502, "transfer_failed")
            status, text = await _post(url, BODY | {"stream": True})
            assert status == 200
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: ")]
            assert [e["choices"][0]["text"] for e in events[:-1]] == ["h"]
            assert events[-1]["error"] == {
                "message": failed["error"], "type": "server_error", "param": None,
                "code": "transfer_failed",
            }  # fmt: skip
            assert "[DONE]" not in text
            assert await _metric(url, 'tspd_router_errors_total{cause="transfer_failed"} 2')
            await asyncio.wait_for(asyncio.gather(p.abort_seen.wait(), d.abort_seen.wait()), 5)

    asyncio.run(scenario())


def test_p_s_first_token_goes_on_before_d_s_and_d_s_stream_continues_after_it() -> None:
    # D's stream holds its first line until P's answer was passed on: the client's first
    # event is P's token alone, then D's tokens without the repeated first one.
    released = asyncio.Event()

    async def decode(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await released.wait()
        for line in (piece([104, 105]), piece([33], "length")):
            await resp.write((json.dumps(line) + "\n").encode())
        return resp

    async def scenario() -> None:
        d = FakeNode("decode", decode)
        async with (
            cluster(FakeNode("prefill", ok_prefill), d) as url,
            aiohttp.ClientSession() as s,
            s.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as r,
        ):
            assert r.status == 200
            first = json.loads((await r.content.readline()).decode()[6:])
            assert first["choices"][0]["text"] == "h"  # before D sent anything
            released.set()
            rest = (await r.read()).decode()
        events = [json.loads(e[6:]) for e in rest.splitlines() if e.startswith("data: {")]
        assert [e["choices"][0]["text"] for e in events] == ["i", "!"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert rest.rstrip().endswith("data: [DONE]")

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("answer", "code"),
    [((105,), "decode_failed"), ((), None), ((104, 105), None), (("h",), None), ((-1,), None)],
)
def test_p_s_answer_is_checked_against_d_s_first_token(
    answer: tuple[object, ...], code: str | None
) -> None:
    # A P token D's stream does not start with fails the request (no token is sent twice or
    # lost); an answer that names no single token id passes nothing on early: D's stream
    # carries the whole text, as with the token held.
    async def scenario() -> None:
        d = FakeNode("decode", decode_lines(piece([104, 105], "length")))
        async with cluster(FakeNode("prefill", prefill_answer(*answer)), d) as url:
            status, text = await _post(url, BODY | {"stream": True})
            assert status == 200
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            if code is None:
                assert "".join(e["choices"][0]["text"] for e in events) == "hi"
                assert events[-1]["choices"][0]["finish_reason"] == "length"
            else:
                assert [e["choices"][0]["text"] for e in events[:-1]] == ["i"]
                assert events[-1]["error"]["code"] == code
                assert events[-1]["error"]["message"].endswith(
                    "began with token 104, but the prefill node sampled 105"
                )

    asyncio.run(scenario())


def test_a_stream_broken_after_its_first_token_ends_with_an_sse_error() -> None:
    async def scenario() -> None:
        d = FakeNode("decode", decode_lines(piece([104, 105]), cut=True))
        async with cluster(FakeNode("prefill", ok_prefill), d) as url:
            status, text = await _post(url, BODY | {"stream": True})
            assert status == 200
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: ")]
            assert [e["choices"][0]["text"] for e in events[:-1]] == ["h", "i"]  # P's, D's
            assert events[-1]["error"]["code"] == "decode_failed"
            assert "[DONE]" not in text

    asyncio.run(scenario())


def test_prefill_node_death_fails_requests_still_waiting_for_kv() -> None:
    async def hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def scenario() -> None:
        p, d = FakeNode("prefill", hang), FakeNode("decode", decode_lines(hang=True))
        async with cluster(p, d) as url:
            pending = asyncio.create_task(_post(url, BODY))
            # Both halves arrived: D waits for KV that P (hanging) never sends.
            await asyncio.wait_for(
                asyncio.gather(p.generate_seen.wait(), d.generate_seen.wait()), 5
            )
            assert not pending.done()
            p.healthy = False  # two failed checks (0.05 s apart) take it out
            status, body = await asyncio.wait_for(pending, 5)
            assert status == 502
            assert body["error"]["code"] == "prefill_node_down"
            await asyncio.wait_for(d.abort_seen.wait(), 5)
            status, body = await _post(url, BODY)  # no prefill node left
            assert (status, body["error"]["code"]) == (503, "no_prefill_node")

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_node_taken_out_mid_stream_fails_its_requests(stream: bool) -> None:
    # A decode host cut off the network: its first token came, then nothing (no reset, no
    # end). The health checks take it out; its requests end then, not at the request timeout.
    async def scenario() -> None:
        p = FakeNode("prefill", ok_prefill)
        d = FakeNode("decode", decode_lines(piece([104]), hang=True))
        async with cluster(p, d) as url:
            status, body = await _cut_after_the_first_token(url, stream, d)
            if stream:  # the stream had started: its error comes as its last event
                assert status == 200
                events = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: ")]
                assert [e["choices"][0]["text"] for e in events[:-1]] == ["h"]
                error = events[-1]["error"]
                assert "[DONE]" not in body
            else:
                assert status == 502
                error = body["error"]
            assert error["code"] == "decode_node_down"
            assert re.fullmatch(r"decode node http://127\.0\.0\.1:\d+ was taken out by the "
                                r"health checks: /health answered 503: None",
                                error["message"]), error  # fmt: skip
            await asyncio.wait_for(asyncio.gather(p.abort_seen.wait(), d.abort_seen.wait()), 5)
            assert await _metric(url, 'tspd_router_errors_total{cause="decode_node_down"} 1')

    asyncio.run(scenario())


async def _cut_after_the_first_token(url: str, stream: bool, d: FakeNode) -> tuple[int, Any]:
    """Post a request and take ``d`` out of the router once the first token came: once the
    client read the first event (streamed: the status went out with it), else once D has
    the request (a plain answer comes only at the end; it is a 502 either way)."""
    if not stream:
        pending = asyncio.create_task(_post(url, BODY))
        await asyncio.wait_for(d.generate_seen.wait(), 5)
        assert not pending.done()
        d.healthy = False
        return await asyncio.wait_for(pending, 5)
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                    json=BODY | {"stream": True}) as r:  # fmt: skip
        head = await asyncio.wait_for(r.content.readline(), 5)
        assert head.startswith(b"data: {"), head
        d.healthy = False
        return r.status, head.decode() + await asyncio.wait_for(r.text(), 5)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_node_taken_out_before_it_answered_fails_its_requests(stream: bool) -> None:
    # The request reached a decode host that then dropped off the network: no headers ever
    # come back. Taking the node out ends the request with a real status, stream or not.
    async def silent(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def scenario() -> None:
        p, d = FakeNode("prefill", ok_prefill), FakeNode("decode", silent)
        async with cluster(p, d) as url:
            pending = asyncio.create_task(_post(url, BODY | {"stream": stream}))
            await asyncio.wait_for(d.generate_seen.wait(), 5)
            assert not pending.done()
            d.healthy = False
            status, body = await asyncio.wait_for(pending, 5)
            assert (status, body["error"]["code"]) == (502, "decode_node_down")
            await asyncio.wait_for(asyncio.gather(p.abort_seen.wait(), d.abort_seen.wait()), 5)

    asyncio.run(scenario())


def test_stop_string_cuts_the_text_and_aborts_the_rest_on_decode() -> None:
    lines = [piece(list(b"ab")), piece(list(b"cEN")), piece(list(b"Dxyz"))]

    async def scenario() -> None:
        d = FakeNode("decode", decode_lines(*lines, hang=True))
        async with cluster(FakeNode("prefill", prefill_answer(ord("a"))), d) as url:
            status, body = await _post(url, BODY | {"stop": ["END"]})
            assert status == 200
            choice = body["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == ("abc", "stop")
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 9,
                                     "total_tokens": 12}  # fmt: skip
            await asyncio.wait_for(d.abort_seen.wait(), 5)

    asyncio.run(scenario())
