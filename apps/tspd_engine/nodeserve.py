"""Run a node: its engine replicas (DP × TP rank processes, each rank with its PD transfer
peer) behind the node HTTP endpoint, from start to a clean stop.

``run_node(spec)`` blocks: it starts every replica (a prefill replica's ranks register with
the bootstrap server as they start), serves HTTP, calls ``ready(url)`` once both are up, and
on SIGINT or SIGTERM stops the endpoint first (requests in flight end) and then every
replica (ranks joined, stragglers terminated, transfer workers stopped with their ranks).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from aiohttp import web

from tspd_core.pd import PdTunables
from tspd_engine.config import EngineConfig
from tspd_engine.launch import EngineHandle, launch
from tspd_engine.node import Node, NodeInfo, NodeRole
from tspd_engine.pdlink.config import PdConfig, PdRole
from tspd_engine.server import make_app
from tspd_engine.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0
#: Seconds requests in flight get to finish when the node stops (then they are cancelled).
SHUTDOWN_GRACE_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """Everything a node needs; ``role`` decides whether its ranks join PD."""

    role: NodeRole
    engine: EngineConfig
    dp: int = 1
    host: str = "127.0.0.1"  #: HTTP bind address
    port: int = 8100
    bootstrap: str = ""  #: prefill: the bootstrap server (host:port) its ranks register with
    advertise: str | None = None  #: address peers reach the ranks' sockets at (None = auto)
    protocol: str = "tcp"
    ib_device: str = ""
    tunables: PdTunables | None = None
    model_name: str = "tspd-tiny"

    def pd(self, dp_rank: int) -> PdConfig | None:
        if self.role is NodeRole.COLOCATED:
            return None
        return PdConfig(
            role=PdRole(self.role.value), bootstrap=self.bootstrap, host=self.advertise,
            protocol=self.protocol, ib_device=self.ib_device, dp_size=self.dp,
            dp_rank=dp_rank, tunables=self.tunables,
        )  # fmt: skip

    def info(self) -> NodeInfo:
        cfg = self.engine
        return NodeInfo(
            role=self.role, model=self.model_name, tp=cfg.tp, dp=self.dp,
            bootstrap=self.bootstrap or None, page_size=cfg.page_size,
            num_pages=cfg.num_pages, max_model_len=cfg.context_limit,
            vocab_size=cfg.model.vocab_size,
        )  # fmt: skip


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_node(spec: NodeSpec, ready: Callable[[str], None] | None = None) -> int:
    """Start, serve until SIGINT/SIGTERM, stop; 0 after a clean stop (raises on a failed
    start, with whatever started stopped)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a stop during start-up, too
    handles: list[EngineHandle] = []
    try:
        for rank in range(spec.dp):  # one by one: an interrupt leaves the started ones here
            handles.append(launch(spec.engine, pd=spec.pd(rank)))  # noqa: PERF401
        signal.signal(signal.SIGTERM, previous)
        node = Node([h.client for h in handles], spec.info())
        asyncio.run(_serve(node, spec, ready))
    except KeyboardInterrupt:
        log.info("interrupted; stopping the node")
    finally:
        for handle in handles:
            handle.shutdown(STOP_TIMEOUT_S)
    return 0


async def _serve(node: Node, spec: NodeSpec, ready: Callable[[str], None] | None) -> None:
    runner = web.AppRunner(
        make_app(node, ByteTokenizer()), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, spec.host, spec.port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready(f"http://{spec.host}:{runner.addresses[0][1]}")
        await stop.wait()
    finally:
        await runner.cleanup()
