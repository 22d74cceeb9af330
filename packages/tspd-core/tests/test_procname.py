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


THREADS = """
import threading
from concurrent.futures import ThreadPoolExecutor
from tspd_core.procname import name_this_thread

def comm():
    return open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()

seen = {"main_before": comm()}
def named():
    seen["took"] = name_this_thread()
    seen["thread"] = comm()
t = threading.Thread(target=named, name="tspd-transfer-3")
t.start(); t.join()
pool = ThreadPoolExecutor(1, thread_name_prefix="tspd-heartbeat", initializer=name_this_thread)
seen["pool"] = pool.submit(comm).result()
pool.shutdown()
seen["main_took"] = name_this_thread()
same = seen["main_before"] == comm()
print(seen["took"], seen["thread"], seen["pool"], seen["main_took"], same)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")
def test_a_thread_shows_its_python_name_less_the_prefix() -> None:
    out = subprocess.run(
        [sys.executable, "-c", THREADS], capture_output=True, text=True, check=True
    )
    # A pool's thread is named "<prefix>_0"; the main thread keeps the process's name.
    assert out.stdout.split() == ["True", "transfer-3", "heartbeat_0", "False", "True"]
