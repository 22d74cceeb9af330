"""``tspd-launch local``: a whole PD cluster on one machine, as supervised child processes.

:func:`check_local` checks both nodes' engine configs (TP against the model's heads, pages,
the context limit) so that a bad flag is refused before any child starts; :func:`child_argv`
turns the ``local`` flags into one role's launcher command line.

Ports: each role gets its own ``--*-port`` flag as given; with 0 (any free port) the child
binds one itself and reports it in its readiness line, so the launcher never picks a port
that another process could take before the child binds it. That is why a role starts only
once the roles whose URLs it needs are ready: the router after both nodes, a prefill node
after a standalone bootstrap server.

Start order: the prefill and the decode node side by side (their rank processes import torch
and start transfer workers: the slow part; the prefill node hosts its bootstrap server, or,
with ``--standalone-bootstrap``, a bootstrap role starts first); then the router; then the
URLs and, last, ``local ready on <router url>``. SIGINT/SIGTERM stops them in reverse order
with bounded waits, the two nodes side by side (:mod:`.supervisor`).

A role that exits on its own (a node whose rank died exits with code 3) is named with its
exit code, and then either the whole cluster stops (the default; ``local`` exits 1) or, with
``--restart``, that role alone starts again on the same ports (so the router, the other node
and clients find it where it was) — up to ``--max-restarts`` times per role, after which the
cluster stops. A restarted node is taken back by the router at its next good health check.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from tspd_engine.model.build import resolve_model
from tspd_engine.model.tp import valid_tp_sizes
from tspd_engine.node.cliargs import TUNABLE_FLAGS, engine_config
from tspd_engine.rank.launch import check_config
from tspd_engine.rank.steps import check_writable
from tspd_launch.supervisor import Child, StartError, Supervisor
from tspd_serving.errors import ConfigError
from tspd_serving.models import model_name


def run_local(opts: argparse.Namespace, launcher: Sequence[str]) -> int:
    """Run the cluster until a signal; 0 after a clean stop, 1 if a role failed.
    ``launcher``: the command that starts a role (:class:`tspd_launch.cli.Entry`)."""
    sup = Supervisor(stop_timeout_s=opts.stop_timeout)
    stop = threading.Event()
    caught: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        caught.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    failed = False
    try:
        urls: dict[str, str] = {}
        for i, group in enumerate(start_groups(opts)):
            argvs = [(role, child_argv(opts, launcher, role, urls)) for role in group]
            spawned = [sup.spawn(role, argv, i) for role, argv in argvs]
            for child in spawned:
                urls[child.role] = sup.wait_ready(child, opts.start_timeout, stop)
        sup.say(_summary(opts, urls, sup))
        while not stop.wait(0.5):
            dead = sup.dead()
            if dead is not None and not _revive(sup, dead, opts, stop):
                failed = True
                break
    except StartError as exc:
        failed = not caught
        sup.say(f"{'stopping' if caught else 'error'}: {exc}")
    if caught:
        sup.say(f"{caught[0]} received: stopping the cluster")
    clean = sup.stop_all()
    sup.say("cluster stopped" + ("" if clean else f" ({_unclean(sup)})"))
    return 1 if failed or not clean else 0


def _revive(sup: Supervisor, dead: Child, opts: argparse.Namespace, stop: threading.Event) -> bool:
    """Restart a role that exited on its own, saying so; False (said why) to stop instead."""
    code = dead.proc.returncode
    what = f"{dead.role} exited on its own (code {code})"
    if not opts.restart:
        sup.say(f"{what}; stopping the cluster (--restart would restart it)")
        return False
    if dead.restarts >= opts.max_restarts:
        sup.say(f"{what}; it was restarted {dead.restarts} times already: stopping the cluster")
        return False
    sup.say(f"{what}; restarting it (restart {dead.restarts + 1} of {opts.max_restarts})")
    started = time.monotonic()
    fresh = sup.respawn(dead, pinned_argv(dead))
    try:
        sup.wait_ready(fresh, opts.start_timeout, stop)
    except StartError as exc:
        sup.say(f"{dead.role} could not be restarted: {exc}; stopping the cluster")
        return False
    sup.say(f"{dead.role} restarted in {time.monotonic() - started:.1f} s on {fresh.url}")
    return True


def pinned_argv(child: Child) -> list[str]:
    """``child``'s command line with the ports it bound (``--port``, and a prefill node's
    ``--bootstrap-port``) fixed, so that a restart comes back where the others look for it."""
    argv = list(child.argv)
    pins = {"--port": (child.url or "").rsplit(":", 1)[-1]}
    hosted = re.search(r"bootstrap \S+:(\d+) served here", child.line)
    if hosted:
        pins["--bootstrap-port"] = hosted.group(1)
    for flag, value in pins.items():
        if flag in argv and value.isdigit():
            argv[argv.index(flag) + 1] = value
    return argv


def _unclean(sup: Supervisor) -> str:
    codes = [
        (c.role, c.proc.returncode) for c in sup.children if c.proc.returncode not in (0, None)
    ]
    return ", ".join(f"{role} {'was killed' if code < 0 else f'exited with code {code}'}"
                     for role, code in codes)  # fmt: skip


def _summary(opts: argparse.Namespace, urls: dict[str, str], sup: Supervisor) -> str:
    hosted = []
    prefill = next(c for c in sup.children if c.role == "prefill")
    served = re.search(r"bootstrap (\S+) served here", prefill.line)
    if served:  # the prefill node serves it (its readiness line names the bound address)
        hosted = [f"  bootstrap http://{served.group(1)} (served by the prefill node)"]
    # The ready line comes last: whoever waits for it (the demo, tests) has read every URL.
    lines = [
        *hosted,
        *(f"  {role:<9} {url}" for role, url in urls.items()),
        "  try:  curl " + urls["router"] + "/v1/completions -H 'Content-Type: application/json'"
        f' -d \'{{"model": "{opts.served_model_name}", "prompt": "Hello"}}\'',
        "  Ctrl-C stops every role.",
        f"local ready on {urls['router']} (router; prefill tp={opts.prefill_tp} -> "
        f"decode tp={opts.decode_tp}, model {opts.served_model_name!r})",
    ]
    return "\n".join(lines)


def check_local(opts: argparse.Namespace) -> None:
    """Refuse flags either node would refuse (ConfigError, a ValueError), before any child
    starts."""
    local_defaults(opts)
    for tp in (opts.prefill_tp, opts.decode_tp):
        check_config(engine_config(opts, tp=tp))
    if opts.step_logs is not None:
        try:
            opts.step_logs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--step-logs {opts.step_logs}: {exc.strerror}") from exc
        for role in ("prefill", "decode"):
            check_writable(step_log_of(opts, role))


def step_log_of(opts: argparse.Namespace, role: str) -> Path:
    """Where ``role``'s node writes its step log under ``--step-logs``."""
    path: Path = opts.step_logs / f"{role}.csv"
    return path


def local_defaults(opts: argparse.Namespace) -> None:
    """Fill what depends on the model (idempotent): the served name, and the prefill TP: 2,
    or the next size the model splits over (3 for SmolLM2's 3 KV heads)."""
    if opts.served_model_name is None:
        opts.served_model_name = model_name(opts.checkpoint)
    if opts.prefill_tp is None:
        sizes = valid_tp_sizes(resolve_model(engine_config(opts, tp=1)))
        opts.prefill_tp = 2 if 2 in sizes else next((n for n in sizes if n > 1), 1)


def start_groups(opts: argparse.Namespace) -> list[tuple[str, ...]]:
    """The roles of ``local`` in start order, side by side within a group."""
    first = [("bootstrap",)] if opts.standalone_bootstrap else []
    return [*first, ("prefill", "decode"), ("router",)]


def child_argv(
    opts: argparse.Namespace, launcher: Sequence[str], role: str, urls: Mapping[str, str]
) -> list[str]:
    """The command line of ``role`` (``launcher``, then the role and its flags); ``urls``: the
    ready URLs of the roles started before it (the router's nodes, a prefill node's standalone
    bootstrap server)."""
    local_defaults(opts)
    host = opts.host
    me = list(launcher)
    common = ["--log-level", opts.log_level, "--parent-pid", str(os.getpid()),
              "--header-timeout", str(opts.header_timeout)]  # fmt: skip
    if role != "bootstrap":  # its bodies are small registrations: it keeps its own limit
        common += ["--body-timeout", str(opts.body_timeout)]
    port = ["--port", str(getattr(opts, f"{role}_port"))]  # 0: the child picks as it binds
    admin = getattr(opts, "bootstrap_admin", False)
    if role == "bootstrap":
        return [*me, "bootstrap", *common, "--host", host, *port, *(["--admin"] * admin)]
    if role == "router":
        # The router tokenizes and renders chat templates with the nodes' model.
        tokenizer = [] if opts.checkpoint is None else ["--tokenizer", str(opts.checkpoint)]
        return [*me, "router", *common, "--host", host, *port, "--prefill", urls["prefill"],
                "--decode", urls["decode"], "--policy", opts.policy,
                "--model", opts.served_model_name, *tokenizer, "--chat-content-special-tokens",
                opts.chat_content_special_tokens]  # fmt: skip
    tp, dp = (str(getattr(opts, f"{role}_{x}")) for x in ("tp", "dp"))
    node = [*me, role, *common, "--host", host, "--advertise-host", host, *port,
            "--served-model-name", opts.served_model_name, *_engine_flags(opts),
            "--tp", tp, "--dp", dp,
            "--max-queued-requests", str(opts.max_queued_requests)]  # fmt: skip
    if opts.step_logs is not None:
        node += ["--step-log", str(step_log_of(opts, role))]
    if role == "decode":
        return [*node, *_pd_flags(opts, "decode")]
    boot = ["--bootstrap-port", str(opts.bootstrap_port), *(["--bootstrap-admin"] * admin)]
    if opts.standalone_bootstrap:
        boot = ["--bootstrap", urls["bootstrap"].removeprefix("http://")]
    return [*node, *boot, *_pd_flags(opts, "prefill")]


def _engine_flags(opts: argparse.Namespace) -> list[str]:
    cfg = engine_config(opts, tp=1)
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
    flags += ["--no-batch-sched"] if not cfg.batch_sched else []
    return flags


def _pd_flags(opts: argparse.Namespace, role: str) -> list[str]:
    """The PD flags of one node: the transport, and the timeouts its own peer reads."""
    flags = ["--transport", opts.transport]
    if opts.ib_device:
        flags += ["--ib-device", opts.ib_device]
    if role == "prefill" and opts.layerwise_interval is not None:
        flags += ["--layerwise-interval", str(opts.layerwise_interval)]  # else: by its device
    if role == "prefill" and opts.prefill_after_bootstrap:
        flags += ["--prefill-after-bootstrap"]
    for name, (_, reader, _) in TUNABLE_FLAGS.items():
        if reader == role and getattr(opts, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(opts, name))]
    return flags
