"""One forkserver per launcher: a process it started starts its own workers from it
(:mod:`tspd_core.pd.proc.forkserver`), and a worker runs with its starter's environment.

Real processes: the probe worker of :mod:`tspd_testing.ipc_probe`, started by
``ProcessHandle.spawn`` like a transfer worker, and :func:`~tspd_testing.ipc_probe.relay`
in the rank's place between the test and the worker.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import signal
from typing import Any

import pytest
import torch

from tspd_core.pd.proc import forkserver
from tspd_core.pd.proc.handle import PRELOAD
from tspd_testing import ipc_probe
from tspd_testing.ipc_probe import ProbeSpec, ProbeWhere

pytestmark = pytest.mark.multiproc

MARK = "TSPD_TEST_FORKSERVER_MARK"


def _server() -> forkserver.Server:
    server = forkserver.running(PRELOAD)
    assert server is not None, "CPython 3.11-3.13 on Linux: the server can be shared"
    return server


def _relay(server: forkserver.Server | None) -> tuple[bool, list[Any], list[int], int]:
    """Run :func:`ipc_probe.relay` in a process this one's forkserver starts."""
    ctx: Any = multiprocessing.get_context("forkserver")
    got, out = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=ipc_probe.relay, args=(server, MARK, out), name="tspd-test-relay")
    proc.start()
    out.close()
    try:
        assert got.poll(120), "the relay reported nothing"
        adopted, where, children = got.recv()
    finally:
        proc.join(30)
        got.close()
    assert proc.exitcode == 0
    return adopted, where, children, int(proc.pid)


def test_a_worker_runs_with_its_starters_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _server()  # running before the variable is set: the server's environment lacks it
    token = secrets.token_hex(8)
    monkeypatch.setenv(MARK, token)
    probe = ipc_probe.start(torch.zeros(64, dtype=torch.uint8), ProbeSpec())
    try:
        _, _, value = json.loads(ipc_probe.ask(probe, ProbeWhere(MARK)))
    finally:
        probe.close()
    assert value == token


def test_a_started_process_starts_its_workers_from_the_same_server() -> None:
    server = _server()
    adopted, (probe_pid, probe_parent, _), children, relay_pid = _relay(server)
    assert adopted is True
    assert probe_parent == server.pid  # the probe is the launcher's server's child ...
    assert children == []  # ... and the relay started no server (nor anything else)
    assert probe_pid != relay_pid


def test_a_gone_server_leaves_the_process_its_own() -> None:
    server = _server()
    ctx: Any = multiprocessing.get_context("forkserver")
    ended = ctx.Process(target=int, name="tspd-test-ended")  # a pid that exists no more
    ended.start()
    ended.join(30)
    gone = forkserver.Server(server.address, ended.pid)
    adopted, (_, probe_parent, _), children, _ = _relay(gone)
    assert adopted is True
    assert probe_parent != server.pid
    assert children == [probe_parent]  # the relay's own forkserver, started when it was needed


def test_a_process_that_runs_its_own_server_keeps_it() -> None:
    server = _server()
    assert forkserver.adopt(server) is False
    assert forkserver.adopt(None) is False
    _, (_, probe_parent, _), children, _ = _relay(None)
    assert probe_parent != server.pid
    assert children == [probe_parent]


def test_a_worker_ignores_a_terminals_ctrl_c() -> None:
    # Whatever the server's handlers: this process's server started with Python's default
    # SIGINT handler (a KeyboardInterrupt), which its children would have.
    _server()
    probe = ipc_probe.start(torch.zeros(64, dtype=torch.uint8), ProbeSpec())
    try:
        os.kill(probe.pid, signal.SIGINT)  # the probe is blocked reading its pipe
        pid, _, _ = json.loads(ipc_probe.ask(probe, ProbeWhere(MARK)))
        assert (pid, probe.alive) == (probe.pid, True)
    finally:
        probe.close()
