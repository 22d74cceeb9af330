"""tspd_core.procname: the name ``top`` and ``/proc/<pid>/comm`` show."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
from tspd_core.procname import set_process_name
took = set_process_name({name!r})
print(took, open("/proc/self/comm").read().strip())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")
@pytest.mark.parametrize(
    ("name", "shown"),
    [("tspd-p-rank3", "tspd-p-rank3"), ("tspd-a-name-longer-than-15", "tspd-a-name-lon")],
)
def test_a_process_shows_the_name_it_set(name: str, shown: str) -> None:
    # In a child of its own: naming the test process would rename the pytest worker.
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(name=name)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", shown]
