"""CPU time of a process tree, read from Linux's ``/proc`` (no dependency).

The benchmarks charge each side of a transfer the CPU its processes spent on it: a rank's
process, its transfer worker (a child of the forkserver the rank started, so a grandchild) and
every thread of each. ``/proc/<pid>/task/<tid>/schedstat``'s
first field is a thread's time on a CPU in nanoseconds (``/proc/<pid>/stat``'s ticks are 10 ms
coarse, too coarse for a room of a few milliseconds). A thread that ends between two samples
takes its time with it; the peers' threads live as long as their process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def available() -> bool:
    """Whether this machine exposes per-thread schedstat (Linux with schedstats)."""
    return (PROC / str(os.getpid()) / "task" / str(os.getpid()) / "schedstat").exists()


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_s(pids: Iterable[int]) -> float:
    """Seconds on a CPU so far, all threads of these processes (gone ones count 0)."""
    total = 0
    for pid in pids:
        try:
            tasks = list((PROC / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def by_thread(pids: Iterable[int]) -> dict[str, float]:
    """Seconds on a CPU so far per ``"<process name>/<thread name>"`` (threads of one name in
    processes of one name summed): where a side's CPU goes, for the benchmark's breakdown."""
    out: dict[str, float] = {}
    for pid in pids:
        base = PROC / str(pid)
        try:
            proc = (base / "comm").read_text().strip()
            tasks = list((base / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip()
                ns = int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            key = f"{proc}/{name}"
            out[key] = out.get(key, 0.0) + ns / 1e9
    return out


def add_since(acc: dict[str, float], before: dict[str, float], pids: Iterable[int]) -> None:
    """Add to ``acc`` each ``process/thread`` row's seconds since ``before`` (a
    :func:`by_thread` of the same processes taken earlier)."""
    for key, now in by_thread(pids).items():
        acc[key] = acc.get(key, 0.0) + now - before.get(key, 0.0)
