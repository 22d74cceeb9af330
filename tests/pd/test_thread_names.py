"""The names a transfer worker's threads show the system (``top -H``, /proc), from real workers.

A P rank's worker runs its transfer threads as ``transfer-<n>``, a D rank's worker its scatter
thread as ``scatter``; the main thread keeps the process's name (docs/OPERATIONS.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tspd_core.layout import ArenaSpec
from tspd_core.pd import PdTunables
from tspd_testing import procstat
from tspd_testing.loopback import LoopbackCluster

pytestmark = pytest.mark.skipif(not procstat.available(), reason="Linux's /proc names")

SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=16)


def _threads_by_process() -> dict[str, set[str]]:
    """This test process's descendants: process name -> its threads' names."""
    out: dict[str, set[str]] = {}
    for pid in procstat.descendants(os.getpid()):
        try:
            proc = Path(f"/proc/{pid}/comm").read_text().strip()
            names = {
                (task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()
            }
        except OSError:  # gone meanwhile
            continue
        out.setdefault(proc, set()).update(names)
    return out


def test_a_workers_threads_carry_their_names() -> None:
    tunables = PdTunables(queue_size=2, thread_pool_size=3)
    with LoopbackCluster([SPEC], [SPEC], tunables=tunables):
        want_p = {"tspd-p-xfer0", "transfer-0", "transfer-1", "transfer-2"}
        want_d = {"tspd-d-xfer0", "scatter"}
        # Each thread names itself as it starts: wait for that, not for a fixed time.
        deadline = time.monotonic() + 60
        while True:
            seen = _threads_by_process()
            p, d = seen.get("tspd-p-xfer0", set()), seen.get("tspd-d-xfer0", set())
            if want_p <= p and want_d <= d:
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        # Every other thread is one tspd names or ZMQ's own: none left with the interpreter's.
        named = ("transfer-", "lookup_", "heartbeat_", "ZMQbg/")
        for proc, names in (("tspd-p-xfer0", p), ("tspd-d-xfer0", d)):
            rest = names - {proc, "scatter", "lease-renew", "layerwise-pacer"}
            assert all(n.startswith(named) for n in rest), (proc, sorted(names))
