"""``launch_pd.py`` as a new user meets it: the manual, and clear refusals that start nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import LAUNCHER, child_env

pytestmark = pytest.mark.multiproc


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *args], capture_output=True, text=True,
        env=child_env(), timeout=120,
    )  # fmt: skip


def test_help_reads_like_a_manual() -> None:
    out = _run("--help")
    assert out.returncode == 0
    for role in ("local", "bootstrap", "prefill", "decode", "colocated", "router", "demo"):
        assert f"\n  {role} " in out.stdout
    assert "examples:" in out.stdout
    assert "python apps/launch_pd.py local" in out.stdout
    node = _run("prefill", "--help")
    assert node.returncode == 0
    for flag in ("--bootstrap-port PORT", "--bootstrap HOST:PORT", "--tp TP", "--dp DP",
                 "--model DIR", "--transport", "--advertise-host", "--waiting-timeout",
                 "--device"):  # fmt: skip
        assert flag in node.stdout
    decode = _run("decode", "--help")
    for flag in ("--heartbeat-interval", "--heartbeat-failures", "--waiting-timeout"):
        assert flag in decode.stdout
    assert "--standalone-bootstrap" in _run("local", "--help").stdout


def test_bad_flags_are_refused_before_anything_starts() -> None:
    both = _run("prefill", "--port", "0", "--bootstrap", "127.0.0.1:9", "--bootstrap-port", "0")
    assert both.returncode == 2
    assert both.stderr.strip().endswith(
        "launch_pd prefill: error: give --bootstrap (an external server) or --bootstrap-port "
        "(the node's own), not both"
    )
    fast = _run("decode", "--port", "0", "--heartbeat-interval", "0.5")
    assert fast.returncode == 2
    assert "--heartbeat-interval must be >= 2 s and --heartbeat-failures >= 1" in fast.stderr
    bad_tp = _run("decode", "--port", "0", "--tp", "3")
    assert bad_tp.returncode == 2
    assert bad_tp.stderr.strip().endswith(
        "launch_pd decode: error: num_attention_heads 4 is not divisible by TP size 3"
    )
    assert " ready on " not in bad_tp.stdout
