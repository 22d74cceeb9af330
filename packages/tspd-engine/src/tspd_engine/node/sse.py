"""Server-sent events as SGLang's and OpenAI's streams use them: ``data: {json}`` events,
``data: [DONE]`` at the end.

The response opens with its first event, so a request that fails before it (every PD
transfer failure: D's first token comes after the KV) gets a real error status; a failure
after it is a last ``data: {"error": ...}`` event without ``[DONE]`` (as the router's
streams end). Event loop only.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from aiohttp import web

from tspd_serving.openai.errors import ApiError


class Sse:
    """One SSE response; ``opening`` runs once, just before the first event is written (chat
    names each choice's role there)."""

    def __init__(
        self, request: web.Request, opening: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self._opening = opening

    async def send(self, payload: dict[str, Any]) -> None:
        if self.response is None:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.response.prepare(self.request)
            if self._opening is not None:
                await self._opening()
        await self.write(payload)

    async def write(self, payload: dict[str, Any]) -> None:
        assert self.response is not None
        await self.response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    async def done(self) -> web.StreamResponse:
        """``data: [DONE]``, the end of a stream that succeeded."""
        assert self.response is not None, "a stream that succeeded sent at least one event"
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

    async def fail(self, error: ApiError) -> web.StreamResponse:
        """The error as the answer's status (nothing sent yet) or as the last event."""
        if self.response is None:
            return web.json_response(error.body(), status=error.status, headers=error.headers())
        with suppress(ConnectionError):
            await self.write(error.body())
            await self.response.write_eof()
        return self.response
