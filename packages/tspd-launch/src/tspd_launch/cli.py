"""``tspd-launch``: tspd's launcher, one role of a PD cluster per process (:data:`MANUAL`).

``python -m tspd_launch`` is the same command; ``apps/launch_pd.py`` in a checkout runs it as
``launch_pd.py`` (:class:`Entry`). A role imports what it runs when it starts it (the
function-local imports below): parsing any role's flags loads no torch, a node role loads the
engine only once :func:`_node` has made a stop during that import clean, and the router and
replay roles never load it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tspd_bootstrap import BindError, BootstrapServer, ClusterCredential
from tspd_bootstrap.server import BODY_TIMEOUT_S as BOOTSTRAP_BODY_TIMEOUT_S
from tspd_engine.node.cliargs import (
    CREDENTIAL_ROLES,
    LAYERWISE_HELP,
    ROLE_FLAGS,
    TUNABLE_FLAGS,
    add_capacity_arg,
    add_credential_args,
    add_engine_args,
    add_pd_args,
    add_step_log_arg,
    bootstrap_entry,
    engine_config,
    export_credential,
    layerwise_interval,
    tunable_overrides,
)
from tspd_router.cli import add_router_args, router_config, router_tokenizer, serve
from tspd_serving.cliargs import (
    add_chat_content_arg,
    add_http_args,
    count,
    http_limits,
    model_path,
    port,
    steps,
)
from tspd_serving.errors import ConfigError, ServingError
from tspd_serving.models import SMOLLM2, model_name

if TYPE_CHECKING:
    from tspd_launch.demo import DemoSpec

MANUAL = """tspd launcher: run a prefill/decode (PD) disaggregated cluster, one role per process.

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
  replay      replay a request trace against a running cluster (its router) at the
              trace's arrival times, prompts synthesised to the trace's lengths, and write
              the simulator's per-request table (tspd-sim fidelity --real compares them)

examples:
  # the demo (what "./nox -s demo" runs)
  {launcher} demo

  # all of it on a laptop CPU (tiny seeded model): router on http://127.0.0.1:8000
  {launcher} local
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "tspd-tiny", "prompt": "Hello", "max_tokens": 16}'

  # replay 40 requests of the Azure conversation trace at 0.5 req/s against it; the
  # per-request table then goes to "tspd-sim fidelity --real replay-results/requests.parquet"
  {launcher} replay --url http://127.0.0.1:8000 --trace azure-conv \\
       --requests 40 --rate 0.5 --out replay-results/requests.parquet

  # the same cluster across machines (10.0.0.1 router, .2 prefill + its bootstrap
  # server on :8998, .3 decode)
  {launcher} prefill --host 0.0.0.0 --port 8100 --tp 2 \\
       --bootstrap-port 8998 --advertise-host 10.0.0.2 --model /models/llama
  {launcher} decode --host 0.0.0.0 --port 8200 --tp 1 \\
       --advertise-host 10.0.0.3 --model /models/llama
  {launcher} router --host 0.0.0.0 --port 8000 \\
       --prefill http://10.0.0.2:8100 --decode http://10.0.0.3:8200

Every role prints "<role> ready on <url>" once it serves, and stops cleanly on Ctrl-C or
SIGTERM (a node stops its HTTP endpoint, then its rank processes and transfer workers).
"{launcher} <role> --help" lists a role's flags; docs/OPERATIONS.md explains
deployment, tuning and failure modes.
"""


@dataclass(frozen=True, slots=True)
class Entry:
    """How this launcher was started: the name its messages give (``prog``), the command its
    manual's examples show (``shown``) and the command that starts its children (``local``'s
    roles, the demo's ``local``)."""

    prog: str
    shown: str
    command: tuple[str, ...]


#: ``tspd-launch`` and ``python -m tspd_launch``.
PACKAGED = Entry("tspd-launch", "tspd-launch", (sys.executable, "-m", "tspd_launch"))
NODE_ROLES = ("prefill", "decode", "colocated")
PORTS = {"bootstrap": 8998, "prefill": 8100, "decode": 8200, "colocated": 8100, "router": 8000}


def main(argv: list[str] | None = None, entry: Entry = PACKAGED) -> int:
    """Run the role ``argv`` names; its exit code (2: refused flags or a start that failed)."""
    opts = parse(argv, entry)
    level = opts.log_level.upper()
    os.environ.setdefault("TSPD_LOG_LEVEL", level)  # the engine's rank processes read it
    logging.basicConfig(level=level, format=f"%(asctime)s {opts.role} %(name)s %(message)s")
    if getattr(opts, "parent_pid", None):
        _watch_parent(opts.parent_pid)
    try:
        if opts.role in CREDENTIAL_ROLES:
            _credential(opts)
        if hasattr(opts, "served_model_name") and opts.served_model_name is None:
            opts.served_model_name = model_name(opts.checkpoint)
        if opts.role == "local":
            from tspd_launch.local import check_local, run_local

            check_local(opts)
            return run_local(opts, entry.command)
        if opts.role == "demo":
            from tspd_launch.demo import DemoSpec, run_demo

            spec = DemoSpec(opts.checkpoint, *_demo_tp(opts), opts.layerwise_interval)
            return run_demo(spec, _demo_local_argv(spec, entry.command), opts.max_tokens)
        if opts.role == "replay":
            return _replay(opts)
        if opts.role == "bootstrap":
            return _bootstrap(opts)
        if opts.role == "router":
            return _router(opts)
        return _node(opts)
    except (ServingError, ValueError) as exc:
        print(f"{entry.prog} {opts.role}: error: {exc}", file=sys.stderr)
        return 2


def parse(argv: Sequence[str] | None = None, entry: Entry = PACKAGED) -> argparse.Namespace:
    """``argv``'s role and flags as :func:`main` reads them (SystemExit 2 with the role's usage
    for a flag it refuses). Orchestration checks its command lines with it (the Kubernetes
    manifests' tests: deploy/k8s)."""
    parser, roles = _parser(entry)
    opts, extra = parser.parse_known_args(None if argv is None else list(argv))
    if extra:  # refused by the role's own parser, which names the role and its usage
        roles[opts.role].error(_unknown(opts.role, extra))
    return opts


def console() -> int:
    """The ``tspd-launch`` command."""
    return finish(main())


def finish(code: int) -> int:
    """``code``, once the role has stopped and closed what it opened: Python's last garbage
    collection is skipped, which walks every object left (a GGUF's vocabulary, torch's
    modules) and took seconds of a loaded machine's stop bound
    (tspd_engine.rank.process.skip_exit_collection)."""
    gc.freeze()
    return code


# -- command line -------------------------------------------------------------------------


def _parser(
    entry: Entry = PACKAGED,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The launcher's parser and each role's subparser."""
    raw = argparse.RawDescriptionHelpFormatter
    manual = MANUAL.replace("{launcher}", entry.shown)
    parser = argparse.ArgumentParser(prog=entry.prog, description=manual, formatter_class=raw)
    sub = parser.add_subparsers(
        dest="role",
        required=True,
        metavar="ROLE",
        help="one of the roles above; ROLE --help lists its flags",
    )
    helps = {line.split()[0]: " ".join(line.split()[1:]) for line in _role_lines()}
    roles: dict[str, argparse.ArgumentParser] = {}
    for role in ("local", "bootstrap", *NODE_ROLES, "router", "demo", "replay"):
        p = roles[role] = sub.add_parser(role, description=helps[role], formatter_class=raw)
        p.add_argument(
            "--log-level",
            default="info",
            choices=["debug", "info", "warning"],
            help="log level of this role and its processes (default: %(default)s)",
        )
        p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
        if role == "local":
            _local_args(p)
        elif role == "demo":
            _demo_args(p)
        elif role == "replay":
            _replay_args(p)
        elif role == "bootstrap":
            _serve_args(p, role)
            admin = p.add_mutually_exclusive_group()
            admin.add_argument("--admin", action="store_true",
                               help="serve the operator DELETE /ranks endpoints (off: they "
                                    "answer 403, since anyone who reaches --host could "
                                    "forget the deployment's ranks)")  # fmt: skip
            # The default since --admin exists; still accepted so older command lines work.
            admin.add_argument("--no-admin", action="store_true", help=argparse.SUPPRESS)
        elif role == "router":
            _router_args(p)
        else:
            _node_args(p, role)
        if role in CREDENTIAL_ROLES:
            add_credential_args(p)
    return parser, roles


def _credential(opts: argparse.Namespace) -> None:
    """The cluster credential of the flags (or the environment) goes to the environment the
    role's processes inherit; a credential that cannot be used stops the role (exit 2)."""
    fingerprint = export_credential(opts, os.environ)
    if fingerprint:
        logging.getLogger("launch_pd").info("cluster credential on (fingerprint %s)", fingerprint)


def _unknown(role: str, extra: list[str]) -> str:
    """The refusal of flags ``role`` does not take, naming the role a node's flag belongs to."""
    why = f"unrecognized arguments: {' '.join(extra)}"
    owners = {
        f"--{flag.replace('_', '-')}": reader for flag, (_, reader, _) in TUNABLE_FLAGS.items()
    }
    for flag, owner in (owners | ROLE_FLAGS).items():
        if flag in extra and owner != role:
            why += f" ({flag} is a {owner} node's flag)"
    return why


def _role_lines() -> list[str]:
    lines = MANUAL.split("roles:\n")[1].split("\n\n")[0].splitlines()
    merged: list[str] = []
    for line in lines:
        if line.startswith("    "):  # continuation
            merged[-1] += " " + line.strip()
        else:
            merged.append(line.strip())
    return merged


#: What --host binds, by role (every listening socket of a role is on --host or loopback,
#: except Mooncake's: docs/OPERATIONS.md, "What listens where").
HOST_HELP = {
    "bootstrap": "address the bootstrap server listens on",
    "router": "address the router's HTTP API listens on",
    "prefill": "address the node's HTTP endpoint and its bootstrap server listen on, and, "
    "when it is one address, its ranks' control sockets (see --advertise-host)",
    "decode": "address the node's HTTP endpoint listens on, and, when it is one address, its "
    "ranks' control sockets (see --advertise-host)",
    "colocated": "address the node's HTTP endpoint listens on",
}


def _serve_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help=f"{HOST_HELP[role]} (default: %(default)s, this host only)")  # fmt: skip
    p.add_argument("--port", type=port, default=PORTS[role],
                   help="port to bind; 0 = any free port (default: %(default)s)")  # fmt: skip
    add_http_args(p, body_default=BOOTSTRAP_BODY_TIMEOUT_S if role == "bootstrap" else None)


def _node_args(p: argparse.ArgumentParser, role: str) -> None:
    _serve_args(p, role)
    p.add_argument("--dp", type=count, default=1,
                   help="engine replicas in this node (default: %(default)s)")  # fmt: skip
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name this node reports (/info) and the router serves "
                        "(default: the --model name, directory or file name; tspd-tiny "
                        "for the seeded model)")  # fmt: skip
    if role == "prefill":
        g = p.add_argument_group("bootstrap server (wire.md §3)")
        g.add_argument("--bootstrap-port", type=port, metavar="PORT",
                       help="port of the bootstrap server this node hosts, bound to --host; "
                            f"0 = any free port (default: {PORTS['bootstrap']})")  # fmt: skip
        g.add_argument("--bootstrap", metavar="HOST:PORT",
                       help="use this external bootstrap server (the bootstrap role) instead of "
                            "hosting one; D then detects a dead node by its router's health "
                            "checks or its waiting timeout only")  # fmt: skip
        g.add_argument("--bootstrap-admin", action="store_true",
                       help="serve the operator DELETE /ranks endpoints on the bootstrap server "
                            "this node hosts (off: they answer 403, since the server listens "
                            "on --host and a stray DELETE cuts the decode nodes off this "
                            "node)")  # fmt: skip
    if role == "decode":
        p.add_argument("--allow-bootstrap", action="append", default=[], metavar="HOST:PORT",
                       type=bootstrap_entry,
                       help="a bootstrap server this node's requests may name (repeatable; "
                            "HOST:* any port of HOST, * any server; default: this node's own "
                            "hosts only, enough on one machine, not across machines)")  # fmt: skip
    add_engine_args(p)
    add_capacity_arg(p)
    add_step_log_arg(p)
    if role != "colocated":
        add_pd_args(p, role)


def _router_args(p: argparse.ArgumentParser) -> None:
    _serve_args(p, "router")
    add_router_args(p)


def _local_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address every role listens on and advertises "
                        "(default: %(default)s)")  # fmt: skip
    g = p.add_argument_group("ports (0 = any free port)")
    for role in ("router", "prefill", "decode", "bootstrap"):
        g.add_argument(f"--{role}-port", type=port, default=PORTS[role], metavar="PORT",
                       help="(default: %(default)s)")  # fmt: skip
    g = p.add_argument_group("parallelism")
    flags = (
        ("--prefill-tp", None, "TP of the prefill node (default: 2, or the next size the model "
                               "splits over: 3 for smollm2-135m)"),
        ("--decode-tp", 1, "TP of the decode node (default: 1)"),
        ("--prefill-dp", 1, "replicas of the prefill node (default: 1)"),
        ("--decode-dp", 1, "replicas of the decode node (default: 1)"),
    )  # fmt: skip
    for flag, default, text in flags:
        g.add_argument(flag, type=count, default=default, metavar="N", help=text)
    p.add_argument("--standalone-bootstrap", action="store_true",
                   help="run the bootstrap server as its own role instead of inside the "
                        "prefill node")  # fmt: skip
    p.add_argument("--bootstrap-admin", action="store_true",
                   help="serve the operator DELETE /ranks endpoints on the bootstrap server "
                        "(the prefill node's --bootstrap-admin, or the bootstrap role's "
                        "--admin; off: they answer 403)")  # fmt: skip
    p.add_argument("--policy", default="round_robin", choices=["round_robin", "least_load"],
                   help="the router's node policy (default: %(default)s)")  # fmt: skip
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: the --model name, directory "
                        "or file name; tspd-tiny for the seeded model)")  # fmt: skip
    p.add_argument("--step-logs", type=Path, metavar="DIR",
                   help="each node appends its step log to DIR/prefill.csv and DIR/decode.csv "
                        "(the nodes' --step-log; DIR is created)")  # fmt: skip
    p.add_argument("--restart", action="store_true",
                   help="restart a role that exits on its own, on the same ports (default: "
                        "stop the whole cluster)")  # fmt: skip
    p.add_argument("--max-restarts", type=count, default=5, metavar="N",
                   help="restarts per role before the cluster stops anyway "
                        "(default: %(default)s)")  # fmt: skip
    add_http_args(p)
    for flag, seconds, text in (
        ("--start-timeout", 300.0, "to become ready"),
        ("--stop-timeout", 20.0, "to stop before it is killed"),
    ):
        p.add_argument(
            flag,
            type=float,
            default=seconds,
            metavar="S",
            help=f"s each role may take {text} (default: %(default)s)",
        )
    add_engine_args(p, tp=False)
    add_capacity_arg(p, local=True)
    add_chat_content_arg(p)
    add_pd_args(p, "local")


# -- roles --------------------------------------------------------------------------------


def _ready(role: str, url: str, detail: str = "") -> None:
    print(f"{role} ready on {url}{f' ({detail})' if detail else ''}", flush=True)


def _bootstrap(opts: argparse.Namespace) -> int:
    from tspd_engine.pdlink import canonical_layout  # the PD half: torch

    server = BootstrapServer(opts.host, opts.port, layout_canonicalizer=canonical_layout,
                             allow_admin=opts.admin, header_timeout=opts.header_timeout,
                             body_timeout=opts.body_timeout,
                             credential=ClusterCredential.resolve())  # fmt: skip
    try:
        server.start()
    except BindError as exc:
        raise ConfigError(f"cannot serve: {exc} (choose another --port)") from exc
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        _ready("bootstrap", f"http://{opts.host}:{server.port}")
        stop.wait()
    return 0


def _router(opts: argparse.Namespace) -> int:
    cfg = router_config(opts)
    tokenizer = router_tokenizer(opts)
    mode = (f"PD: {len(cfg.prefill)} prefill, {len(cfg.decode)} decode" if cfg.pd
            else f"colocated: {len(cfg.colocated)} nodes")  # fmt: skip
    ready = lambda url: _ready("router", url, mode)  # noqa: E731
    asyncio.run(serve(cfg, opts.host, opts.port, ready, tokenizer))
    return 0


def _node(opts: argparse.Namespace) -> int:
    # A stop may come while the engine's modules load (torch: a second or more), before
    # run_node's own handler is in: the node then ends as cleanly as a moment later (code 0,
    # nothing started yet) instead of dying of the signal.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # KeyboardInterrupt
    try:
        return _start_node(opts)
    except KeyboardInterrupt:
        logging.getLogger("launch_pd").info("stopped while starting")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)  # the caller's, as it was (an embedder's)


def _start_node(opts: argparse.Namespace) -> int:
    from tspd_engine.node.replicas import NodeInfo, NodeRole
    from tspd_engine.node.run import BOOTSTRAP_PORT, NodeSpec, pd_tunables, run_node

    role = NodeRole(opts.role)
    external = getattr(opts, "bootstrap", None) or ""
    port = getattr(opts, "bootstrap_port", None)
    if external and port is not None:
        raise ValueError("give --bootstrap (an external server) or --bootstrap-port (the "
                         "node's own), not both")  # fmt: skip
    admin = getattr(opts, "bootstrap_admin", False)
    if external and admin:
        raise ValueError("--bootstrap-admin applies to the bootstrap server this node hosts, "
                         "not to an external one (--bootstrap)")  # fmt: skip
    spec = NodeSpec(
        role=role, engine=engine_config(opts), dp=opts.dp, host=opts.host, port=opts.port,
        bootstrap=external, bootstrap_port=BOOTSTRAP_PORT if port is None else port,
        bootstrap_admin=admin,
        advertise=getattr(opts, "advertise_host", None),
        protocol=getattr(opts, "transport", "tcp"), ib_device=getattr(opts, "ib_device", ""),
        tunables=pd_tunables(tunable_overrides(opts)), model_name=opts.served_model_name,
        layerwise_interval=layerwise_interval(opts) if role is NodeRole.PREFILL else 0,
        prefill_early=not getattr(opts, "prefill_after_bootstrap", False),
        allow_bootstrap=tuple(getattr(opts, "allow_bootstrap", ())), http=http_limits(opts),
        max_queued_requests=opts.max_queued_requests,
    )  # fmt: skip

    def ready(url: str, info: NodeInfo) -> None:
        boot = f", bootstrap {info.bootstrap}" if info.bootstrap else ""
        boot += " served here" if info.bootstrap_hosted else ""
        _ready(role.value, url, f"tp={info.tp}, dp={info.dp}{boot}")

    return run_node(spec, ready)


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="checkpoint", type=model_path, default=SMOLLM2,
                   metavar="DIR|FILE.gguf|NAME",
                   help=f"the model the demo serves (default: {SMOLLM2}; tiny: the seeded "
                        "model, whose text is noise)")  # fmt: skip
    p.add_argument(
        "--prefill-tp",
        type=count,
        metavar="N",
        help="TP of the prefill node (default: 3 for smollm2-135m, 2 for tiny)",
    )
    p.add_argument("--decode-tp", type=count, default=1, metavar="N",
                   help="TP of the decode node (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-tokens", type=count, default=32,
                   help="tokens per answer at most (default: %(default)s)")  # fmt: skip
    p.add_argument("--layerwise-interval", type=steps, metavar="N",
                   help=f"the prefill node's: {LAYERWISE_HELP}")  # fmt: skip


def _demo_tp(opts: argparse.Namespace) -> tuple[int, int]:
    """The demo's (prefill TP, decode TP): P TP 3 -> D TP 1 for SmolLM2 (3 KV heads), P TP 2
    -> D TP 1 for the tiny model, unless given."""
    if opts.prefill_tp is None:
        opts.prefill_tp = 2 if opts.checkpoint is None else 3
    return opts.prefill_tp, opts.decode_tp


def _demo_local_argv(spec: DemoSpec, command: Sequence[str]) -> list[str]:
    """The ``local`` command the demo runs, on free ports."""
    ports = [f"--{r}-port" for r in ("router", "prefill", "decode", "bootstrap")]
    chosen = [] if spec.layerwise is None else ["--layerwise-interval", str(spec.layerwise)]
    model = [] if spec.model is None else ["--model", str(spec.model)]
    return [*command, "local", "--log-level", "warning",
            "--num-pages", "256", *model, *chosen,
            "--prefill-tp", str(spec.prefill_tp), "--decode-tp", str(spec.decode_tp),
            *(x for port in ports for x in (port, "0"))]  # fmt: skip


def _replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=f"http://127.0.0.1:{PORTS['router']}",
                   help="the router's base URL (default: %(default)s)")  # fmt: skip
    p.add_argument("--model", help="the served model name (default: the one the router "
                                   "serves, GET /v1/models)")  # fmt: skip
    g = p.add_argument_group("the requests (a window of a trace)")
    g.add_argument("--trace", default="azure-conv", metavar="NAME|FILE",
                   help="a tspd-sim trace: azure-conv, azure-code, mooncake, or a Mooncake "
                        ".jsonl / Azure .csv file (default: %(default)s)")  # fmt: skip
    g.add_argument("--start", type=float, default=0.0, metavar="S",
                   help="replay the requests arriving from S s into the trace on "
                        "(default: %(default)s)")  # fmt: skip
    g.add_argument("--requests", type=count, default=40, metavar="N",
                   help="how many of them (default: %(default)s)")  # fmt: skip
    g.add_argument("--rate", type=float, metavar="RPS",
                   help="rescale their arrivals to this mean rate, the bursts' shape kept "
                        "(default: the trace's own)")  # fmt: skip
    for what in ("input", "output"):
        g.add_argument(f"--{what}-scale", type=float, default=1.0, metavar="F",
                       help=f"{'prompt' if what == 'input' else 'output'} lengths times F, "
                            "at least 1 token (default: %(default)s)")  # fmt: skip
    g = p.add_argument_group("the run")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the synthesised prompts (default: %(default)s)")  # fmt: skip
    g.add_argument("--warmup", type=steps, default=1, metavar="N",
                   help="requests sent one by one first and not recorded: a fresh cluster's "
                        "first forwards are slower (default: %(default)s)")  # fmt: skip
    g.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds one request may take (default: %(default)s)")  # fmt: skip
    g.add_argument("--out", type=Path, default=Path("replay-results/requests.parquet"),
                   metavar="FILE", help="the per-request table (.parquet or .csv); replay.json "
                                        "goes beside it (default: %(default)s)")  # fmt: skip
    g.add_argument("--quiet", action="store_true", help="no line per finished request")


def _replay(opts: argparse.Namespace) -> int:
    from tspd_launch.replay import (
        Outcome,
        ReplayError,
        ReplaySpec,
        replay,
        select_trace,
        served_model,
        write_replay,
    )
    from tspd_sim.errors import SimError
    from tspd_sim.measured import figures, read_requests
    from tspd_sim.traces import load_trace

    url = opts.url.rstrip("/")
    try:
        trace = select_trace(load_trace(opts.trace), opts.start, opts.requests, opts.rate,
                             opts.input_scale, opts.output_scale)  # fmt: skip
        model = opts.model or asyncio.run(served_model(url))
        spec = ReplaySpec(url, model, opts.seed, opts.timeout, opts.warmup)
        print(f"replaying {len(trace)} requests of {trace.name} over {trace.duration_s:.1f} s "
              f"({trace.rate:.3g} req/s) against {url} ({model})", flush=True)  # fmt: skip

        def done(i: int, o: Outcome) -> None:
            if not opts.quiet:
                what = o.error or (f"TTFT {o.first_token_s - float(trace.arrival_s[i]):.3f} s, "
                                   f"{o.tokens} tokens")  # fmt: skip
                print(f"  request {i}: {what}", flush=True)

        outcomes, report = asyncio.run(replay(trace, spec, done))
        files = write_replay(opts.out, trace, outcomes, report)
    except (ReplayError, SimError, OSError) as exc:
        raise ValueError(str(exc)) from exc
    got = figures(read_requests(files[0]))
    load = f"{report.loadavg_before[0]:.2f} -> {report.loadavg_after[0]:.2f}"
    print(f"{report.completed} completed, {report.failed} failed; TTFT p50 "
          f"{got['ttft_p50_s']:.3f} s p90 {got['ttft_p90_s']:.3f} s, TPOT p50 "
          f"{1e3 * got['tpot_p50_s']:.1f} ms p90 {1e3 * got['tpot_p90_s']:.1f} ms, "
          f"{got['throughput_rps']:.3f} req/s; send lag max {report.send_lag_max_s:.3f} s; "
          f"load average {load}")  # fmt: skip
    print(f"wrote {files[0]} and {files[1]}")
    return 0 if report.failed == 0 else 1


def _watch_parent(parent: int) -> None:
    """Stop this role (as SIGTERM would) once the process that started it is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
