"""Child processes of a one-machine cluster (``tspd-launch local``): start them in order,
wait for each one's readiness line, relay their output, and stop them in reverse order.

Each child runs in its own session, so a terminal's Ctrl-C reaches only the supervisor,
which then stops the children in reverse start order: SIGTERM, a bounded wait, SIGKILL for a
straggler. Children started as one group (``spawn(..., group=)``, e.g. the prefill and the
decode node) stop side by side, as they started.
Children also watch the supervisor (``--parent-pid``) and stop if it dies, so even a
SIGKILLed supervisor leaves no orphans behind for long.

Readiness protocol: a child prints ``<role> ready on <url>`` on stdout once it serves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO

READY = re.compile(r"^(\w+) ready on (\S+)")


class StartError(RuntimeError):
    """A child exited or did not become ready in time."""


@dataclass(eq=False)
class Child:
    role: str
    proc: subprocess.Popen[str]
    url: str | None = None
    line: str = ""  #: its readiness line (the URL, then what the role says about itself)
    ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None
    group: int = 0  #: children of one group start together and stop together
    argv: tuple[str, ...] = ()  #: its command line (a restart reuses it, ports pinned)
    restarts: int = 0  #: how often it was restarted after exiting on its own


class Supervisor:
    """Starts children in order and stops them in reverse order (see the module docstring)."""

    def __init__(self, out: IO[str] | None = None, stop_timeout_s: float = 20.0) -> None:
        self.out = out or sys.stdout
        self.stop_timeout_s = stop_timeout_s
        self.children: list[Child] = []
        self._print_lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._print_lock:
            print(line, file=self.out, flush=True)

    def start(
        self, role: str, argv: Sequence[str], timeout_s: float, cancel: threading.Event
    ) -> str:
        """Spawn ``argv``, relay its output, return its URL once ready (:class:`StartError`)."""
        return self.wait_ready(self.spawn(role, argv), timeout_s, cancel)

    def spawn(self, role: str, argv: Sequence[str], group: int | None = None) -> Child:
        """Start one child (in its own session) and relay its output; does not wait.
        ``group``: the start group it joins (default: a group of its own, after the rest)."""
        if group is None:
            group = max((c.group + 1 for c in self.children), default=0)
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            bufsize=1, start_new_session=True,
        )  # fmt: skip
        child = Child(role, proc, group=group, argv=tuple(argv))
        self.children.append(child)
        child.reader = threading.Thread(target=self._relay, args=(child,), daemon=True)
        child.reader.start()
        return child

    def wait_ready(self, child: Child, timeout_s: float, cancel: threading.Event) -> str:
        """The child's URL once it printed its readiness line (:class:`StartError`)."""
        deadline = time.monotonic() + timeout_s
        while not child.ready.wait(0.2):
            if child.proc.poll() is not None:
                code = child.proc.returncode
                raise StartError(f"{child.role} exited with code {code} before it was ready")
            if cancel.is_set():
                raise StartError(f"interrupted while {child.role} was starting")
            if time.monotonic() > deadline:
                raise StartError(f"{child.role} was not ready within {timeout_s:g} s")
        assert child.url is not None
        return child.url

    def dead(self) -> Child | None:
        """A child that exited on its own (the cluster is broken), if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def respawn(self, child: Child, argv: Sequence[str]) -> Child:
        """Start ``child``'s role again with ``argv`` in its place (same start group), after
        killing whatever of the dead child's session lingers (its ranks, workers)."""
        _kill_group(child.proc)
        if child.reader is not None:
            child.reader.join(5)
        fresh = self.spawn(child.role, argv, child.group)
        self.children.remove(fresh)
        self.children[self.children.index(child)] = fresh
        fresh.restarts = child.restarts + 1
        return fresh

    def stop_all(self) -> bool:
        """Stop every child, the last start group first (one group's children side by side);
        True when all exited cleanly (code 0)."""
        clean = True
        for group in sorted({c.group for c in self.children}, reverse=True):
            members = [c for c in reversed(self.children) if c.group == group]
            with ThreadPoolExecutor(len(members)) as pool:
                clean &= all(list(pool.map(self._stop, members)))
        return clean

    def _stop(self, child: Child) -> bool:
        proc = child.proc
        if proc.poll() is None:
            self.say(f"stopping {child.role} (pid {proc.pid})")
            _signal(proc, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.say(f"{child.role} did not stop in {self.stop_timeout_s:g} s; killing it")
                _kill_group(proc)
                proc.wait(5)
        else:
            _kill_group(proc)  # it died: make sure nothing of its session lingers
        if child.reader is not None:
            child.reader.join(5)
        return proc.returncode == 0

    def _relay(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            line = line.rstrip("\n")
            self.say(f"[{child.role}] {line}")
            match = READY.match(line)
            if match and not child.ready.is_set():
                child.url, child.line = match.group(2), line
                child.ready.set()


def _signal(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL whatever is left in the child's session (its ranks, workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
