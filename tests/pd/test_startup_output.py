"""A transfer worker's start leaves stderr clean: Mooncake's start-up lines go to logging.

One fresh interpreter (so nothing else has written to its stderr) starts two decode workers,
one after the other: the first as a deployment would, the second with the knob that leaves
Mooncake's lines on stderr (a worker runs with its engine's environment at its start). A
marker line on stderr between them says which lines came from which.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

MARK = "--- the second worker starts with TSPD_MOONCAKE_STDERR=1 ---"
START_TWO_DECODE_WORKERS = f"""
import os, sys
import torch
from tspd_core.layout import ArenaSpec, build_contract, encode_contract
from tspd_core.pd import DecodePeer, DecodePeerConfig

def start():
    c = build_contract(ArenaSpec(layers=1, kv_heads=2, head_dim=8, page_size=4, num_pages=4))
    arena = torch.zeros(c.plan.arena_bytes, dtype=torch.uint8)
    arena.share_memory_()
    config = DecodePeerConfig(contract=encode_contract(c).decode(), arena=arena, host="127.0.0.1")
    peer, _ = DecodePeer.start(config)
    print(peer.session_id(), flush=True)
    peer.shutdown()  # the worker has exited: everything it wrote is on stderr

if __name__ == "__main__":
    start()
    print({MARK!r}, file=sys.stderr, flush=True)
    os.environ["TSPD_MOONCAKE_STDERR"] = "1"
    start()
"""

MOONCAKE_LINES = ("Logging before InitGoogleLogging", "Local segment descriptor not found")


@pytest.fixture(scope="module")
def started() -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TSPD_MOONCAKE_STDERR"}
    return subprocess.run(
        [sys.executable, "-c", START_TWO_DECODE_WORKERS],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean,
        check=True,
    )


@pytest.mark.multiproc
def test_a_worker_start_prints_nothing_to_stderr(started: subprocess.CompletedProcess[str]) -> None:
    quiet, _, _ = started.stderr.partition(MARK + "\n")
    assert started.stdout.startswith("127.0.0.1:")
    assert quiet == ""


@pytest.mark.multiproc
def test_the_knob_leaves_mooncakes_start_up_lines_on_stderr(
    started: subprocess.CompletedProcess[str],
) -> None:
    _, mark, loud = started.stderr.partition(MARK + "\n")
    assert mark, started.stderr
    assert [line for line in MOONCAKE_LINES if line in loud] == list(MOONCAKE_LINES)
    assert started.stdout.count("127.0.0.1:") == 2  # both workers served
