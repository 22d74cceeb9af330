"""Sending one prompt to the nodes and following its tokens back.

PD (the life of a request, docs/ARCHITECTURE.md)::

    pick P, pick D, draw a 63-bit room ──► POST P /generate {ids, pd: room + P's bootstrap}
                                      └──► POST D /generate {ids, pd, stream: true}  (at once)
    follow D's NDJSON stream; until D's first token also watch:
        P's answer (a refusal or a failure fails the request) and P's health (``down``)
    P's answer carries the first token, sampled at the end of its forward: it goes on to the
    client at once (``RouterConfig.early_first_token``), and D's stream, which starts with
    the same token, is checked against it and continues after it.
    D's first token means the whole prompt's KV arrived (RemotePrefill): from then on only
    D matters. D's own health is watched to the last token: a D the health checks take out
    (a host cut off the network answers nothing, not even a reset) fails its streams with
    ``decode_node_down`` instead of leaving them to the request timeout.

Any failure aborts the request on both nodes (``POST /abort``; P's abort names the room too, so
a P that refused the request, or never read it, fails the room and D's pre-allocated pages come
back at once) and raises a
:class:`~tspd_router.errors.ApiError` with its cause; so does closing the generator early
(the client went away, a stop string matched). A failed transfer therefore reaches the client
as an error, never as a 200 with tokens decoded from KV that did not arrive: before any token
(with ``early_first_token`` off, always before D's first) as a real status, after P's first
token as a stream's last event. Colocated: one node, the same stream without P.

Cleanup: from the moment an attempt created anything (P's half as a task, D's request), every
await sits inside the ``finally`` that cancels it and sends the aborts, so a client that
leaves at any await (the first included) leaves nothing running on the nodes; nested
generators are closed explicitly (``aclosing``), and a waiter or task nobody reads any more
has its exception retrieved, so none is logged as "never retrieved".

Busy nodes (:mod:`tspd_router.refusals`): a node that refuses an attempt for being at capacity
(503, ``"busy": true``; nothing reached its engine) gets that attempt aborted on both nodes and
the request tried again, with a fresh rid and room, on a healthy node of its role the request
has not tried (the other role keeps its node); when none is left, a 429 with the longest
``Retry-After`` the nodes gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import aiohttp

from tspd_core import trace
from tspd_router import sglang
from tspd_router.config import NodeApi
from tspd_router.errors import ApiError, UpstreamFailed
from tspd_router.metrics import RouterMetrics
from tspd_router.nodes import NodePool, NodeState, Role
from tspd_router.refusals import NodeBusy, node_error, overloaded, refusal
from tspd_serving.openai.api import GenParams

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 5.0
#: Connection failures that mean the node itself is unreachable (not one bad request).
_DEAD = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


@dataclass(frozen=True, slots=True)
class Piece:
    """New tokens of one request; ``finish`` (the node's reason) on the last piece."""

    tokens: tuple[int, ...]
    finish: str | None = None
    cached_tokens: int = 0


Pieces = AsyncGenerator[Piece, None]


class Dispatcher:
    """Routes prompts to the pool's nodes (see the module docstring). Event loop only."""

    def __init__(
        self,
        pool: NodePool,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.session = session
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    async def generate(self, rid: str, prompt: tuple[int, ...], params: GenParams) -> Pieces:
        """The pieces of one prompt's generation; close it to abort the request."""
        body: dict[str, Any] = {
            "input_ids": list(prompt),
            "max_tokens": params.max_tokens,
            "min_tokens": params.min_tokens,
            "ignore_eos": params.ignore_eos,
            "stop_token_ids": list(params.stop_token_ids),
            "rid": rid,
        }
        roles = (Role.PREFILL, Role.DECODE) if self.pool.cfg.pd else (Role.COLOCATED,)
        async with aclosing(self._attempts(body, roles)) as pieces:
            async for piece in pieces:
                yield piece

    async def _attempts(self, body: dict[str, Any], roles: tuple[Role, ...]) -> Pieces:
        """Attempts of one request until one is not refused as busy (see :class:`NodeBusy`):
        a busy node's role gets another healthy node not tried yet, the other role keeps its
        node; each attempt has its own rid (an abort of the last one must not reach the
        next) and room. None left: :class:`Overloaded` (429)."""
        nodes = {role: self.pool.pick(role) for role in roles}
        tried: set[NodeState] = set(nodes.values())
        refusals: list[NodeBusy] = []
        for attempt in itertools.count():
            rid = body["rid"] if attempt == 0 else f"{body['rid']}~{attempt}"
            started = False
            try:
                async with aclosing(self._attempt(nodes, body | {"rid": rid})) as pieces:
                    async for piece in pieces:
                        started = True
                        yield piece
                return
            except NodeBusy as busy:
                if self.metrics is not None:
                    self.metrics.refused_busy(busy.node.role.value)
                refusals.append(busy)
                if started:  # a token went out already: too late to start over elsewhere
                    raise overloaded(refusals) from None
                nodes[busy.node.role] = self._untried(busy.node.role, tried, refusals)
                tried.add(nodes[busy.node.role])

    def _untried(self, role: Role, tried: set[NodeState], refusals: list[NodeBusy]) -> NodeState:
        """The least loaded healthy node of ``role`` this request has not tried."""
        left = [n for n in self.pool.nodes[role] if n.healthy and n not in tried]
        if not left:
            raise overloaded(refusals)
        return min(left, key=lambda n: n.in_flight)

    def _attempt(self, nodes: dict[Role, NodeState], body: dict[str, Any]) -> Pieces:
        if Role.COLOCATED in nodes:
            return self._colocated(nodes[Role.COLOCATED], body)
        return self._pd(nodes[Role.PREFILL], nodes[Role.DECODE], body)

    async def _colocated(self, node: NodeState, body: dict[str, Any]) -> Pieces:
        finished = False
        with node.track():
            try:
                async with aclosing(self._follow(node, body, None, None)) as pieces:
                    async for piece in pieces:
                        finished = piece.finish is not None
                        yield piece
            finally:
                if not finished:
                    self._abort([node], body["rid"])

    async def _pd(self, p: NodeState, d: NodeState, body: dict[str, Any]) -> Pieces:
        assert p.bootstrap is not None, "a healthy prefill node has its bootstrap address"
        host, port = p.bootstrap
        room = secrets.randbits(63)
        body = body | {"pd": {"room": room, "bootstrap_host": host, "bootstrap_port": port}}
        finished = False
        p_task: asyncio.Task[int | None] | None = None
        with p.track(), d.track():
            # Everything from the moment P's half exists sits inside the cleanup: a client
            # that leaves at any await here (even the first) must not leave P's room behind.
            try:
                p_task = asyncio.create_task(self._prefill(p, body))
                p_task.add_done_callback(_retrieve)
                if self.pool.cfg.early_first_token:
                    # P's request goes out first: the first token comes from P's forward, and
                    # D's registration has that forward's time to catch up.
                    await asyncio.sleep(0)
                async with aclosing(self._follow(d, body, p, p_task)) as pieces:
                    async for piece in pieces:
                        finished = piece.finish is not None
                        yield piece
            finally:
                if p_task is not None:
                    p_task.cancel()  # done already, or moot: a late P failure after D's tokens
                if not finished:
                    # P's abort names the room too: D may have pre-allocated it with P's
                    # ranks, and a P that refused the request, or never read it, fails the
                    # room by its number so D's pages come back now (docs/router.md).
                    self._abort([p], body["rid"], room)
                    self._abort([d], body["rid"])

    async def _prefill(self, p: NodeState, body: dict[str, Any]) -> int | None:
        """P's half; returns once P prefilled and handed the KV over, with the first token
        it sampled (None when its answer names no single token id); raises if it failed."""
        trace.mark(body["rid"], "router.p_post")
        try:
            async with self.session.post(f"{p.url}/generate", json=self._wire(body, False)) as resp:
                answer = self._native(await _answer(resp))
                if resp.status != 200:
                    raise refusal("prefill", p, resp, answer)
            trace.mark(body["rid"], "router.p_answer")
        except aiohttp.ClientError as exc:
            raise self._unreachable(p, "prefill", exc) from exc
        ids = answer.get("output_ids")
        if isinstance(ids, list) and len(ids) == 1 and type(ids[0]) is int and ids[0] >= 0:
            return ids[0]
        return None

    async def _follow(
        self,
        node: NodeState,
        body: dict[str, Any],
        p: NodeState | None,
        p_task: asyncio.Task[int | None] | None,
    ) -> Pieces:
        side = "decode" if p is not None else "colocated"
        trace.mark(body["rid"], "router.post")
        try:
            async with contextlib.AsyncExitStack() as stack:
                post = self.session.post(f"{node.url}/generate", json=self._wire(body, True))
                async with _until_down(node, side):
                    r = await stack.enter_async_context(post)
                if r.status != 200:
                    raise refusal(side, node, r, self._native(await _answer(r)))
                lines = self._lines(r, node, side, p, p_task, body["rid"])
                async for piece in await stack.enter_async_context(aclosing(lines)):
                    if piece.tokens:
                        trace.mark(body["rid"], "router.piece")
                    yield piece
        except aiohttp.ClientError as exc:
            raise self._unreachable(node, side, exc) from exc

    async def _lines(
        self,
        resp: aiohttp.ClientResponse,
        node: NodeState,
        side: str,
        p: NodeState | None,
        p_task: asyncio.Task[int | None] | None,
        rid: str,
    ) -> Pieces:
        """D's pieces; until its first token, P's failure or death fails the request, and
        the streaming node's own removal by the health checks fails it at any time (a
        stopped node would otherwise hold the stream until the request timeout). P's first
        token, when it comes before D's, is the first piece (see the module docstring)."""
        waiting_kv = p is not None
        early: int | None = None  # P's first token, passed on: D's stream must start with it
        seen = 0  # the ids read so far (an SGLang stream's events may repeat them)
        line = asyncio.ensure_future(self._next_line(resp))
        down = asyncio.ensure_future(p.down.wait() if p is not None else asyncio.Future())
        gone = asyncio.ensure_future(node.down.wait())
        try:
            while True:
                waits: set[asyncio.Future[Any]] = {line, gone}
                if waiting_kv:
                    waits.add(down)
                    if p_task is not None:
                        waits.add(p_task)  # done already when P answered before D's headers
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if waiting_kv and p_task is not None and p_task in done:
                    first = p_task.result()  # raises when P refused or failed the request
                    p_task = None  # P succeeded: from now on only D's tokens and health
                    if first is not None and self.pool.cfg.early_first_token:
                        early = first
                        trace.mark(rid, "router.early")
                        yield Piece((first,))
                if waiting_kv and down in done:
                    assert p is not None
                    raise UpstreamFailed(
                        f"prefill node {p.url} went down before the KV arrived: {p.last_error}",
                        "prefill_node_down",
                    )
                if gone in done and line not in done:
                    raise _taken_out(node, side)
                if line not in done:
                    continue
                piece = self._piece(line.result(), side, node, seen)
                seen += len(piece.tokens)
                if waiting_kv and piece.tokens:
                    trace.mark(rid, "router.kv_arrived")  # D's first token
                waiting_kv = waiting_kv and not (piece.tokens or piece.finish)
                if early is not None and piece.tokens:
                    if piece.tokens[0] != early:
                        raise UpstreamFailed(
                            f"decode node {node.url} began with token {piece.tokens[0]}, but "
                            f"the prefill node sampled {early}",
                            "decode_failed",
                        )
                    piece = Piece(piece.tokens[1:], piece.finish, piece.cached_tokens)
                    early = None
                yield piece
                if piece.finish is not None:
                    return
                line = asyncio.ensure_future(self._next_line(resp))
        finally:
            for waiter in (line, down, gone):
                _discard(waiter)

    @property
    def _sglang(self) -> bool:
        return self.pool.cfg.node_api is NodeApi.SGLANG

    def _wire(self, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        """The body as the nodes' API has it (:func:`tspd_router.sglang.generate_body`)."""
        if self._sglang:
            return sglang.generate_body(body, stream)
        return body | {"stream": True} if stream else body

    def _native(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A node's answer in tspd's words (an SGLang error body translated)."""
        return sglang.native_error(answer) if self._sglang else answer

    async def _next_line(self, resp: aiohttp.ClientResponse) -> bytes:
        """The next line of a stream (an SSE event's payload in SGLang mode: other lines
        are skipped); b"" at its end."""
        while True:
            raw = await resp.content.readline()
            if not self._sglang or not raw:
                return raw
            data = sglang.event_data(raw)
            if data is not None:
                return data

    def _piece(self, raw: bytes, side: str, node: NodeState, seen: int) -> Piece:
        if not self._sglang:
            return _piece(raw, side, node)
        if not raw or raw == b"[DONE]":
            raise UpstreamFailed(f"{side} node {node.url} ended the stream early", f"{side}_failed")
        try:
            tokens, finish, cached = sglang.read_event(json.loads(raw), seen)
        except sglang.Failed as exc:
            raise node_error(side, node, 200, exc.body) from None
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            why = f"{side} node {node.url} sent a bad event: {exc!r}"[:300]
            raise UpstreamFailed(why, f"{side}_failed") from exc
        return Piece(tokens, finish, cached)

    def _unreachable(self, node: NodeState, side: str, exc: BaseException) -> ApiError:
        if isinstance(exc, _DEAD):
            self.pool.mark_failed(node, str(exc) or type(exc).__name__)
        return UpstreamFailed(f"{side} node {node.url} failed: {exc}", f"{side}_failed")

    def _abort(self, nodes: list[NodeState], rid: str, room: int | None = None) -> None:
        """Tell each node to drop ``rid`` and, given ``room`` (a prefill node), to fail that
        room if it does not know ``rid`` (in the background; an unknown id is harmless). In
        SGLang mode nothing is sent: the nodes never learnt the rid, and closing a request's
        connection (done already) is its abort there."""
        if self._sglang:
            return
        body: dict[str, Any] = {"rid": rid} if room is None else {"rid": rid, "room": room}
        for node in nodes:
            task = asyncio.get_running_loop().create_task(self._post_abort(node, body))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _post_abort(self, node: NodeState, body: dict[str, Any]) -> None:
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
        rid = body["rid"]
        try:
            async with self.session.post(f"{node.url}/abort", json=body, timeout=timeout) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:  # RuntimeError:
            # the session closed under it (the router stopping): nothing is left to abort for
            log.info("could not abort %s on %s: %s", rid, node.url, exc)

    async def close(self) -> None:
        """Wait (briefly) for the aborts still being sent."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=ABORT_TIMEOUT_S)


@contextlib.asynccontextmanager
async def _until_down(node: NodeState, side: str) -> AsyncIterator[None]:
    """Run the block (it must not yield to a consumer) unless the health checks take ``node``
    out first: then it is cancelled and :func:`_taken_out`'s error raised. A host cut off the
    network neither accepts nor refuses a connection, so a request to it would wait for the
    request timeout. The block runs in the calling task (no extra hop on the way)."""
    active = True

    def fire(waiter: asyncio.Future[Any]) -> None:
        if active and not waiter.cancelled():
            deadline.reschedule(asyncio.get_running_loop().time())

    try:
        async with asyncio.timeout(None) as deadline:
            waiter = asyncio.ensure_future(node.down.wait())
            waiter.add_done_callback(fire)
            try:
                yield
            finally:
                active = False
                waiter.cancel()
    except TimeoutError:
        if deadline.expired():
            raise _taken_out(node, side) from None
        raise


def _taken_out(node: NodeState, side: str) -> ApiError:
    return UpstreamFailed(
        f"{side} node {node.url} was taken out by the health checks: {node.last_error}",
        f"{side}_node_down",
    )


def _piece(raw: bytes, side: str, node: NodeState) -> Piece:
    if not raw:
        raise UpstreamFailed(f"{side} node {node.url} closed the stream early", f"{side}_failed")
    try:
        line = json.loads(raw)
        tokens = tuple(int(t) for t in line["output_ids"])
        finish = line.get("finish_reason")
        cached = int(line.get("cached_tokens", 0))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        why = f"{side} node {node.url} sent a bad line: {exc!r}"[:300]
        raise UpstreamFailed(why, f"{side}_failed") from exc
    if finish in (None, "length", "eos"):
        return Piece(tokens, finish, cached)
    raise node_error(side, node, 200, line)


async def _answer(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """A node's answer body: its JSON object, or (a proxy's page, aiohttp's plain 413, a
    cut body) ``{"error": <the start of its text>}``."""
    raw = await resp.read()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, dict):
        return body
    text = raw[:200].decode("utf-8", "replace").strip()
    return {"error": text or f"HTTP {resp.status} with no body"}


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A background task's done callback: its exception counts as retrieved (whoever cared
    saw it already; one nobody awaits must not be logged as "never retrieved")."""
    if not task.cancelled():
        task.exception()


def _discard(waiter: asyncio.Future[Any]) -> None:
    """Cancel a waiter nobody reads any more; one that finished has its exception (if any)
    retrieved, so none is logged as "never retrieved"."""
    if not waiter.cancel() and not waiter.cancelled():
        waiter.exception()
