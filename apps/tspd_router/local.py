"""``launch_pd.py local``: a whole PD cluster on one machine, as supervised child processes.

Start order: the prefill and the decode node side by side (their rank processes import torch
and start transfer workers: the slow part; the prefill node hosts its bootstrap server, or,
with ``--standalone-bootstrap``, a bootstrap role starts first); then the router; then the
URLs and, last, ``local ready on <router url>``. SIGINT/SIGTERM (or a child that
dies on its own) stops them in reverse order with bounded waits (:mod:`.supervisor`).
"""

from __future__ import annotations

import argparse
import signal
import threading
from types import FrameType

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
        for group in (["bootstrap"], ["prefill", "decode"], ["router"]):
            spawned = [sup.spawn(role, argvs[role]) for role in group if role in argvs]
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
    sup.say("cluster stopped" + ("" if clean else " (some roles needed to be killed)"))
    return 1 if failed or not clean else 0


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
