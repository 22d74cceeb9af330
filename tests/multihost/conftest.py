"""A PD cluster spread over five network namespaces, each role started with
``apps/launch_pd.py`` inside its host's namespace, with the command line an operator would type
on that host (docs/OPERATIONS.md, "Several machines")::

    r  10.213.0.1  router :8000       (and this test's clients: the operator's "client host")
    b  10.213.0.2  bootstrap :8998    (the standalone rendezvous the prefill ranks register at)
    p  10.213.0.3  prefill :8100      TP 2, --bootstrap 10.213.0.2:8998
    d1 10.213.0.4  decode :8200       TP 1, --allow-bootstrap 10.213.0.2:8998
    d2 10.213.0.5  decode :8200       TP 1, --allow-bootstrap 10.213.0.2:8998

Every address and port is fixed, as on real hosts: each namespace is a fresh network stack of
this run's own, so no other process can hold a port there. The router checks its nodes every
0.5 s and takes a node out at the first failed check (5 s to answer, so a loaded machine does
not take a healthy node out), the decode nodes probe the bootstrap server every 2 s and declare
it dead at the first failure: the partition tests stay within seconds instead of the
production defaults' tens of seconds.

One cluster serves the whole module (scope "module"); each test starts by making it whole
(:meth:`Cluster.whole`: every link up, every node back in the router, the pools idle), so each
passes alone and in any order. The namespaces, links and processes go away at the end, also
after a failure; a crashed earlier run's are removed at the start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import torch

from tspd_testing.netns import Network, clean_leftovers, namespaces, unavailable

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "apps" / "launch_pd.py"
HOSTS = ("r", "b", "p", "d1", "d2")
#: The decode nodes' heartbeat on the bootstrap server (and the router's health checks).
HEARTBEAT_INTERVAL_S, HEARTBEAT_FAILURES = 2, 1
HEALTH_INTERVAL_S, HEALTH_FAILURES, HEALTH_TIMEOUT_S = 0.5, 1, 5.0
#: How long a decode room waits for its KV (the bound on pages an unreachable P holds on D).
WAITING_TIMEOUT_S = 20
START_TIMEOUT_S = 300.0


@dataclass
class Role:
    """One ``launch_pd.py`` process on one host."""

    name: str  #: "router", "bootstrap", "prefill", "decode"
    host: str
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        line = next(x for x in self.lines if x.startswith(f"{self.name} ready on "))
        return line.split()[3]

    def stop(self) -> None:
        """SIGTERM (the role stops its ranks and workers itself), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@dataclass
class Cluster:
    net: Network
    roles: dict[str, Role] = field(default_factory=dict)

    def address(self, host: str) -> str:
        return self.net.hosts[host].address

    def start(self, host: str, role: str, *args: str) -> Role:
        """``launch_pd.py ROLE --host <the host's address> ARGS`` inside ``host``."""
        argv = [sys.executable, str(LAUNCHER), role, "--log-level", "warning",
                "--host", self.address(host), *args]  # fmt: skip
        started = Role(role, host, self.net.popen(host, argv, dict(os.environ)))
        reader = (started.proc, started.lines, started.ready, f"{role} ready on ")
        threading.Thread(target=lines_of, args=reader, daemon=True).start()
        self.roles[host] = started
        return started

    def wait_ready(self, *hosts: str) -> None:
        for host in hosts:
            role = self.roles[host]
            marker = f"{role.name} ready on "
            if not role.ready.wait(START_TIMEOUT_S):
                raise AssertionError(f"{role.name} on {host} never got ready: {role.lines}")
            if not any(x.startswith(marker) for x in role.lines):  # its output ended first
                raise AssertionError(f"{role.name} on {host} exited before it was ready "
                                     f"(code {role.proc.wait(10)}): {role.lines}")  # fmt: skip

    def get(self, host: str, url: str, timeout: float = 10.0) -> requests.Response:
        """GET ``url`` from inside ``host``."""
        return self.net.call(host, lambda: requests.get(url, timeout=timeout))

    def url(self, host: str) -> str:
        return self.roles[host].url

    def stats(self, host: str) -> dict[str, float]:
        """A node's replica 0 ``/stats``, read on the node's own host (works while its link
        is down)."""
        body = self.get(host, self.url(host) + "/stats").json()
        return dict(body["replicas"][0])

    def router_nodes(self) -> dict[str, bool]:
        """host -> whether the router takes requests to its node now."""
        lines = self.get("r", self.url("r") + "/metrics").text.splitlines()
        by_url = {self.url(h): h for h in ("p", "d1", "d2")}
        healthy = {}
        for line in lines:
            if line.startswith("tspd_router_node_healthy{"):
                labels, value = line.rsplit(" ", 1)
                node = labels.split('node="', 1)[1].split('"', 1)[0]
                healthy[by_url[node]] = float(value) == 1
        return healthy

    def router_sent(self) -> dict[str, int]:
        """host -> how many requests the router has sent its node so far."""
        lines = self.get("r", self.url("r") + "/metrics").text.splitlines()
        by_url = {self.url(h): h for h in ("p", "d1", "d2")}
        sent = {}
        for line in lines:
            if line.startswith("tspd_router_node_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                node = labels.split('node="', 1)[1].split('"', 1)[0]
                sent[by_url[node]] = int(float(value))
        return sent

    def idle(self, host: str) -> bool:
        """Whether a node holds nothing: no request, no room, every page free."""
        s = self.stats(host)
        quiet = s["waiting"] == s["running"] == s["held"] == s["pd_rooms_tracked"] == 0
        return quiet and s["reclaimable_pages"] == s["initial_free_pages"] == s["total_pages"]

    def whole(self) -> None:
        """Every link up, every node in the router, every node idle (a test's starting point)."""
        for host in HOSTS:
            self.net.set_link(host, up=True)
        wait_until(lambda: all(self.router_nodes().values()), 60, "every node in the router")
        for host in ("p", "d1", "d2"):
            wait_until(lambda h=host: self.idle(h), 60, f"{host} idle")  # type: ignore[misc]


def lines_of(proc: subprocess.Popen[str], into: list[str], ready: threading.Event,
             marker: str) -> None:  # fmt: skip
    """Read ``proc``'s stdout into ``into`` (a reader thread's body); set ``ready`` once a line
    starts with ``marker``, or when the output ends (the process exited: the waiter looks for
    the marker to tell which)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append(line.rstrip("\n"))
        if line.startswith(marker):
            ready.set()
    ready.set()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``check`` every 0.1 s; the seconds it took. Fails after ``timeout``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests: {why}")
    clean_leftovers()
    torch.set_num_threads(1)  # the reference tokens are computed in this process
    with Network(HOSTS) as net:
        c = Cluster(net)
        try:
            _start(c)
            yield c
        finally:
            _stop(c)
    left = [n for n in namespaces() if n.startswith(net.tag)]
    assert not left, f"namespaces left behind: {left}"
    assert all(r.proc.poll() is not None for r in c.roles.values())


def _start(c: Cluster) -> None:
    """Everything at once, but the prefill node after the bootstrap server it registers at
    (the decode nodes and the router take theirs in when they come)."""
    boot = c.address("b")
    c.start("b", "bootstrap", "--port", "8998")
    for host in ("d1", "d2"):
        c.start(host, "decode", "--port", "8200", "--num-pages", "512",
                "--allow-bootstrap", f"{boot}:8998",
                "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
                "--heartbeat-failures", str(HEARTBEAT_FAILURES),
                "--waiting-timeout", str(WAITING_TIMEOUT_S))  # fmt: skip
    nodes = {h: f"http://{c.address(h)}:{port}" for h, port in
             (("p", 8100), ("d1", 8200), ("d2", 8200))}  # fmt: skip
    c.start("r", "router", "--port", "8000", "--prefill", nodes["p"], "--decode", nodes["d1"],
            "--decode", nodes["d2"], "--health-interval", str(HEALTH_INTERVAL_S),
            "--health-failures", str(HEALTH_FAILURES),
            "--health-timeout", str(HEALTH_TIMEOUT_S))  # fmt: skip
    c.wait_ready("b")
    c.start("p", "prefill", "--port", "8100", "--tp", "2", "--bootstrap", f"{boot}:8998",
            "--num-pages", "512", "--max-prefill-tokens", "128")  # fmt: skip
    c.wait_ready("p", "d1", "d2", "r")
    c.whole()


def _stop(c: Cluster) -> None:
    """Every role side by side (each stops its own ranks and workers; no request is left to
    drain), so the slowest stop is the module's teardown, not the sum of them."""
    roles = list(c.roles.values())
    with ThreadPoolExecutor(max(1, len(roles))) as pool:
        list(pool.map(Role.stop, roles))
