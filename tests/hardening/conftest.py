"""One real cluster for the hardening tests that need one (see cluster.py): started by the
first test that asks, shared by the attack tests and the fault suite (every test leaves it
serving, and compares what it checks against its own start), stopped at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .cluster import Cluster

#: HTTP time limits short enough to test (2 s), and PD timeouts short enough that rooms a
#: fault orphans end within a test.
FLAGS = ("--header-timeout", "2", "--body-timeout", "2", "--bootstrap-timeout", "20",
         "--waiting-timeout", "30", "--heartbeat-interval", "2", "--heartbeat-failures", "1",
         "--max-restarts", "20")  # fmt: skip


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    started = Cluster.start(*FLAGS)
    try:
        yield started
    finally:
        started.stop()
