"""The router where a new user first meets it: started before (or without) its nodes, and
called on paths it does not serve. Real sockets throughout: a node that is down is a port held
by a bound socket that does not listen (connections are refused, and no other process can
take the port meanwhile); the node that comes up is an HTTP double listening on that very
socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tspd_router.app import ROUTER, make_app
from tspd_router.config import RouterConfig

from .test_router_failures import FakeNode, decode_lines, ok_prefill, piece


@contextmanager
def _down_port() -> Iterator[socket.socket]:
    """A loopback socket bound to a port the OS picks, not listening: a node that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


def _port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (on the router's own loop) until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.01)


async def _call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body) as r:
        text = await r.text()
        return r.status, (json.loads(text) if r.content_type == "application/json" else text)


async def _router(cfg: RouterConfig) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(make_app(cfg), handler_cancellation=True, shutdown_timeout=0.2)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_nodes_down_at_start_give_503_with_the_reason_then_serve_once_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tspd_router.nodes")
    with _down_port() as p_sock, _down_port() as d_sock:
        p_url, d_url = (f"http://127.0.0.1:{_port(s)}" for s in (p_sock, d_sock))
        asyncio.run(_down_then_up(p_sock, d_sock))
    warned = [r.getMessage() for r in caplog.records if r.name == "tspd_router.nodes"]
    # Exactly one warning per node (its reason did not change while it was down).
    assert sorted(w.split(": Cannot connect to host")[0] for w in warned) == [
        f"decode node {d_url} is not available",
        f"prefill node {p_url} is not available",
    ]


async def _down_then_up(p_sock: socket.socket, d_sock: socket.socket) -> None:
    p_url, d_url = (f"http://127.0.0.1:{_port(s)}" for s in (p_sock, d_sock))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    cfg = RouterConfig(prefill=(p_url,), decode=(d_url,), health_interval_s=0.05)
    runner, url = await _router(cfg)
    pool = runner.app[ROUTER].pool
    try:
        # No node ever answered, so no model name is known: the request must fail on the
        # missing node (503), not on the model's name (404).
        status, got = await _call(url, "POST", "/v1/completions", body)
        assert status == 503
        assert got["error"]["code"] == "no_prefill_node"
        assert got["error"]["message"].startswith(
            f"no healthy prefill node ({p_url}: Cannot connect to host 127.0.0.1:{_port(p_sock)}"
        )
        assert await _call(url, "GET", "/v1/models") == (200, {"object": "list", "data": []})
        # Several failed health rounds on each node: still one warning per node.
        await _until(lambda: all(n.failures >= 4 for n in pool.all()), "4 failed checks each")
        d = FakeNode("decode", decode_lines(piece([104, 105], "length")))
        nodes = [FakeNode("prefill", ok_prefill), d]
        served = [web.AppRunner(n.app(), shutdown_timeout=0.2) for n in nodes]
        for node_runner, sock in zip(served, (p_sock, d_sock), strict=True):
            await node_runner.setup()
            await web.SockSite(node_runner, sock).start()  # listens on the held socket
        await _until(lambda: all(n.healthy for n in pool.all()), "both nodes found up")
        status, got = await _call(url, "POST", "/v1/completions", body)
        assert (status, got["choices"][0]["text"]) == (200, "hi")
        models = (await _call(url, "GET", "/v1/models"))[1]
        assert [m["id"] for m in models["data"]] == ["tiny"]  # the nodes' name
        for node_runner in served:
            await node_runner.cleanup()
    finally:
        await runner.cleanup()


def test_unknown_paths_and_methods_get_openai_error_bodies() -> None:
    async def scenario(down: socket.socket) -> None:
        cfg = RouterConfig(colocated=(f"http://127.0.0.1:{_port(down)}",), model="tiny")
        runner, url = await _router(cfg)
        try:
            served = ("this router serves POST /v1/completions, POST /v1/chat/completions, "
                      "GET /v1/models, GET /health, GET /metrics and "
                      "GET /openapi.json")  # fmt: skip
            status, got = await _call(url, "POST", "/v1/embeddings", {"input": "x"})
            assert (status, got) == (404, {"error": {
                "message": f"no route POST /v1/embeddings here; {served}",
                "type": "invalid_request_error", "param": None, "code": "not_found"}})  # fmt: skip
            status, got = await _call(url, "GET", "/v1/completions")
            assert (status, got["error"]["code"]) == (405, "method_not_allowed")
            assert got["error"]["message"] == f"no method GET /v1/completions here; {served}"
            status, got = await _call(url, "POST", "/v1/completions", {"model": "gpt-4o"})
            assert (status, got["error"]["code"]) == (404, "model_not_found")
            assert got["error"]["message"] == (
                "the model 'gpt-4o' does not exist here; the served model is 'tiny'"
            )
        finally:
            await runner.cleanup()

    with _down_port() as down:  # the node never comes up
        asyncio.run(scenario(down))
