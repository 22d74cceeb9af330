"""Shared fixtures: a real bootstrap server on a loopback port, a client, the example layout
(wire.md §4.1)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tspd_bootstrap import BootstrapClient, BootstrapServer

sys.path.insert(0, str(Path(__file__).parent))  # bootstrap_testkit, for the test modules
from bootstrap_testkit import WIRE_LAYOUT


@pytest.fixture
def layout() -> str:
    return WIRE_LAYOUT


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    # The operator endpoints on: the suite drives DELETE /ranks (their default, off, is
    # test_server_errors.test_admin_endpoints_are_off_by_default's).
    with BootstrapServer("127.0.0.1", 0, allow_admin=True) as srv:
        yield srv


@pytest.fixture
def embedding_server() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0, embedding=True) as srv:
        yield srv


@pytest.fixture
def client(server: BootstrapServer) -> Iterator[BootstrapClient]:
    with BootstrapClient(server.url, retries=0) as cli:
        yield cli
