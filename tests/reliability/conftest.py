"""Every module of these tests must leave no transfer worker and no server thread behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch.multiprocessing as tmp


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = [p.name for p in tmp.active_children() if p.name.startswith("tspd-")]
        servers = [t.name for t in threading.enumerate() if t.name.startswith("tspd-bootstrap")]
        if not workers and not servers:
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: worker processes {workers}, server threads {servers}")
