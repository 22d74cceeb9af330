"""SGLang's model gateway (``sglang-router``, the PyPI package's Rust binary) in PD mode in
front of tspd nodes, for the benchmarks' third front (``bench_e2e``: tspd's router vs the
gateway, same nodes' kind, same load).

The gateway cannot bind port 0 (it refuses it for its API and its Prometheus listener): two
free ports are asked of the OS, and should another process take one in between (the gateway
then exits saying so), it is started again on two others. It is ready once ``GET /readiness``
counts every worker healthy.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import requests

READY_TIMEOUT_S = 120.0
#: The gateway looks each worker's model name up on Hugging Face for a tokenizer (it needs
#: none in PD mode): pointed at a loopback port where nothing listens, the look-up fails at
#: once and nothing leaves the machine.
NO_HUB = {"HF_ENDPOINT": "http://127.0.0.1:9"}


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    url: str
    log: str  #: its output, a file

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_gateway(prefill: str, decode: str) -> Gateway:
    """The gateway over one prefill node (its bootstrap port from its ``/info``) and one
    decode node, ready."""
    info = requests.get(prefill + "/info", timeout=30).json()
    bootstrap = info["bootstrap"].rpartition(":")[2]
    for _ in range(3):
        api, metrics = _free_port(), _free_port()
        argv = [sys.executable, "-m", "sglang_router", "launch", "--pd-disaggregation",
                "--prefill", prefill, bootstrap, "--decode", decode, "--host", "127.0.0.1",
                "--port", str(api), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics), "--log-level", "warn"]  # fmt: skip
        with tempfile.NamedTemporaryFile(prefix="gateway-", suffix=".log", delete=False) as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=os.environ | NO_HUB, start_new_session=True)  # fmt: skip
        gateway = Gateway(proc, f"http://127.0.0.1:{api}", log.name)
        if _ready(gateway):
            return gateway
        gateway.stop()
        with open(log.name) as f:
            said = f.read()
        if "Address already in use" not in said:
            raise SystemExit(f"the gateway did not start:\n{said[-3000:]}")
    raise SystemExit("the gateway lost its ports three times in a row")


def _ready(gateway: Gateway) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if gateway.proc.poll() is not None:
            return False
        try:
            body = requests.get(gateway.url + "/readiness", timeout=5).json()
            if body.get("total_workers") and body.get("healthy_workers") == body["total_workers"]:
                return True
        except (requests.RequestException, ValueError):
            pass  # not listening yet
        time.sleep(0.2)
    raise SystemExit(f"the gateway's workers never got healthy (its log: {gateway.log})")
