"""Where a prefill node's bootstrap server lives: in the node (the default, wire.md §3) or in the
standalone ``bootstrap`` role (the refusal when the node's own server cannot bind is in
test_launcher_cli.py).

Real processes throughout: ``launch_pd.py`` roles started by hand as OPERATIONS.md says, each
in a process group of its own as a terminal would, the bootstrap server over HTTP, a TP-1
prefill node whose rank registers with it. Each is stopped as a terminal's Ctrl-C stops it:
SIGINT to its whole process group (rank processes and transfer workers included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest
import requests

from .conftest import LAUNCHER, alive, child_env, descendants, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@dataclass
class Started:
    proc: subprocess.Popen[str]
    ready: str  #: its readiness line


def _start(*args: str) -> Started:
    """Start a role in a session of its own and wait for its readiness line."""
    argv = [sys.executable, str(LAUNCHER), *args, "--log-level", "warning", "--port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if " ready on " in line:
            return Started(proc, line.strip())
    raise AssertionError(f"{args[0]} exited with {proc.wait()} before it was ready")


def _ctrl_c(role: Started) -> tuple[int, str]:
    """SIGINT to the role's whole process group, as a terminal's Ctrl-C; (exit code, stderr).
    Every process of the group must be gone afterwards."""
    tree = descendants(role.proc.pid)
    os.killpg(role.proc.pid, signal.SIGINT)
    try:
        _, err = role.proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(role.proc.pid, signal.SIGKILL)
        raise
    wait_until(lambda: not alive(tree), 30, "every process of the role to exit")
    return role.proc.returncode, err


def test_a_standalone_bootstrap_role_serves_a_prefill_node_and_outlives_it() -> None:
    boot = _start("bootstrap")  # its operator endpoints off: the default
    try:
        url = boot.ready.split()[3]
        address = url.removeprefix("http://")
        node = _start("prefill", "--bootstrap", address, "--tp", "1", "--num-pages", "64")
        assert node.ready.endswith(f"(tp=1, dp=1, bootstrap {address})")  # not "served here"
        info = requests.get(node.ready.split()[3] + "/info", timeout=10).json()
        assert (info["bootstrap"], info["bootstrap_hosted"]) == (address, False)
        ranks = requests.get(url + "/ranks", timeout=10).json()
        assert (ranks["world_size"], ranks["complete"]) == (1, True)
        assert len(descendants(node.proc.pid)) >= 2  # its rank and the rank's transfer worker
        code, err = _ctrl_c(node)
        # The node stops its ranks itself: they ignore the terminal's SIGINT rather than die
        # mid-round with a KeyboardInterrupt each.
        assert (code, "Traceback" in err, "KeyboardInterrupt" in err) == (0, False, False)
        assert requests.get(url + "/health", timeout=10).text == "OK"  # it outlives the node
        refused = requests.delete(url + "/ranks", timeout=10)  # no --admin
        assert (refused.status_code, refused.json()["error"]) == (403, "admin_disabled")
        assert requests.get(url + "/ranks", timeout=10).json()["world_size"] == 1
    finally:
        code, err = _ctrl_c(boot)
    # Nothing on stderr but the refused DELETE, logged once for the operator.
    (line,) = err.splitlines()
    assert code == 0
    assert line.endswith(
        " bootstrap tspd_bootstrap.server refused DELETE /ranks from 127.0.0.1: "
        "403 admin_disabled: operator endpoints are disabled on this server"
    )
