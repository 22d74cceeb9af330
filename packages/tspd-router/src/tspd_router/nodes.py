"""The nodes a router sends to: their health, their load, and the policy that picks one.

A health loop GETs every node's ``/health`` each ``health_interval_s`` (a check not answered
within the check timeout, by default the interval, fails: a stopped node is out within
``health_failures`` intervals); a node is taken out after ``health_failures`` consecutive
failures (or at once when a connection to it is refused or reset) and put back after one
success. A node's ``/health`` is its liveness (its rank processes run and progress, read
from their pulses, never through the engine loop: a node in a long prefill round answers
200), so only a dead, stopped or unreachable node fails it; a busy node (at capacity:
``/ready`` and ``/generate`` answer 503 with ``"busy": true``) is never taken out, and a
``/health`` that says ``busy`` counts as a success. Taking a node out sets its ``down`` event,
which fails the requests still waiting for it (a prefill node that died mid-transfer). When
a node comes (back) up its ``/info`` is read again (in SGLang mode its ``/server_info``:
:mod:`tspd_router.sglang`): its role must be the one configured, and a prefill node's
bootstrap address is what the router hands to decode nodes.

Threading: the router's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp

from tspd_router import sglang
from tspd_router.config import NodeApi, Policy, RouterConfig
from tspd_router.errors import Unavailable

log = logging.getLogger(__name__)


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(eq=False)
class NodeState:
    """One node as the router sees it."""

    url: str
    role: Role
    healthy: bool = False
    failures: int = 0
    in_flight: int = 0
    sent: int = 0  #: requests this router sent the node so far (the picks of it)
    info: dict[str, Any] = field(default_factory=dict)
    bootstrap: tuple[str, int] | None = None  # prefill nodes: host, port
    last_error: str = "not checked yet"
    #: Set when the node is taken out; a fresh event once it is back.
    down: asyncio.Event = field(default_factory=asyncio.Event)
    checking: asyncio.Task[None] | None = None  #: the health check in progress, if any

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count one request in flight on this node (least-load and the in-flight gauge) and
        one more sent to it."""
        self.in_flight += 1
        self.sent += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class NodePool:
    """Every configured node by role, the health loop and the picking policy."""

    def __init__(self, cfg: RouterConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.session = session
        urls = {Role.PREFILL: cfg.prefill, Role.DECODE: cfg.decode, Role.COLOCATED: cfg.colocated}
        self.nodes = {r: [NodeState(u.rstrip("/"), r) for u in us] for r, us in urls.items()}
        self._turn = {role: itertools.count() for role in Role}

    def all(self) -> list[NodeState]:
        return [n for nodes in self.nodes.values() for n in nodes]

    @property
    def model(self) -> str | None:
        """The served model: the configured name, else the first node's; None while no node
        has been reached (nothing can be served then: requests get a 503, not a 404)."""
        if self.cfg.model:
            return self.cfg.model
        names = [str(n.info["model"]) for n in self.all() if n.info.get("model")]
        return names[0] if names else None

    # -- picking ----------------------------------------------------------------------------

    def pick(self, role: Role) -> NodeState:
        """A healthy node of ``role`` by the policy; :class:`Unavailable` if none is up."""
        nodes = self.nodes[role]
        healthy = [n for n in nodes if n.healthy]
        if not healthy:
            why = "; ".join(f"{n.url}: {n.last_error}" for n in nodes)
            raise Unavailable(f"no healthy {role} node ({why})", f"no_{role}_node")
        start = next(self._turn[role]) % len(healthy)
        if self.cfg.policy is Policy.ROUND_ROBIN:
            return healthy[start]
        rotated = healthy[start:] + healthy[:start]  # ties go round in turn
        return min(rotated, key=lambda n: n.in_flight)

    # -- health -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Check every node each interval, forever (cancel to stop). Checks keep their own
        cadence: a node that does not answer delays neither the next interval nor the
        others' checks."""
        try:
            while True:
                await asyncio.sleep(self.cfg.health_interval_s)
                for node in self.all():
                    if node.checking is None or node.checking.done():
                        node.checking = asyncio.create_task(self._check(node))
        finally:
            for node in self.all():
                if node.checking is not None:
                    node.checking.cancel()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(n) for n in self.all()))

    def mark_failed(self, node: NodeState, why: str) -> None:
        """A connection to ``node`` was refused or reset: take it out now."""
        node.failures = max(node.failures, self.cfg.health_failures - 1)
        self._failed(node, why)

    async def _check(self, node: NodeState) -> None:
        timeout = aiohttp.ClientTimeout(
            total=self.cfg.check_timeout_s, sock_connect=self.cfg.check_timeout_s
        )
        try:
            async with self.session.get(f"{node.url}/health", timeout=timeout) as resp:
                raw = await resp.read()
                # SGLang's /health answers 200 with an empty body: only the status counts.
                body = None if resp.status == 200 else json.loads(raw or b"null")
                if resp.status != 200 and not _busy(body):
                    why = body.get("error") if isinstance(body, dict) else body
                    raise RuntimeError(f"/health answered {resp.status}: {why}")
            if not node.healthy:
                await self._read_info(node, timeout)
        except TimeoutError:
            self._failed(node, f"no answer to GET /health within {self.cfg.check_timeout_s:g} s")
            return
        except aiohttp.ClientConnectorError as exc:  # refused: nobody listens any more
            self.mark_failed(node, str(exc) or type(exc).__name__)
            return
        except (aiohttp.ClientError, RuntimeError, ValueError, AttributeError) as exc:
            self._failed(node, str(exc) or type(exc).__name__)
            return
        node.failures, node.last_error = 0, ""
        if not node.healthy:
            node.healthy, node.down = True, asyncio.Event()
            log.info("%s node %s is up", node.role, node.url)

    async def _read_info(self, node: NodeState, timeout: aiohttp.ClientTimeout) -> None:
        if self.cfg.node_api is NodeApi.SGLANG:
            info = sglang.node_info(await self._server_info(node, timeout), node.url)
        else:
            async with self.session.get(f"{node.url}/info", timeout=timeout) as resp:
                info = await resp.json()
        if not isinstance(info, dict):
            raise RuntimeError("the node's /info is not a JSON object")
        role = info.get("role")
        if role != node.role.value:
            raise RuntimeError(f"the node reports role {role!r}, configured as {node.role}")
        if node.role is Role.PREFILL:
            host, _, port = str(info.get("bootstrap") or "").rpartition(":")
            if not host or not port.isdigit():
                raise RuntimeError("the prefill node reports no bootstrap address")
            node.bootstrap = (host, int(port))
        node.info = info

    async def _server_info(self, node: NodeState, timeout: aiohttp.ClientTimeout) -> Any:
        """An SGLang node's ``/server_info`` (``/get_server_info`` where that is a 404)."""
        for path in ("/server_info", "/get_server_info"):
            async with self.session.get(node.url + path, timeout=timeout) as resp:
                if resp.status == 404 and path == "/server_info":
                    continue
                if resp.status != 200:
                    raise RuntimeError(f"{path} answered {resp.status}")
                return await resp.json(content_type=None)
        raise AssertionError("unreachable: the second path never continues")

    def _failed(self, node: NodeState, why: str) -> None:
        node.failures += 1
        if not node.healthy and why != node.last_error:
            # Once per new reason: an operator sees at start-up which node is missing and
            # why, without a line per health check while it stays down.
            log.warning("%s node %s is not available: %s", node.role, node.url, why)
        node.last_error = why
        if node.healthy and node.failures >= self.cfg.health_failures:
            node.healthy = False
            node.down.set()
            log.warning("%s node %s taken out: %s", node.role, node.url, why)


def _busy(body: Any) -> bool:
    """Whether a node's answer says it is busy (at capacity), not failed."""
    return isinstance(body, dict) and body.get("busy") is True
