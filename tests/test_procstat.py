"""``tspd_testing.procstat``: a process tree's CPU time from /proc, whole and by thread name, as
the transfer benchmark charges each side of a room (real processes: a child that burns CPU, a
grandchild below it, a named thread)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tspd_testing import procstat

pytestmark = pytest.mark.skipif(not procstat.available(), reason="no per-thread schedstat here")

#: A child that starts a sleeping grandchild, prints both pids, then burns CPU until stdin ends.
CHILD = """
import subprocess, sys, os
g = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                     stdin=subprocess.PIPE)
print(os.getpid(), g.pid, flush=True)
import threading
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
x = 0
while not done.is_set():
    x += 1
g.stdin.close(); g.wait()
"""


def test_a_tree_is_found_and_its_cpu_time_grows_while_it_works() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        child, grandchild = map(int, proc.stdout.readline().split())
        assert child == proc.pid
        tree = procstat.descendants(proc.pid)
        assert tree == [proc.pid, grandchild]
        first = procstat.cpu_s(tree)
        # Wait on the event itself: the busy child's CPU time passing 50 ms more.
        deadline = time.monotonic() + 120
        while procstat.cpu_s(tree) < first + 0.05:
            assert time.monotonic() < deadline, "the busy child never ran"
            time.sleep(0.01)
        # The grandchild only sleeps on its stdin: nearly all of the tree's time is the child's.
        assert procstat.cpu_s([grandchild]) < procstat.cpu_s([child])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)


def test_a_process_that_is_gone_counts_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    assert procstat.cpu_s([proc.pid]) == 0.0
    assert procstat.descendants(proc.pid) == [proc.pid]


#: A child whose named thread burns CPU until stdin ends, while its main thread waits.
NAMED = """
import sys, threading
from tspd_core.procname import name_this_thread
done = threading.Event()
def burn():
    name_this_thread()
    x = 0
    while not done.is_set():
        x += 1
t = threading.Thread(target=burn, name="tspd-burner")
t.start()
print("ready", flush=True)
sys.stdin.read()
done.set()
t.join()
"""


def test_cpu_time_is_split_by_process_and_thread_name() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", NAMED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        comm = Path(f"/proc/{proc.pid}/comm").read_text().strip()
        key = f"{comm}/burner"
        deadline = time.monotonic() + 120
        while procstat.by_thread([proc.pid]).get(key, 0.0) < 0.05:
            assert time.monotonic() < deadline, procstat.by_thread([proc.pid])
            time.sleep(0.01)
        split = procstat.by_thread([proc.pid])
        # The burning thread holds nearly all of the process's time; the rows add up to it.
        assert split[key] > split.get(f"{comm}/{comm}", 0.0)
        assert sum(split.values()) <= procstat.cpu_s([proc.pid]) + 1e-9
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)
    assert procstat.by_thread([proc.pid]) == {}
