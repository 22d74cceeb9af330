"""``process_start_time_seconds``: the one metric every tspd HTTP role exposes beside its own.

It carries Prometheus's standard name (its client libraries export it for every process), so
one alert rule covers the router, the nodes and the bootstrap server: a scrape target whose
value changed was restarted, even when its supervisor brought it back between two scrapes and
no scrape ever failed (``TspdRoleInterrupted`` in deploy/grafana/tspd-alerts.yml).
"""

from __future__ import annotations

import os
import time

NAME = "process_start_time_seconds"


def _started() -> float:
    """Unix time this process started: the kernel's start tick of the process (Linux's
    ``/proc/self/stat`` field 22 plus the boot time), else the time this module was loaded."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # The command name (field 2) may hold spaces and parentheses: split after its end.
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", encoding="ascii") as proc:
            boot = next(int(line.split()[1]) for line in proc if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


STARTED = _started()


def exposition() -> str:
    """The family as exposition text, ending with a newline."""
    return (
        f"# HELP {NAME} Unix time the process started.\n# TYPE {NAME} gauge\n{NAME} {STARTED!r}\n"
    )
