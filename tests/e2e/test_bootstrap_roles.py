"""Where a prefill node's bootstrap server lives: in the node (the default, WIRE §3) or in the
standalone ``bootstrap`` role (the refusal when the node's own server cannot bind is in
test_launcher_cli.py).

Real processes throughout: ``launch_pd.py`` roles, the bootstrap server over HTTP, a TP-1
prefill node whose rank registers with it.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import requests

from .conftest import LAUNCHER, child_env

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _start(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start a role and wait for its readiness line; (process, the line)."""
    argv = [sys.executable, str(LAUNCHER), *args, "--log-level", "warning", "--port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout is not None
    for line in proc.stdout:
        if " ready on " in line:
            return proc, line.strip()
    raise AssertionError(f"{args[0]} exited with {proc.wait()} before it was ready")


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_a_standalone_bootstrap_role_serves_a_prefill_node_and_outlives_it() -> None:
    boot, line = _start("bootstrap")
    try:
        url = line.split()[3]
        address = url.removeprefix("http://")
        node, ready = _start("prefill", "--bootstrap", address, "--tp", "1", "--num-pages", "64")
        assert ready.endswith(f"(tp=1, dp=1, bootstrap {address})")  # not "served here"
        info = requests.get(ready.split()[3] + "/info", timeout=10).json()
        assert (info["bootstrap"], info["bootstrap_hosted"]) == (address, False)
        ranks = requests.get(url + "/ranks", timeout=10).json()
        assert (ranks["world_size"], ranks["complete"]) == (1, True)
        assert _stop(node) == 0
        assert requests.get(url + "/health", timeout=10).text == "OK"  # it outlives the node
    finally:
        assert _stop(boot) == 0
