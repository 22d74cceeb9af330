#!/usr/bin/env python3
"""tspd launcher: run a prefill/decode (PD) disaggregated cluster, one role per process.

roles:
  local       everything on this machine: a prefill node (TP --prefill-tp) hosting its
              bootstrap server, a decode node (TP --decode-tp) and the router, as child
              processes
  bootstrap   a standalone bootstrap server, for prefill nodes started with --bootstrap (by
              default a prefill node hosts its own, so it dies with the node)
  prefill     a prefill node: engine replicas that prefill prompts and send their KV cache;
              it serves its bootstrap server (prefill ranks register there, decode ranks
              look them up and watch its /health)
  decode      a decode node: engine replicas that receive KV caches and generate the tokens
  colocated   a node that prefills and decodes itself (no PD), e.g. to compare against
  router      the OpenAI-compatible router (/v1/completions, /v1/chat/completions, ...)
  demo        start "local", send a few requests with the openai client, print the answers
              with TTFT/TPOT and the KV transfer metrics, stop everything

examples:
  # the demo (what "./nox -s demo" runs)
  python apps/launch_pd.py demo

  # all of it on a laptop CPU (tiny seeded model): router on http://127.0.0.1:8000
  python apps/launch_pd.py local
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "tspd-tiny", "prompt": "Hello", "max_tokens": 16}'

  # the same cluster across machines (10.0.0.1 router, .2 prefill + its bootstrap
  # server on :8998, .3 decode)
  python apps/launch_pd.py prefill --host 0.0.0.0 --port 8100 --tp 2 \\
       --bootstrap-port 8998 --advertise-host 10.0.0.2 --model /models/llama
  python apps/launch_pd.py decode --host 0.0.0.0 --port 8200 --tp 1 \\
       --advertise-host 10.0.0.3 --model /models/llama
  python apps/launch_pd.py router --host 0.0.0.0 --port 8000 \\
       --prefill http://10.0.0.2:8100 --decode http://10.0.0.3:8200

Every role prints "<role> ready on <url>" once it serves, and stops cleanly on Ctrl-C or
SIGTERM (a node stops its HTTP endpoint, then its rank processes and transfer workers).
"python apps/launch_pd.py <role> --help" lists a role's flags; docs/OPERATIONS.md explains
deployment, tuning and failure modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tspd_core.pd import PdTunables
from tspd_engine.cliargs import add_engine_args, engine_config
from tspd_engine.errors import EngineError
from tspd_engine.launch import free_port
from tspd_engine.node import NodeRole

NODE_ROLES = ("prefill", "decode", "colocated")
PORTS = {"bootstrap": 8998, "prefill": 8100, "decode": 8200, "colocated": 8100, "router": 8000}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    opts = parser.parse_args(argv)
    level = opts.log_level.upper()
    os.environ.setdefault("TSPD_LOG_LEVEL", level)  # the engine's rank processes read it
    logging.basicConfig(level=level, format=f"%(asctime)s {opts.role} %(name)s %(message)s")
    if getattr(opts, "parent_pid", None):
        _watch_parent(opts.parent_pid)
    try:
        if opts.role == "local":
            from tspd_router.local import run_local

            return run_local(opts, _local_children(opts))
        if opts.role == "demo":
            from tspd_router.demo import run_demo

            return run_demo(_demo_local_argv(opts), opts.max_tokens)
        if opts.role == "bootstrap":
            return _bootstrap(opts)
        if opts.role == "router":
            return _router(opts)
        return _node(opts)
    except (EngineError, ValueError) as exc:
        print(f"launch_pd {opts.role}: error: {exc}", file=sys.stderr)
        return 2


# -- command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="launch_pd.py", description=__doc__, formatter_class=raw)
    sub = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    helps = {line.split()[0]: " ".join(line.split()[1:]) for line in _role_lines()}
    for role in ("local", "bootstrap", *NODE_ROLES, "router", "demo"):
        p = sub.add_parser(role, description=helps[role], formatter_class=raw)
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
        p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
        if role == "local":
            _local_args(p)
        elif role == "demo":
            p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
        elif role == "bootstrap":
            _serve_args(p, role)
        elif role == "router":
            _router_args(p)
        else:
            _node_args(p, role)
    return parser


def _role_lines() -> list[str]:
    lines = __doc__.split("roles:\n")[1].split("\n\n")[0].splitlines()
    merged: list[str] = []
    for line in lines:
        if line.startswith("    "):  # continuation
            merged[-1] += " " + line.strip()
        else:
            merged.append(line.strip())
    return merged


def _serve_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=PORTS[role],
                   help="port to bind; 0 = any free port (default: %(default)s)")  # fmt: skip


def _pd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("PD transfer")
    g.add_argument(
        "--transport",
        choices=["tcp", "rdma"],
        default="tcp",
        help="Mooncake transport of the KV (default: %(default)s)",
    )
    g.add_argument("--ib-device", default="", help="RDMA device(s) for Mooncake (default: auto)")
    g.add_argument(
        "--advertise-host", help="address other nodes reach this node's ranks at (default: auto)"
    )
    g.add_argument(
        "--bootstrap-timeout",
        type=float,
        help="s a prefill room may wait for its decode side (default: 120, WIRE §8)",
    )
    g.add_argument(
        "--waiting-timeout",
        type=float,
        help="s a decode room may wait for its KV (default: 300, WIRE §8)",
    )
    g.add_argument(
        "--heartbeat-interval",
        type=float,
        help="s between a decode node's GET /health on each prefill node's bootstrap server "
        "(default: 5, at least 2, WIRE §8)",
    )
    g.add_argument(
        "--heartbeat-failures",
        type=int,
        help="failed heartbeats in a row that declare a prefill node dead and fail its rooms "
        "(default: 2, WIRE §8)",
    )


def _node_args(p: argparse.ArgumentParser, role: str) -> None:
    _serve_args(p, role)
    p.add_argument("--dp", type=int, default=1, help="engine replicas in this node")
    p.add_argument("--served-model-name", default="tspd-tiny", help="model name (router, API)")
    if role == "prefill":
        g = p.add_argument_group("bootstrap server (WIRE §3)")
        g.add_argument("--bootstrap-port", type=int, metavar="PORT",
                       help="port of the bootstrap server this node hosts, bound to --host; "
                            f"0 = any free port (default: {PORTS['bootstrap']})")  # fmt: skip
        g.add_argument("--bootstrap", metavar="HOST:PORT",
                       help="use this external bootstrap server (the bootstrap role) instead of "
                            "hosting one; D then detects a dead node by its router's health "
                            "checks or its waiting timeout only")  # fmt: skip
    add_engine_args(p)
    if role != "colocated":
        _pd_args(p)


def _router_args(p: argparse.ArgumentParser) -> None:
    from tspd_router.__main__ import add_router_args

    _serve_args(p, "router")
    add_router_args(p)


def _local_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address every role binds and advertises")
    g = p.add_argument_group("ports (0 = any free port)")
    for role in ("router", "prefill", "decode", "bootstrap"):
        g.add_argument(f"--{role}-port", type=int, default=PORTS[role])
    g = p.add_argument_group("parallelism")
    g.add_argument("--prefill-tp", type=int, default=2, help="TP of the prefill node")
    g.add_argument("--decode-tp", type=int, default=1, help="TP of the decode node")
    g.add_argument("--prefill-dp", type=int, default=1, help="replicas of the prefill node")
    g.add_argument("--decode-dp", type=int, default=1, help="replicas of the decode node")
    p.add_argument(
        "--standalone-bootstrap",
        action="store_true",
        help="run the bootstrap server as its own role instead of inside the prefill node",
    )
    p.add_argument("--policy", default="round_robin", choices=["round_robin", "least_load"])
    p.add_argument("--served-model-name", default="tspd-tiny")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=300.0,
        help="s each role may take to become ready (default: %(default)s)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=20.0,
        help="s each role may take to stop before it is killed (default: %(default)s)",
    )
    add_engine_args(p, tp=False)
    _pd_args(p)


# -- roles --------------------------------------------------------------------------------


def _ready(role: str, url: str, detail: str = "") -> None:
    print(f"{role} ready on {url}{f' ({detail})' if detail else ''}", flush=True)


def _bootstrap(opts: argparse.Namespace) -> int:
    from tspd_bootstrap.server import BootstrapServer
    from tspd_engine.pdlink import canonical_layout

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with BootstrapServer(opts.host, opts.port, layout_canonicalizer=canonical_layout) as server:
        _ready("bootstrap", f"http://{opts.host}:{server.port}")
        stop.wait()
    return 0


def _router(opts: argparse.Namespace) -> int:
    import asyncio

    from tspd_router.__main__ import router_config, serve

    cfg = router_config(opts)
    mode = (f"PD: {len(cfg.prefill)} prefill, {len(cfg.decode)} decode" if cfg.pd
            else f"colocated: {len(cfg.colocated)} nodes")  # fmt: skip
    asyncio.run(serve(cfg, opts.host, opts.port, lambda url: _ready("router", url, mode)))
    return 0


def _node(opts: argparse.Namespace) -> int:
    from tspd_engine.node import NodeInfo
    from tspd_engine.nodeserve import BOOTSTRAP_PORT, NodeSpec, run_node

    role = NodeRole(opts.role)
    external = getattr(opts, "bootstrap", None) or ""
    port = getattr(opts, "bootstrap_port", None)
    if external and port is not None:
        raise ValueError("give --bootstrap (an external server) or --bootstrap-port (the "
                         "node's own), not both")  # fmt: skip
    spec = NodeSpec(
        role=role, engine=engine_config(opts), dp=opts.dp, host=opts.host, port=opts.port,
        bootstrap=external, bootstrap_port=BOOTSTRAP_PORT if port is None else port,
        advertise=getattr(opts, "advertise_host", None),
        protocol=getattr(opts, "transport", "tcp"), ib_device=getattr(opts, "ib_device", ""),
        tunables=_tunables(opts), model_name=opts.served_model_name,
    )  # fmt: skip

    def ready(url: str, info: NodeInfo) -> None:
        boot = f", bootstrap {info.bootstrap}" if info.bootstrap else ""
        boot += " served here" if info.bootstrap_hosted else ""
        _ready(role.value, url, f"tp={info.tp}, dp={info.dp}{boot}")

    return run_node(spec, ready)


#: Flags that override a PD tunable (WIRE §8): flag dest -> PdTunables field.
TUNABLE_FLAGS = {
    "bootstrap_timeout": "bootstrap_timeout_s",
    "waiting_timeout": "waiting_timeout_s",
    "heartbeat_interval": "heartbeat_interval_s",
    "heartbeat_failures": "heartbeat_max_failure",
}


def _tunables(opts: argparse.Namespace) -> PdTunables | None:
    """The PD tunables from the environment (WIRE §8), with the flags' overrides."""
    given: dict[str, float] = {
        field: getattr(opts, flag)
        for flag, field in TUNABLE_FLAGS.items()
        if getattr(opts, flag, None) is not None
    }
    if given.get("heartbeat_interval_s", 2.0) < 2.0 or given.get("heartbeat_max_failure", 1) < 1:
        raise ValueError("--heartbeat-interval must be >= 2 s and --heartbeat-failures >= 1 "
                         "(WIRE §8's floors)")  # fmt: skip
    if not given:
        return None  # each rank reads its environment
    return dataclasses.replace(PdTunables.from_env(), **given)  # type: ignore[arg-type]


def _watch_parent(parent: int) -> None:
    """Stop this role (as SIGTERM would) once the process that started it is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# -- local ----------------------------------------------------------------------------------


def _local_children(opts: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(role, argv) of each child of ``local``, in start order."""
    host = opts.host
    ports = {r: getattr(opts, f"{r}_port") or free_port(host)
             for r in ("bootstrap", "prefill", "decode", "router")}  # fmt: skip
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--log-level", opts.log_level, "--parent-pid", str(os.getpid())]
    engine = _engine_flags(opts) + _pd_flags(opts)
    node = ["--host", host, "--advertise-host", host, "--served-model-name",
            opts.served_model_name]  # fmt: skip
    boot = ["--bootstrap-port", str(ports["bootstrap"])]
    children = []
    if opts.standalone_bootstrap:
        children.append(("bootstrap", [*me, "bootstrap", *common, "--host", host,
                                       "--port", str(ports["bootstrap"])]))  # fmt: skip
        boot = ["--bootstrap", f"{host}:{ports['bootstrap']}"]
    return [
        *children,
        ("prefill", [*me, "prefill", *common, *node, "--port", str(ports["prefill"]),
                     "--tp", str(opts.prefill_tp), "--dp", str(opts.prefill_dp),
                     *boot, *engine]),
        ("decode", [*me, "decode", *common, *node, "--port", str(ports["decode"]),
                    "--tp", str(opts.decode_tp), "--dp", str(opts.decode_dp), *engine]),
        ("router", [*me, "router", *common, "--host", host, "--port", str(ports["router"]),
                    "--prefill", f"http://{host}:{ports['prefill']}",
                    "--decode", f"http://{host}:{ports['decode']}", "--policy", opts.policy]),
    ]  # fmt: skip


def _demo_local_argv(opts: argparse.Namespace) -> list[str]:
    """The ``local`` command the demo runs: P TP 2 -> D TP 1 on free ports."""
    ports = [f"--{r}-port" for r in ("router", "prefill", "decode", "bootstrap")]
    return [sys.executable, str(Path(__file__).resolve()), "local", "--log-level", "warning",
            "--num-pages", "256", *(x for port in ports for x in (port, "0"))]  # fmt: skip


def _engine_flags(opts: argparse.Namespace) -> list[str]:
    cfg = engine_config(opts, tp=1)  # checked here, before any child starts
    flags = ["--seed", str(cfg.seed), "--page-size", str(cfg.page_size),
             "--num-pages", str(cfg.num_pages), "--max-running", str(cfg.max_running),
             "--max-prefill-tokens", str(cfg.max_prefill_tokens), "--page-layout",
             cfg.page_layout, "--device", cfg.device, "--dtype", opts.dtype,
             "--threads", str(cfg.threads)]  # fmt: skip
    if cfg.checkpoint is not None:
        flags += ["--model", str(cfg.checkpoint)]
    if cfg.max_model_len is not None:
        flags += ["--max-model-len", str(cfg.max_model_len)]
    flags += ["--no-device-feed"] if not cfg.device_feed else []
    flags += ["--no-prefix-cache"] if not cfg.prefix_cache else []
    return flags


def _pd_flags(opts: argparse.Namespace) -> list[str]:
    flags = ["--transport", opts.transport]
    if opts.ib_device:
        flags += ["--ib-device", opts.ib_device]
    for name in TUNABLE_FLAGS:
        if getattr(opts, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(opts, name))]
    return flags


if __name__ == "__main__":
    raise SystemExit(main())
