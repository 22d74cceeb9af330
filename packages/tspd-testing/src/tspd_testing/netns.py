"""Hosts on one machine: Linux network namespaces, one per host, joined by veth pairs to a
bridge, built with iproute2 (``ip``, ``ss``) and torn down completely. Root only (see
:func:`unavailable`); tests/multihost and the transfer benchmark's veth column use it.

::

    namespace <tag>-br:  bridge "br0" ─┬─ veth "r" ┄┄┄ eth0 10.213.0.1/24  namespace <tag>-r
                                       ├─ veth "b" ┄┄┄ eth0 10.213.0.2/24  namespace <tag>-b
                                       ├─ veth "p" ┄┄┄ eth0 10.213.0.3/24  namespace <tag>-p
                                       └─ ...          (<tag>: tspdmh-<pid>-<n>)

Each host namespace has ``lo`` (up) and ``eth0``, nothing else: no default route, no other
address, so a process that listens or connects anywhere but its host's own address or
loopback fails there instead of working by accident as it would on one machine. The bridge
lives in a namespace of its own, so nothing outside those namespaces changes; the subnet is
the same for every network because no two networks share a bridge.

A host's **link** is its veth's bridge end: taking it down is a pulled cable (the host's
packets are dropped silently, nobody gets a reset), bringing it up reconnects the host with
its addresses, sockets and processes intact.

Names carry the pid of the process that made them and a serial (``<n>``: two networks of one
process never share a name), so concurrent runs never touch each other's namespaces. Nothing
is left behind when the process ends without :meth:`Network.down` either: each network has a
**reaper**, a small process in a session of its own that holds the read end of a pipe from
its owner and, once the pipe closes (the owner exited, was killed or was interrupted twice),
deletes the network's namespaces, killing what still runs in them. :func:`clean_leftovers`
removes any a run's reaper could not (it was killed too), by owner pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

PREFIX = "tspdmh-"
SUBNET = "10.213.0"  #: a /24 no real network here uses; only ever configured inside the namespaces
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
T = TypeVar("T")
_SERIAL = itertools.count()


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its stdout. A failure raises with ip's own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str:
    """Why this machine cannot build the network ("" when it can): not root, no iproute2,
    or namespaces refused (a container without the capability)."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    try:
        ip("-V")
        subprocess.run(["ss", "-V"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        return "needs iproute2 (ip, ss): scripts/ensure-system-deps installs it"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")
    except RuntimeError as exc:
        return f"ip netns refused here: {exc}"
    finally:
        ip("netns", "del", probe, check=False)
    return ""


def _owner(name: str) -> int | None:
    """The pid a namespace name carries (``tspdmh-<pid>-...``), None if it is not ours."""
    if not name.startswith(PREFIX):
        return None
    pid = name[len(PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(name: str) -> None:
    """Kill what runs in namespace ``name`` (it was started there by this module's runs), then
    delete it (its veth ends go with it)."""
    for _ in range(50):
        pids = [int(p) for p in ip("netns", "pids", name, check=False).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    ip("netns", "del", name, check=False)


def namespaces() -> list[str]:
    """Every network namespace's name (``ip netns list``)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def clean_leftovers() -> list[str]:
    """Delete every namespace of ours whose run is gone; the names deleted."""
    stale = [n for n in namespaces() if (pid := _owner(n)) is not None and not _alive(pid)]
    for name in stale:
        _delete(name)
    return stale


@dataclass(frozen=True)
class Host:
    name: str  #: short name: "p", "d1", ...
    netns: str  #: its namespace
    address: str  #: eth0's address


@dataclass
class Network:
    """The namespaces, their links, and ways to act inside them (see the module docstring).

    ``hosts`` maps a short name to the last byte of its address. Build with :meth:`up` (or use
    as a context manager); :meth:`down` removes everything, also after a failed :meth:`up`.
    """

    names: Sequence[str]
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{next(_SERIAL)}")
    hosts: dict[str, Host] = field(init=False, default_factory=dict)
    _pools: dict[str, ThreadPoolExecutor] = field(init=False, default_factory=dict)
    _procs: list[subprocess.Popen[str]] = field(init=False, default_factory=list)
    _reaper: subprocess.Popen[bytes] | None = field(init=False, default=None)

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    def up(self) -> Network:
        try:
            self._reaper = _start_reaper(self.tag)
            ip("netns", "add", self.bridge_ns)
            ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge_ns, "link", "set", "dev", "br0", "up")
            for i, name in enumerate(self.names, start=1):
                self._add_host(name, f"{SUBNET}.{i}")
        except BaseException:
            self.down()
            raise
        return self

    def _add_host(self, name: str, address: str) -> None:
        host = Host(name, f"{self.tag}-{name}", address)
        ip("netns", "add", host.netns)
        self.hosts[name] = host
        ip("link", "add", "eth0", "netns", host.netns, "type", "veth",
           "peer", "name", name, "netns", self.bridge_ns)  # fmt: skip
        ip("-n", self.bridge_ns, "link", "set", "dev", name, "master", "br0")
        ip("-n", self.bridge_ns, "link", "set", "dev", name, "up")
        ip("-n", host.netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "dev", "eth0", "up")
        ip("-n", host.netns, "link", "set", "dev", "lo", "up")

    def down(self) -> None:
        """Stop every process started here, shut the helper threads, delete the namespaces."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for host in self.hosts.values():
            _delete(host.netns)
        _delete(self.bridge_ns)
        if self._reaper is not None:  # nothing left for it: let it go
            assert self._reaper.stdin is not None
            self._reaper.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(30)
            self._reaper = None

    def __enter__(self) -> Network:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- acting on a host -------------------------------------------------------------

    def popen(self, name: str, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
        """Start ``argv`` inside host ``name`` (``ip netns exec``: it execs, so the process is
        argv's own), in a session of its own; stdout is a pipe, stderr inherited."""
        cmd = ["ip", "netns", "exec", self.hosts[name].netns, *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # fmt: skip
        self._procs.append(proc)
        return proc

    def call(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread inside host ``name``'s namespace (a socket belongs to the
        namespace of the thread that creates it): how this process acts as a client there."""
        if name not in self._pools:
            netns = self.hosts[name].netns
            self._pools[name] = ThreadPoolExecutor(
                4, thread_name_prefix=f"netns-{name}", initializer=_enter, initargs=(netns,)
            )
        return self._pools[name].submit(fn).result()

    def set_link(self, name: str, up: bool) -> None:
        """Plug (``up``) or pull the cable of host ``name``."""
        ip("-n", self.bridge_ns, "link", "set", "dev", name, "up" if up else "down")

    def counters(self, name: str) -> tuple[int, int]:
        """(received, sent) bytes on host ``name``'s eth0 since it was made."""
        (link,) = json.loads(ip("-n", self.hosts[name].netns, "-j", "-s", "link", "show", "eth0"))
        stats = link["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def listening(self, name: str) -> list[Listener]:
        """Every TCP socket listening in host ``name``'s namespace (``ss -ltnp``)."""
        cmd = ["ip", "netns", "exec", self.hosts[name].netns, "ss", "-ltnpH"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout
        return [Listener.parse(line) for line in out.splitlines() if line.strip()]


def _enter(netns: str) -> None:
    """Move the calling thread into ``netns`` (setns(2) changes the calling thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Listener:
    """One line of ``ss -ltnpH``: the local address and port, and the owning pids."""

    address: str
    port: int
    pids: frozenset[int]

    @classmethod
    def parse(cls, line: str) -> Listener:
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        pids = frozenset(int(p.split(",")[0]) for p in line.split("pid=")[1:])
        return cls(address.strip("[]"), int(port), pids)

    @property
    def wildcard(self) -> bool:
        return self.address in ("0.0.0.0", "*", "::")


# ---- the reaper -----------------------------------------------------------------------------


def _start_reaper(tag: str) -> subprocess.Popen[bytes]:
    """This file run as a script (standard library only, so it starts in milliseconds) in a
    session of its own, so neither a signal to this process's group nor this process's death
    reaches it; its stdin is the pipe whose end tells it to act."""
    argv = [sys.executable, "-I", "-S", __file__, "reap", tag]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


def _reap(tag: str) -> None:
    """Wait for stdin to close, then delete every namespace named ``<tag>-*``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    for name in namespaces():
        if name.startswith(f"{tag}-"):
            _delete(name)


if __name__ == "__main__":
    if sys.argv[1:2] == ["reap"] and len(sys.argv) == 3:
        _reap(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} reap TAG")
