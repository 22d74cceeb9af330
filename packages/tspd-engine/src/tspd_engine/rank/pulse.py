"""A rank's signs of life, read by the process that launched it without asking the engine loop.

Each rank shares three numbers with its launcher (a small array of shared memory the launcher
allocates and the rank writes; nothing crosses a socket)::

    slot 0  beat        when the rank's pulse thread last ran (every BEAT_S)
    slot 1  loop        when the engine loop last began an iteration
    slot 2  iterations  how many iterations the engine loop has begun

The pulse thread is not the engine loop: a rank in a long forward keeps beating (torch leaves
the GIL to other threads while it computes), a stopped process (SIGSTOP, a frozen host) stops
beating, a dead one is found by its exit. That is what lets a node's ``/health`` tell a busy
replica from a dead one (:meth:`Vitals.problem`), and lets a client bound the wait for a
frame rank 0 never took: every iteration of rank 0 starts by draining its intake, so once two
more have begun after a submit was sent, an unanswered submit was dropped
(:mod:`tspd_engine.rank.client`).

Times are ``time.monotonic()``: one clock for every process of the host (Linux
``CLOCK_MONOTONIC``), and every rank runs on its launcher's host.

Threading: the rank writes (its pulse thread slot 0, its engine thread slots 1-2), any thread
of the launcher reads. Each slot is one aligned double, written and read whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray
from typing import Any

from tspd_core.procname import name_this_thread

#: How often a rank's pulse thread beats.
BEAT_S = 0.5
#: A rank that has not beaten for this long is not running: stopped, or starved of the CPU
#: for seconds (a beat costs microseconds; only a stopped or frozen process misses ten).
STALL_S = 5.0
#: An engine loop iteration running this long is wedged, not busy: a whole 8,000-token SmolLM2
#: prompt (four 2,048-token prefill rounds) took 88 s on a prefill node at TP 3 sharing two
#: cores, so one round has minutes to spare.
WEDGED_S = 600.0
_SLOTS = 3


@dataclass(frozen=True, slots=True)
class Vitals:
    """What a replica's pulses say at one moment (:meth:`Pulse.vitals` of each rank, merged)."""

    #: ``""``, or which rank process has exited (the replica is dead).
    dead: str = ""
    #: The longest any rank has gone without beating, and that rank.
    silent_s: float = 0.0
    silent_rank: int = 0
    #: The longest any rank's engine loop has spent in its current iteration, and that rank.
    loop_s: float = 0.0
    loop_rank: int = 0
    #: Iterations rank 0's engine loop has begun (each starts by draining the intake).
    iterations: int = 0

    def problem(self) -> str:
        """``""`` while the replica is alive and progressing, else what is wrong with it."""
        if self.dead:
            return self.dead
        if self.silent_s > STALL_S:
            return f"rank {self.silent_rank} has not run for {self.silent_s:.1f} s (stopped?)"
        if self.loop_s > WEDGED_S:
            return f"rank {self.loop_rank} has been in one engine round for {self.loop_s:.0f} s"
        return ""


class Pulse:
    """One rank's shared slots; made by the launcher (``ctx``: its ``multiprocessing``
    context, whose shared memory the rank process inherits) and handed to the rank."""

    def __init__(self, ctx: Any = None) -> None:
        self._slots = ctx.RawArray("d", _SLOTS) if ctx is not None else RawArray("d", _SLOTS)
        now = time.monotonic()  # a rank still building its model counts as just beaten
        self._slots[0] = self._slots[1] = now

    # -- the rank's side --------------------------------------------------------------------

    def start_beating(self) -> threading.Event:
        """Beat from a daemon thread of this process until the returned event is set."""
        stop = threading.Event()

        def beat() -> None:
            name_this_thread()
            while not stop.is_set():
                self._slots[0] = time.monotonic()
                stop.wait(BEAT_S)

        threading.Thread(target=beat, name="tspd-pulse", daemon=True).start()
        return stop

    def loop_began(self) -> None:
        """The engine loop begins an iteration (its engine thread only)."""
        self._slots[1] = time.monotonic()
        self._slots[2] += 1

    # -- the launcher's side ----------------------------------------------------------------

    def read(self) -> tuple[float, float, int]:
        """Seconds since the last beat, seconds since the loop last began an iteration, and
        the iterations begun."""
        now = time.monotonic()
        return now - self._slots[0], now - self._slots[1], int(self._slots[2])


def vitals(pulses: Sequence[Pulse], dead: str = "") -> Vitals:
    """A replica's vitals from its ranks' pulses (rank 0 first); ``dead``: which rank
    process exited, if one did."""
    reads = [p.read() for p in pulses]
    if not reads:
        return Vitals(dead)
    silent = max(range(len(reads)), key=lambda r: reads[r][0])
    loop = max(range(len(reads)), key=lambda r: reads[r][1])
    return Vitals(dead, reads[silent][0], silent, reads[loop][1], loop, reads[0][2])
