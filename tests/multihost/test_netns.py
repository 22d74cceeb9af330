"""The namespace network itself (tests/multihost/netns.py): hosts reach each other only over
the bridge, a pulled cable silences a host, and nothing is left behind, a crashed run's
leftovers included."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from .netns import PREFIX, Network, clean_leftovers, ip, unavailable


@pytest.fixture(scope="module", autouse=True)
def _root_only() -> None:
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests: {why}")


def _namespaces() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


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
