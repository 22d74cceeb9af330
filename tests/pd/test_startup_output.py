"""A transfer worker's start leaves stderr clean: Mooncake's start-up lines go to logging."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

START_A_DECODE_WORKER = """
import torch
from tspd_core.layout import ArenaSpec, build_contract, encode_contract
from tspd_core.pd import DecodePeer, DecodePeerConfig

if __name__ == "__main__":
    c = build_contract(ArenaSpec(layers=1, kv_heads=2, head_dim=8, page_size=4, num_pages=4))
    arena = torch.zeros(c.plan.arena_bytes, dtype=torch.uint8)
    arena.share_memory_()
    config = DecodePeerConfig(contract=encode_contract(c).decode(), arena=arena, host="127.0.0.1")
    peer, _ = DecodePeer.start(config)
    print(peer.session_id())
    peer.shutdown()
"""

MOONCAKE_LINES = ("Logging before InitGoogleLogging", "Local segment descriptor not found")


def _start(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TSPD_MOONCAKE_STDERR"}
    return subprocess.run(
        [sys.executable, "-c", START_A_DECODE_WORKER],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
        check=True,
    )


@pytest.mark.multiproc
def test_a_worker_start_prints_nothing_to_stderr() -> None:
    quiet = _start()
    assert quiet.stdout.startswith("127.0.0.1:")
    assert quiet.stderr == ""


@pytest.mark.multiproc
def test_the_knob_leaves_mooncakes_start_up_lines_on_stderr() -> None:
    loud = _start(TSPD_MOONCAKE_STDERR="1")
    assert [line for line in MOONCAKE_LINES if line in loud.stderr] == list(MOONCAKE_LINES)
