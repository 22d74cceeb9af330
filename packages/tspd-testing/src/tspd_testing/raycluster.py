"""A real Ray cluster on this machine, for the simulator's tests and benchmarks: a head node
and worker nodes, each a ``ray start`` of its own with one CPU, on loopback addresses of
their own (127.0.0.2, 127.0.0.3, ...: Ray maps 127.0.0.1 to the host's outside address, any
other loopback address it keeps), every file under one temporary directory (removed by
:meth:`RayCluster.stop`).

``ray start`` leaves its processes running as daemons; this harness finds a node's by their
command lines (the temporary directory and the node's address) and its raylet's
descendants, so it stops exactly what it started (never ``ray stop``, which stops every Ray
process of the machine). :meth:`RayCluster.kill_node` SIGKILLs a worker node's processes as a
host dying would; :meth:`busy` says whether a node's worker process is running a task of a
given function (Ray titles it ``ray::<function>`` meanwhile).

Not thread-safe: one thread drives a cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: The loopback address of node i (0: the head).
FIRST_ADDRESS = 2


def _ray_cli() -> str:
    ray = Path(sys.executable).parent / "ray"
    if ray.exists():
        return str(ray)
    found = shutil.which("ray")
    if found is None:
        raise RuntimeError("the ray command is missing: install tspd-sim's ray extra")
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not died (gone, a zombie or dying: not)."""
    return _stat(pid)[0] not in ("", "Z", "X")


def _dead(pids: list[int], timeout: float) -> bool:
    """Wait until every process of ``pids`` is gone or a zombie; whether they all are."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent pid) of a live process; ("", 0) when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "", 0
    return fields[0], int(fields[1])


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


@dataclass
class RayCluster:
    """A head (node 0) and worker nodes; :attr:`address` is the head's ``HOST:PORT``."""

    root: Path
    address: str = ""
    nodes: list[str] = field(default_factory=list)  #: each node's IP, the head's first
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, workers: int = 1) -> RayCluster:
        """A head and ``workers`` worker nodes, alive. Their directory is a fresh one under
        /tmp: Ray's socket paths must fit AF_UNIX's 107 bytes, which a test's tmp_path
        does not leave room for."""
        cluster = cls(Path(tempfile.mkdtemp(prefix="tspd-ray-", dir="/tmp")))
        cluster.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        try:
            cluster._start_node(head=True)
            for _ in range(workers):
                cluster._start_node(head=False)
            cluster.wait_nodes(len(cluster.nodes), 120)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_node(self, head: bool) -> None:
        ip = f"127.0.0.{FIRST_ADDRESS + len(self.nodes)}"
        argv = [_ray_cli(), "start", "--num-cpus=1", f"--node-ip-address={ip}",
                f"--temp-dir={self.root}", "--disable-usage-stats"]  # fmt: skip
        if head:
            argv += ["--head", "--port=0", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        self.nodes.append(ip)
        out = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"ray start ({ip}) failed:\n{out.stdout}\n{out.stderr}")
        if head:
            self.address = (self.root / "ray_current_cluster").read_text().strip()

    def alive_nodes(self) -> int:
        """Nodes the head counts alive (asked by a driver of its own)."""
        # Ray may print its own notices to stdout too (one ends "... workload."): the count
        # is the line that starts with the marker.
        code = (f"import ray; ray.init(address={self.address!r}, logging_level='error'); "
                "print('alive nodes:', sum(n['Alive'] for n in ray.nodes()))")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=self.env, timeout=120)  # fmt: skip
        counts = [line.split(":", 1)[1] for line in out.stdout.splitlines()
                  if line.startswith("alive nodes:")]  # fmt: skip
        return int(counts[-1]) if out.returncode == 0 and counts else -1

    def wait_nodes(self, n: int, timeout: float) -> None:
        start = time.monotonic()
        while self.alive_nodes() != n:
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the Ray cluster did not reach {n} alive nodes in {timeout} s")
            time.sleep(0.5)

    # -- processes ---------------------------------------------------------------------------

    def raylet(self, node: int) -> int:
        """The pid of node ``node``'s raylet (0 when it is gone)."""
        ip = self.nodes[node]
        for pid in _pids():
            line = _cmdline(pid)
            if (_comm(pid) == "raylet" and f"--temp_dir={self.root} " in line
                    and f"--node_ip_address={ip} " in line
                    and _alive(pid)):  # fmt: skip
                return pid
        return 0

    def descendants(self, pid: int) -> list[int]:
        parents = {p: _stat(p)[1] for p in _pids()}
        out, todo = [], [pid]
        while todo:
            parent = todo.pop()
            children = [p for p, pp in parents.items() if pp == parent]
            out += children
            todo += children
        return out

    def busy(self, node: int, function: str) -> bool:
        """Whether a worker process of node ``node`` runs a task of ``function`` now."""
        raylet = self.raylet(node)
        return raylet > 0 and any(
            _comm(pid).startswith(f"ray::{function}"[:15]) for pid in self.descendants(raylet)
        )

    def kill_node(self, node: int, timeout: float = 30) -> None:
        """SIGKILL a worker node: its raylet and every process under it, and the node's
        own daemons (those naming its address); returns once each of them has died (a
        SIGKILLed process lingers a moment while the kernel tears it down)."""
        assert node > 0, "the head is not killed: the cluster would be gone"
        raylet = self.raylet(node)
        victims = [raylet, *self.descendants(raylet)] if raylet else []
        ip = self.nodes[node]
        victims += [p for p in _pids() if str(self.root) in _cmdline(p)
                    and f"={ip} " in _cmdline(p) + " "]  # fmt: skip
        for pid in dict.fromkeys(victims):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not _dead(victims, timeout):
            raise RuntimeError(f"node {node}'s processes outlived SIGKILL for {timeout} s")

    def stop(self) -> None:
        """SIGKILL every process of the cluster (those naming its directory, and theirs)."""
        mine = [p for p in _pids() if str(self.root) in _cmdline(p) and p != os.getpid()]
        victims = [*mine, *(c for p in mine for c in self.descendants(p))]
        for pid in dict.fromkeys(victims):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _dead(victims, 30)
        shutil.rmtree(self.root, ignore_errors=True)
