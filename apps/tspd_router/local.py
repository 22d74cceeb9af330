"""``launch_pd.py local``: a whole PD cluster on one machine, as supervised child processes.

:func:`local_children` turns the ``local`` flags into each role's ``launch_pd.py`` command
line, after checking both nodes' engine configs (TP against the model's heads, pages, the
context limit) so that a bad flag is refused before any child starts.

Start order: the prefill and the decode node side by side (their rank processes import torch
and start transfer workers: the slow part; the prefill node hosts its bootstrap server, or,
with ``--standalone-bootstrap``, a bootstrap role starts first); then the router; then the
URLs and, last, ``local ready on <router url>``. SIGINT/SIGTERM (or a child that
dies on its own) stops them in reverse order with bounded waits, the two nodes side by side
(:mod:`.supervisor`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from tspd_engine.cliargs import TUNABLE_FLAGS, engine_config
from tspd_engine.launch import check_config, free_port
from tspd_router.supervisor import StartError, Supervisor


def run_local(opts: argparse.Namespace, children: list[tuple[str, list[str]]]) -> int:
    """Run the cluster until a signal; 0 after a clean stop, 1 if a role failed."""
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
        argvs = dict(children)
        for i, group in enumerate((["bootstrap"], ["prefill", "decode"], ["router"])):
            spawned = [sup.spawn(role, argvs[role], i) for role in group if role in argvs]
            for child in spawned:
                urls[child.role] = sup.wait_ready(child, opts.start_timeout, stop)
        sup.say(_summary(opts, urls, argvs["prefill"]))
        while not stop.wait(0.5):
            dead = sup.dead()
            if dead is not None:
                code = dead.proc.returncode
                sup.say(f"{dead.role} exited on its own (code {code}); stopping the cluster")
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


def _unclean(sup: Supervisor) -> str:
    codes = [(c.role, c.proc.returncode) for c in sup.children if c.proc.returncode != 0]
    return ", ".join(f"{role} {'was killed' if code < 0 else f'exited with code {code}'}"
                     for role, code in codes)  # fmt: skip


def _summary(opts: argparse.Namespace, urls: dict[str, str], prefill: list[str]) -> str:
    hosted = []
    if "--bootstrap-port" in prefill:  # the prefill node serves it
        port = prefill[prefill.index("--bootstrap-port") + 1]
        hosted = [f"  bootstrap http://{opts.host}:{port} (served by the prefill node)"]
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


def local_children(opts: argparse.Namespace, launcher: Path) -> list[tuple[str, list[str]]]:
    """(role, argv) of each child of ``local``, in start order; ConfigError (a ValueError)
    for flags a node would refuse."""
    for tp in (opts.prefill_tp, opts.decode_tp):
        check_config(engine_config(opts, tp=tp))
    host = opts.host
    ports = {r: getattr(opts, f"{r}_port") or free_port(host)
             for r in ("bootstrap", "prefill", "decode", "router")}  # fmt: skip
    me = [sys.executable, str(launcher)]
    common = ["--log-level", opts.log_level, "--parent-pid", str(os.getpid())]
    node = ["--host", host, "--advertise-host", host, "--served-model-name",
            opts.served_model_name, *_engine_flags(opts)]  # fmt: skip
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
                     *boot, *_pd_flags(opts, "prefill")]),
        ("decode", [*me, "decode", *common, *node, "--port", str(ports["decode"]),
                    "--tp", str(opts.decode_tp), "--dp", str(opts.decode_dp),
                    *_pd_flags(opts, "decode")]),
        ("router", [*me, "router", *common, "--host", host, "--port", str(ports["router"]),
                    "--prefill", f"http://{host}:{ports['prefill']}",
                    "--decode", f"http://{host}:{ports['decode']}", "--policy", opts.policy,
                    "--model", opts.served_model_name]),
    ]  # fmt: skip


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
    return flags


def _pd_flags(opts: argparse.Namespace, role: str) -> list[str]:
    """The PD flags of one node: the transport, and the timeouts its own peer reads."""
    flags = ["--transport", opts.transport]
    if opts.ib_device:
        flags += ["--ib-device", opts.ib_device]
    if role == "prefill" and opts.layerwise_interval is not None:
        flags += ["--layerwise-interval", str(opts.layerwise_interval)]  # else: by its device
    for name, (_, reader, _) in TUNABLE_FLAGS.items():
        if reader == role and getattr(opts, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(opts, name))]
    return flags
