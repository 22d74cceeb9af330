"""The engine side's reading of its worker's notes: room updates to the peer, answers to callers.

Any engine thread may drain the notes pipe (the scheduler thread in ``poll``, another thread
waiting for an answer in ``metrics()`` or ``release_registration()``), but only one at a time:
a drain holds ``_drain_lock``, hands every room update to the peer's ``on_notes`` callback in
pipe order, and files each answer under its call's ``seq`` for the thread that waits for it.
So no update is lost or reordered whichever thread happens to read it::

    worker ── notes pipe ──► pump() (one thread at a time)
                                ├─ RoomUpdate, WorkerFatal ──► on_notes(...)  (peer's table)
                                └─ WorkerCounters/Metrics/Reply(seq) ──► answers[seq] ──► call()
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from tspd_core.pd.errors import PeerError
from tspd_core.pd.peer.worker_handle import WorkerHandle
from tspd_core.pd.wire import ipc

Notes = Callable[[list[ipc.Message]], None]


class WorkerLink:
    """Routes a worker's notes (see the module docstring); thread-safe."""

    def __init__(self, worker: WorkerHandle, on_notes: Notes) -> None:
        self.worker = worker
        self._on_notes = on_notes
        self._drain_lock = threading.Lock()
        self._cond = threading.Lock()
        self._answers: dict[int, ipc.Answer] = {}
        self._waiting: set[int] = set()  # seqs a caller still waits for (late answers dropped)
        self._seq = itertools.count(1)
        self.lost: str | None = None  #: why the notes pipe broke (the worker died), once it did

    def pump(self) -> None:
        """Drain what the worker published (non-blocking); a no-op while another thread does."""
        if not self._drain_lock.acquire(blocking=False):
            return
        try:
            self._pump_locked()
        finally:
            self._drain_lock.release()

    def call(self, make: Callable[[int], ipc.Message], what: str, timeout_s: float) -> ipc.Answer:
        """Send ``make(seq)`` and wait for the answer with that ``seq``.

        :class:`PeerError` when the worker is gone or does not answer within ``timeout_s``.
        """
        seq = next(self._seq)
        with self._cond:
            self._waiting.add(seq)
        try:
            self.worker.send(make(seq))
            return self._await(seq, what, timeout_s)
        finally:
            with self._cond:
                self._waiting.discard(seq)
                self._answers.pop(seq, None)

    def _await(self, seq: int, what: str, timeout_s: float) -> ipc.Answer:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                answer = self._answers.pop(seq, None)
            if answer is not None:
                return answer
            if self.lost is not None:
                raise PeerError(f"no {what}: the transfer worker is gone ({self.lost})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"the transfer worker did not answer {what} in {timeout_s:g} s")
            if self._drain_lock.acquire(timeout=min(left, 0.05)):
                try:
                    if self.worker.wait(min(left, 0.05)):
                        self._pump_locked()
                finally:
                    self._drain_lock.release()

    def _pump_locked(self) -> None:
        if self.lost is not None:
            return
        notes: list[ipc.Message] = []
        try:
            messages = self.worker.drain()
        except PeerError as exc:
            self.lost = str(exc)
            messages = []
        for msg in messages:
            if isinstance(msg, ipc.WorkerCounters | ipc.WorkerMetrics | ipc.Reply):
                with self._cond:
                    if msg.seq in self._waiting:
                        self._answers[msg.seq] = msg
            else:
                notes.append(msg)
        if notes:
            self._on_notes(notes)
