"""The standalone server as a real process: readiness line, serving, clean signal shutdown."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tspd_bootstrap import BootstrapClient, ClusterCredential, ParallelInfo, RankAddress

pytestmark = pytest.mark.multiproc
READY = re.compile(
    r"^tspd-bootstrap: serving (kv|embedding) bootstrap on http://(\S+):(\d+) \(pid (\d+)\)$"
)
BIN = os.path.join(os.path.dirname(sys.executable), "tspd-bootstrap")


def launch(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def ready_port(proc: subprocess.Popen[str]) -> tuple[str, int]:
    assert proc.stdout is not None
    line = proc.stdout.readline().rstrip("\n")
    match = READY.match(line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
    assert int(match.group(4)) == proc.pid
    return match.group(1), int(match.group(3))


@pytest.fixture
def cli_server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = launch(BIN, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning")
    try:
        kind, port = ready_port(proc)
        assert kind == "kv"
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_stops_cleanly_on_signals(
    cli_server: tuple[subprocess.Popen[str], int], layout: str, signum: signal.Signals
) -> None:
    proc, port = cli_server
    client = BootstrapClient(f"127.0.0.1:{port}")
    client.register_rank(
        engine_rank=0, world_size=1, dp_size=1, rank_ip="10.0.0.2", rank_port=7, cache_layout=layout
    )
    assert client.parallel_info() == ParallelInfo(1, 1, layout)
    assert client.rank_address(0, 0) == RankAddress("10.0.0.2", 7)
    proc.send_signal(signum)
    assert proc.wait(15) == 0
    assert proc.stderr is not None
    assert "Traceback" not in proc.stderr.read()
    assert not client.is_healthy(timeout=1.0)


def test_python_dash_m_embedding_server() -> None:
    proc = launch(
        sys.executable, "-m", "tspd_bootstrap", "--host", "127.0.0.1", "--port", "0", "--embedding"
    )
    try:
        kind, port = ready_port(proc)
        assert kind == "embedding"
        client = BootstrapClient(f"127.0.0.1:{port}")
        client.register_rank(engine_rank=0, world_size=1, dp_size=1, rank_ip="e", rank_port=5)
        assert client.parallel_info() == ParallelInfo(1, 1, None)
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP (address, port) pairs ``pid`` listens on: its socket inodes looked up in
    /proc/<pid>/net/tcp and tcp6 (state 0A is LISTEN; addresses are 32-bit words in host
    byte order)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:
                continue
            word, port = fields[1].split(":")
            raw = bytes.fromhex(word)
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((socket.inet_ntop(family, packed), int(port, 16)))
    return found


def test_defaults_listen_on_loopback_only_with_the_operator_endpoints_off(layout: str) -> None:
    proc = launch(BIN, "--port", "0", "--log-level", "warning")
    try:
        _, port = ready_port(proc)
        assert _listening(proc.pid) == {("127.0.0.1", port)}
        client = BootstrapClient(f"127.0.0.1:{port}")
        client.register_rank(engine_rank=0, world_size=1, dp_size=1, rank_ip="10.0.0.2",
                             rank_port=7, cache_layout=layout)  # fmt: skip
        for path in ("/ranks", "/ranks/0"):
            resp = requests.delete(f"http://127.0.0.1:{port}{path}", timeout=5)
            assert (resp.status_code, resp.json()["error"]) == (403, "admin_disabled")
        assert client.rank_address(0, 0) == RankAddress("10.0.0.2", 7)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize(("flags", "status"), [(["--admin"], 200), (["--no-admin"], 403)])
def test_admin_turns_the_operator_endpoints_on(flags: list[str], status: int) -> None:
    # --no-admin, the switch from before --admin existed, is still accepted (the default now).
    proc = launch(BIN, "--host", "127.0.0.1", "--port", "0", "--log-level", "error", *flags)
    try:
        _, port = ready_port(proc)
        resp = requests.delete(f"http://127.0.0.1:{port}/ranks", timeout=5)
        assert resp.status_code == status
    finally:
        proc.kill()
        proc.wait(10)


def test_admin_and_no_admin_together_are_refused() -> None:
    done = subprocess.run([BIN, "--admin", "--no-admin"], capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "tspd-bootstrap: error: argument --no-admin: not allowed with argument --admin"
    )


def test_taken_port_exits_1_with_the_reason() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [BIN, "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1
    assert done.stdout == ""
    assert (
        done.stderr.strip().splitlines()[-1]
        == f"tspd-bootstrap: address already in use: 127.0.0.1:{port}"
    )


def test_help_and_bad_arguments() -> None:
    shown = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0
    for flag in (
        "--host",
        "--port",
        "--embedding",
        "--log-level",
        "--layout-canonicalizer",
        "--admin",
    ):
        assert flag in shown.stdout
    bad = subprocess.run(
        [BIN, "--port", "0", "--layout-canonicalizer", "json:nope"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        == "tspd-bootstrap: layout canonicalizer 'json:nope': json has no callable 'nope'"
    )


TOKEN = "cli test cluster token 0123456789"


def test_a_token_file_makes_the_server_require_the_credential(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    proc = launch(BIN, "--port", "0", "--log-level", "info", "--cluster-token-file", str(path))
    try:
        _, port = ready_port(proc)
        url = f"http://127.0.0.1:{port}"
        bare = requests.get(f"{url}/route?engine_rank=-1&target_dp_group=-1", timeout=5)
        assert (bare.status_code, bare.json()["error"]) == (401, "unauthenticated")
        with BootstrapClient(url, credential=ClusterCredential.from_text(TOKEN)) as client:
            client.register_rank(engine_rank=0, world_size=1, dp_size=1, rank_ip="10.0.0.2",
                                 rank_port=7, cache_layout=layout)  # fmt: skip
            assert client.rank_address(0, 0) == RankAddress("10.0.0.2", 7)
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.stderr is not None
    fingerprint = ClusterCredential.from_text(TOKEN).fingerprint
    assert f"cluster credential on (fingerprint {fingerprint})" in proc.stderr.read()


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--cluster-token", "short"], "the cluster token is 5 bytes; it must be 16..4096"),
        (["--cluster-token-file", "/nonexistent/t"], "cannot read the cluster token file"),
        (["--lease", "0"], "--lease must be > 0 s, got 0"),
    ],
)
def test_an_unusable_credential_or_lease_exits_2(args: list[str], why: str) -> None:
    done = subprocess.run([BIN, "--port", "0", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"tspd-bootstrap: {why}")
