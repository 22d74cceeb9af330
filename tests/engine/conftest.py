"""Shared fixtures for the engine tests: one torch thread (the CPU is shared), small configs."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest
import torch

from tspd_engine.config import EngineConfig
from tspd_engine.model.config import ModelConfig
from tspd_serving.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PROMPTS = [
    TOK.encode("hello world"),
    TOK.encode("the quick brown fox jumps over the lazy dog"),
    TOK.encode("a"),
    TOK.encode("hello world, hello again: paged attention"),
]


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # OpenMP workers spinning on a shared 2-core machine make tiny matmuls 100x slower.
    torch.set_num_threads(1)


def small_config(**changes: object) -> EngineConfig:
    """A tiny engine: 4-token pages so prompts span several pages and decode crosses pages."""
    base = EngineConfig(model=ModelConfig(), num_pages=96, page_size=4, max_running=8)
    return base.replace(**changes)


def listening(pid: int) -> set[tuple[str, int]]:
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
