"""SGLang-speaking node doubles for the router's SGLang mode (``--node-api sglang``): they
answer as SGLang's or TokenSpeed's nodes do (an empty 200 ``/health``, ``/server_info``, SSE
streams) and record every ``/generate`` body, which tests/interop hands to TokenSpeed's own
``GenerateReqInput``. Shared by tests/e2e/test_router_sglang.py and
tests/interop/test_sglang_bodies.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tspd_router.app import make_app
from tspd_router.config import NodeApi, RouterConfig

#: What the decode double generates after P's first token (P's token is FIRST).
FIRST = 104
REST = (105, 33, 32, 116)
BOOTSTRAP_PORT = 9123


@dataclass
class SglangNode:
    """A prefill or decode double. ``cumulative``: stream events carry every id so far
    (SGLang's default) instead of the new ones (TokenSpeed's); ``legacy``: ``/server_info``
    is a 404, ``/get_server_info`` answers (SGLang before 0.5)."""

    role: str
    cumulative: bool = False
    legacy: bool = False
    events: Sequence[dict[str, Any]] | None = None  #: a scripted stream instead of REST
    status: int = 200  #: of /generate, with ``error`` as its body when not 200
    error: dict[str, Any] = field(default_factory=dict)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        info = "/get_server_info" if self.legacy else "/server_info"
        app.router.add_get(info, self._server_info)
        app.router.add_post("/generate", self._generate)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # SGLang's: no body

    async def _server_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"model_path": "tiny", "disaggregation_mode": self.role,
                                "context_length": 4096}  # fmt: skip
        if self.role == "prefill":
            info["disaggregation_bootstrap_port"] = BOOTSTRAP_PORT
        return web.json_response(info)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response(self.error, status=self.status)
        if self.role == "prefill":
            return web.json_response(_event([FIRST], [FIRST], {"type": "length", "length": 1}))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in self.events if self.events is not None else self._stream(body):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        want = body["sampling_params"]["max_new_tokens"]
        ids = [FIRST, *REST][:want]
        out, seen = [], []
        for i, token in enumerate(ids):
            seen.append(token)
            last = i == len(ids) - 1
            finish = {"type": "length", "length": len(ids)} if last else None
            out.append(_event(list(seen) if self.cumulative else [token], seen, finish))
        return out


def _event(ids: list[int], seen: list[int], finish: dict[str, Any] | None) -> dict[str, Any]:
    meta = {"id": "x", "finish_reason": finish, "prompt_tokens": 3,
            "completion_tokens": len(seen), "cached_tokens": 0}  # fmt: skip
    return {"text": "", "output_ids": ids, "meta_info": meta}


@asynccontextmanager
async def sglang_cluster(p: SglangNode, d: SglangNode, **cfg: Any) -> AsyncIterator[str]:
    """The two doubles and a router in SGLang mode over them, all on this event loop; the
    router's URL once both nodes are healthy."""
    runners = []
    urls = []
    for node in (p, d):
        runner = web.AppRunner(node.app(), shutdown_timeout=0.2)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    config = RouterConfig(prefill=(urls[0],), decode=(urls[1],), node_api=NodeApi.SGLANG,
                          health_interval_s=0.05, **cfg)  # fmt: skip
    router = web.AppRunner(make_app(config), handler_cancellation=True, shutdown_timeout=0.2)
    await router.setup()
    await web.TCPSite(router, "127.0.0.1", 0).start()
    runners.append(router)
    try:
        yield f"http://127.0.0.1:{router.addresses[0][1]}"
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        await asyncio.sleep(0)
