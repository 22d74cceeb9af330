"""``tspd-router`` (``python -m tspd_router``): the PD router (OpenAI-compatible HTTP API) in
front of nodes.

Examples::

    # PD: every request goes to one prefill and one decode node
    tspd-router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    # colocated nodes, least-loaded first
    tspd-router --colocated http://10.0.0.5:8100 --colocated http://10.0.0.6:8100 \\
        --policy least_load
    # a real model: the router tokenizes, applies the chat template and detokenizes
    tspd-router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --tokenizer smollm2-135m

Prints ``router ready on http://HOST:PORT ...`` once it serves; SIGINT or SIGTERM stops it
(requests in flight are aborted on the nodes).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from tspd_core import trace
from tspd_router.app import make_app
from tspd_router.config import NodeApi, Policy, RouterConfig
from tspd_serving import cliargs
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.http import bind_socket
from tspd_serving.tokenizer import ContentSpecials, Tokenizer

SHUTDOWN_GRACE_S = 5.0


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """The router's flags (shared with the launcher's ``router`` role)."""
    g = parser.add_argument_group("nodes")
    for role, what in (("prefill", "PD mode"), ("decode", "PD mode"),
                       ("colocated", "instead of PD")):  # fmt: skip
        g.add_argument(f"--{role}", action="append", default=[], metavar="URL",
                       help=f"a {role} node's HTTP endpoint (repeatable; {what})")  # fmt: skip
    d = RouterConfig(colocated=("http://x:1",))
    g = parser.add_argument_group("router")
    g.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=d.policy.value,
        help="how a node of each role is picked (default: %(default)s)",
    )
    g.add_argument(
        "--node-api",
        choices=[a.value for a in NodeApi],
        default=d.node_api.value,
        help="the HTTP API the nodes speak: tspd's own, or SGLang's (TokenSpeed's and SGLang's "
        "nodes; tspd's speak both) (default: %(default)s)",
    )
    g.add_argument("--model", help="the model name served (default: the nodes' own)")
    g.add_argument(
        "--tokenizer",
        type=cliargs.model_path,
        metavar="DIR|FILE.gguf|NAME",
        help="the served model's tokenizer and chat template: its checkpoint directory, GGUF "
        "file or name (smollm2-135m); the nodes' --model (default: tiny, the seeded model's "
        "byte tokenizer)",
    )
    g.add_argument(
        "--health-timeout",
        type=cliargs.seconds,
        metavar="S",
        help="seconds one health check may take before it fails (default: the interval, at "
        "least 1)",
    )
    flags = (
        ("--health-interval", float, d.health_interval_s, "seconds between node health checks"),
        ("--health-failures", int, d.health_failures, "failed checks before a node is out"),
        ("--request-timeout", float, d.request_timeout_s, "seconds before a request fails (504)"),
        ("--chat-max-tokens", int, d.chat_max_tokens, "max_tokens of a chat naming none"),
    )
    for flag, kind, default, text in flags:
        g.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    g.add_argument(
        "--tokenizer-threads",
        type=cliargs.count,
        default=d.tokenizer_threads,
        metavar="N",
        help="threads that parse, render and tokenize requests off the event loop, at most "
        "N at once (default: %(default)s)",
    )
    cliargs.add_chat_content_arg(parser)
    g.add_argument(
        "--accept-sampling",
        action="store_true",
        help="decode temperature/top_p requests greedily instead of refusing them",
    )
    g.add_argument(
        "--hold-first-token",
        action="store_true",
        help="PD: send nothing until D's first token (the KV arrived), instead of passing P's "
        "first token on at once; a stream whose transfer fails then gets a real HTTP status "
        "rather than an error event after its first token, at the price of the transfer's "
        "time in TTFT",
    )


def router_config(opts: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        prefill=tuple(opts.prefill), decode=tuple(opts.decode), colocated=tuple(opts.colocated),
        policy=Policy(opts.policy), node_api=NodeApi(opts.node_api), model=opts.model,
        health_interval_s=opts.health_interval,
        health_failures=opts.health_failures, request_timeout_s=opts.request_timeout,
        chat_max_tokens=opts.chat_max_tokens, accept_sampling=opts.accept_sampling,
        early_first_token=not opts.hold_first_token, health_timeout_s=opts.health_timeout,
        http=cliargs.http_limits(opts), tokenizer_threads=opts.tokenizer_threads,
        chat_content_special_tokens=ContentSpecials(opts.chat_content_special_tokens),
    )  # fmt: skip


def router_tokenizer(opts: argparse.Namespace) -> Tokenizer:
    """The tokenizer ``--tokenizer`` names (ConfigError/CheckpointError, ValueErrors, if it
    cannot be loaded)."""
    return load_tokenizer(getattr(opts, "tokenizer", None))


async def serve(
    cfg: RouterConfig,
    host: str,
    port: int,
    ready: Callable[[str], None] | None = None,
    tokenizer: Tokenizer | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; ``ready(url)`` once bound. ConfigError (a ValueError)
    before anything starts when ``host:port`` cannot be bound."""
    trace.label("router")
    sock = bind_socket(host, port, "choose another --port")
    # On a stop, requests in flight get SHUTDOWN_GRACE_S to finish, then are cancelled
    # (which aborts them on the nodes).
    runner = web.AppRunner(
        make_app(cfg, tokenizer),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        **cfg.http.runner_kwargs(),
    )
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready(f"http://{host}:{sock.getsockname()[1]}")
        await stop.wait()
    finally:
        await runner.cleanup()
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tspd-router", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=cliargs.port, default=8000,
                        help="port; 0 = any free port (default: %(default)s)")  # fmt: skip
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    cliargs.add_http_args(parser)
    add_router_args(parser)
    opts = parser.parse_args(argv)
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s router %(message)s")
    try:
        cfg = router_config(opts)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        tokenizer = router_tokenizer(opts)
    except ValueError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        mode = f"PD: {len(cfg.prefill)} prefill, {len(cfg.decode)} decode" if cfg.pd else (
            f"colocated: {len(cfg.colocated)} nodes")  # fmt: skip
        print(f"router ready on {url} ({mode}; policy {cfg.policy})", flush=True)

    try:
        asyncio.run(serve(cfg, opts.host, opts.port, ready, tokenizer))
    except ValueError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    return 0
