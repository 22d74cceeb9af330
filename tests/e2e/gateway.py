"""Start and stop the pieces of a mixed cluster as processes: tspd's launcher roles
(``apps/launch_pd.py prefill|decode|router``) and SGLang's model gateway (``sglang-router``,
the PyPI package's Rust binary, in PD mode), for tests/e2e/test_sglang_gateway*.py.

The gateway cannot bind port 0 (it refuses it for its API and its Prometheus listener), so
these helpers ask the OS for two free ports, start the gateway on them and, should another
process take one in between (the gateway then exits saying so), start it again on two others.
It is ready once ``GET /readiness`` counts both workers healthy: it has probed each with
``/health``, ``/server_info`` and ``/model_info``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import requests

from .conftest import LAUNCHER, child_env

#: How SGLang's gateway is started: the package's own entry point, from this interpreter.
GATEWAY = (sys.executable, "-m", "sglang_router", "launch")
#: The gateway looks each worker's model name up on Hugging Face for a tokenizer (it needs
#: none in PD mode, and warns when it finds none): pointed at a loopback port where nothing
#: listens, the look-up fails at once and nothing leaves the machine (not even a DNS query).
NO_HUB = {"HF_ENDPOINT": "http://127.0.0.1:9"}
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Proc:
    """A child process, its output collected by a thread; ``url`` once it said it is ready."""

    name: str
    proc: subprocess.Popen[str]
    url: str = ""
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(f"{self.name} ready on "):
                self.url = line.split()[3]
                self.ready.set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} never got ready: {self.lines[-20:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the whole process group (a node's ranks and workers with it)."""
        os.killpg(self.proc.pid, signal.SIGKILL)


def _spawn(name: str, argv: list[str], **env: str) -> Proc:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(**env), start_new_session=True)  # fmt: skip
    child = Proc(name, proc)
    threading.Thread(target=child.read, daemon=True).start()
    return child


def role(name: str, *args: str) -> Proc:
    """A launcher role on a port the OS picks (wait for it with :meth:`Proc.wait_ready`)."""
    argv = [sys.executable, str(LAUNCHER), name, "--log-level", "warning", "--port", "0", *args]
    return _spawn(name, argv)


def bootstrap_port(prefill_url: str) -> int:
    """A prefill node's bootstrap port, from its ``/info``."""
    info = requests.get(prefill_url + "/info", timeout=30).json()
    return int(info["bootstrap"].rpartition(":")[2])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gateway(prefill_url: str, decode_url: str, *extra: str) -> Proc:
    """SGLang's gateway in PD mode over one prefill node (its bootstrap port given, as the
    README's command gives it) and one decode node, ready (see the module docstring)."""
    port = bootstrap_port(prefill_url)
    for _ in range(3):
        api, metrics = _free_port(), _free_port()
        argv = [*GATEWAY, "--pd-disaggregation", "--prefill", prefill_url, str(port),
                "--decode", decode_url, "--host", "127.0.0.1", "--port", str(api),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
                "--log-level", "warn", *extra]  # fmt: skip
        child = _spawn("gateway", argv, **NO_HUB)
        child.url = f"http://127.0.0.1:{api}"
        if _ready(child):
            return child
        child.stop()
        if not any("Address already in use" in line for line in child.lines):
            raise AssertionError("the gateway never got ready:\n" + "\n".join(child.lines[-30:]))
    raise AssertionError("the gateway lost its ports three times in a row")


def _ready(child: Proc) -> bool:
    """Whether the gateway came up with both workers healthy (False: it exited)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            return False
        try:
            body = requests.get(child.url + "/readiness", timeout=5).json()
            if body.get("healthy_workers") == body.get("total_workers") == 2:
                return True
        except (requests.RequestException, ValueError):
            pass  # not listening yet
        time.sleep(0.2)
    raise AssertionError("the gateway's workers never got healthy:\n" + "\n".join(child.lines))


def stats(node_url: str) -> dict[str, float]:
    """Replica 0's counters (``GET /stats``)."""
    return dict(requests.get(node_url + "/stats", timeout=30).json()["replicas"][0])


def pool_whole(node_url: str) -> bool:
    """Nothing in flight on the node and every KV page free or reclaimable."""
    s = stats(node_url)
    idle = s["waiting"] == s["running"] == s["held"] == 0
    return (
        idle
        and s.get("pd_rooms_tracked", 0) == 0
        and s["reclaimable_pages"] == s["initial_free_pages"]
    )
