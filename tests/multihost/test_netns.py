"""The namespace network itself (tspd_testing.netns): hosts reach each other only over
the bridge, a pulled cable silences a host, and nothing is left behind, a crashed run's
leftovers included."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from tspd_core.pd.proc.control import ControlPlane
from tspd_testing import netns
from tspd_testing.netns import PREFIX, Network, clean_leftovers, ip, unavailable


@pytest.fixture(scope="module", autouse=True)
def _root_only() -> None:
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests: {why}")


def _namespaces() -> set[str]:
    return set(netns.namespaces())


def _connect(net: Network, host: str, address: str, port: int, timeout: float) -> str:
    """Connect from ``host``: "ok", "refused" or "timeout"."""

    def attempt() -> str:
        try:
            socket.create_connection((address, port), timeout=timeout).close()
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return "timeout"
        return "ok"

    return net.call(host, attempt)


def test_hosts_reach_each_other_until_a_cable_is_pulled_and_leave_nothing_behind() -> None:
    with Network(("a", "b")) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        assert (a.address, b.address) == ("10.213.0.1", "10.213.0.2")
        listener = net.call("b", lambda: socket.create_server((b.address, 0)))
        port = listener.getsockname()[1]
        assert _connect(net, "a", b.address, port, 5) == "ok"
        assert _connect(net, "a", b.address, port + 1 if port < 65535 else 1, 5) == "refused"
        net.set_link("b", up=False)  # a pulled cable: no answer at all, not a refusal
        assert _connect(net, "a", b.address, port, 1) == "timeout"
        net.set_link("b", up=True)
        assert _connect(net, "a", b.address, port, 5) == "ok"
        # The addresses exist only inside the namespaces, not here.
        with pytest.raises(OSError, match="Cannot assign requested address"):
            socket.create_server((b.address, 0))
        listener.close()
        proc = net.popen("a", [sys.executable, "-c", "import time; time.sleep(600)"], env={})
        names = {h.netns for h in net.hosts.values()} | {net.bridge_ns}
        assert names <= _namespaces()
    assert proc.poll() is not None  # killed with its namespace
    assert not names & _namespaces()


def test_a_crashed_runs_namespaces_are_removed_and_a_live_runs_kept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    stale = f"{PREFIX}{dead}-p"
    ours = Network(("x",)).up()
    try:
        ip("netns", "add", stale)
        assert clean_leftovers() == [stale]
        assert stale not in _namespaces()
        assert ours.hosts["x"].netns in _namespaces()  # this process still runs
    finally:
        ours.down()
        ip("netns", "del", stale, check=False)


#: A process that builds a network of one host, starts a process there, reports the network's
#: tag and that process's pid, and waits (for the SIGKILL that ends it without a teardown).
#: It loads netns.py by path: the module needs only the standard library.
OWNER = """
import sys
sys.path.insert(0, {folder!r})
import netns
net = netns.Network(("a",)).up()
sleeper = net.popen("a", [sys.executable, "-c", "import time; time.sleep(600)"], env={{}})
print(net.tag, sleeper.pid, flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (absent, or a zombie its new parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_owners_network_is_removed_by_its_reaper() -> None:
    script = OWNER.format(folder=str(Path(netns.__file__).parent))
    owner = subprocess.Popen([sys.executable, "-I", "-S", "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert owner.stdout is not None
        tag, pid = owner.stdout.readline().split()
        ours = {f"{tag}-a", f"{tag}-br"}
        assert ours <= _namespaces()
        assert not _gone(int(pid))
        owner.send_signal(signal.SIGKILL)  # no teardown ran: the reaper acts alone
        owner.wait(10)
        deadline = time.monotonic() + 30
        while (ours & _namespaces() or not _gone(int(pid))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ours & _namespaces()
        assert _gone(int(pid))  # what ran in the namespace was killed with it
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        clean_leftovers()  # whatever the reaper did not (the owner is gone)


def _connections(net: Network, host: str, peer: str, port: int) -> list[str]:
    """The states of ``host``'s TCP connections to ``peer:port`` (``ss -tanH``)."""
    cmd = ["ip", "netns", "exec", net.hosts[host].netns, "ss", "-tanH", "dst", f"{peer}:{port}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _wait(what: str, ok: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def test_a_peer_link_cut_mid_send_is_given_up_and_made_anew_once_the_cable_is_back() -> None:
    """A control-plane PUSH connection whose frame went into a cut link is dropped after
    UNACKED_TIMEOUT_MS (TCP_USER_TIMEOUT), not kept for TCP's backed-off retransmissions
    (about 15 min before Linux gives up), and a new one carries the next frame once the cable
    is back. Without the timeout the connection stays ESTABLISHED through the whole cut."""
    with Network(("d", "p")) as net:
        d, p = net.hosts["d"], net.hosts["p"]
        # A context per host, made on a thread inside it: its I/O threads (which own the
        # sockets' connections) start from the first socket, in that namespace.
        rx = net.call("p", lambda: ControlPlane(p.address, zmq.Context()))
        tx = net.call("d", lambda: ControlPlane(d.address, zmq.Context()))
        try:
            net.call("d", lambda: tx.send(p.address, rx.port, [b"before"]))
            assert rx.recv(30_000) == [b"before"]
            assert _connections(net, "d", p.address, rx.port) == ["ESTAB"]
            net.set_link("p", up=False)
            net.call("d", lambda: tx.send(p.address, rx.port, [b"into the cut"]))
            _wait("the connection given up while the cable is out",
                  lambda: "ESTAB" not in _connections(net, "d", p.address, rx.port))  # fmt: skip
            net.set_link("p", up=True)
            net.call("d", lambda: tx.send(p.address, rx.port, [b"after"]))
            # The frame written into the cut went with its connection; the next one arrives
            # on a new connection.
            assert rx.recv(60_000) == [b"after"]
            assert _connections(net, "d", p.address, rx.port) == ["ESTAB"]
        finally:
            tx.close()
            rx.close()
