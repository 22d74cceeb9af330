"""Shared pieces of the end-to-end tests: the small model, expected tokens, process checks.

Every cluster here is real: bootstrap servers over HTTP, engine ranks as processes, transfer
workers moving KV through Mooncake over TCP, node endpoints and the router over HTTP.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import torch
from aiohttp import web

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.model.config import ModelConfig
from tspd_engine.node.endpoint import make_app
from tspd_engine.node.replicas import Node
from tspd_router.app import make_app as make_router_app
from tspd_router.config import RouterConfig
from tspd_serving.tokenizer import ByteTokenizer, Tokenizer

TOK = ByteTokenizer()
ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "apps" / "launch_pd.py"
#: The command that starts a launcher role (what ``local`` puts before each of its roles).
COMMAND = (sys.executable, str(LAUNCHER))


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # OpenMP workers spinning on a shared 2-core machine make tiny matmuls 100x slower.
    torch.set_num_threads(1)


def e2e_config(**changes: object) -> EngineConfig:
    """The tiny seeded model (2 KV heads: TP 2 splits them, so P2 -> D1 re-slices pages) with
    4-token pages, so prompts span several pages and D's prefix hits are whole pages."""
    base = EngineConfig(model=ModelConfig(), num_pages=160, page_size=4, max_running=16)
    return base.replace(**changes)


def colocated(
    prompts: Sequence[Sequence[int]], params: SamplingParams, cfg: EngineConfig | None = None
) -> list[list[int]]:
    """Greedy tokens of each prompt on one colocated TP-1 engine (the reference)."""
    engine = Engine((cfg or e2e_config()).replace(tp=1))
    try:
        return [list(out.tokens) for out in engine.generate(prompts, params)]
    finally:
        engine.close()


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc; zombies count as gone)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids of ``pids`` that still run (zombies count as gone)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a launcher child: this one's, with ``extra``."""
    return {**os.environ, **extra}


@contextmanager
def serve_app(app: web.Application, **runner_args: object) -> Iterator[str]:
    """``app`` on a loopback port the OS picks as it binds, in a thread of this process;
    yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, **runner_args)  # type: ignore[arg-type]
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextmanager
def serve_node(node: Node, tokenizer: Tokenizer = TOK) -> Iterator[str]:
    """The node HTTP endpoint (``server.make_app``) over ``node``, served by :func:`serve_app`."""
    try:
        with serve_app(make_app(node, tokenizer)) as url:
            yield url
    finally:
        node.close()


@contextmanager
def serve_router(cfg: RouterConfig, tokenizer: Tokenizer = TOK) -> Iterator[str]:
    """The router app over ``cfg``'s nodes, served by :func:`serve_app`."""
    with serve_app(
        make_router_app(cfg, tokenizer), handler_cancellation=True, shutdown_timeout=0.5
    ) as url:
        yield url


def samples(url: str) -> dict[str, float]:
    """A node's ``/metrics`` as {sample with its labels: value}; each family declared once."""
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    types = [line.split()[2] for line in lines if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line and not line.startswith("#")}  # fmt: skip
