"""One decode engine's committed steps: what token times and inter-token latencies are read from.

A request's tokens after the first are the ends of the decode steps it took, so the engine logs
every committed step's end time once, with the batch size, and — for the inter-token latency
distribution — the **weight** of the gap that ends at each step: how many requests took both
that step and the one before. Inside a macro-step that is the whole batch; at a macro-step's
first step it is the batch less the requests that (re)joined there (their gap into it starts at
their first token or at their last step before a preemption, and is counted with them).

Memory: the end times (8 bytes a step; tens of millions of steps on a day-long trace) go to a
file once a buffer fills, when the log has a spill file; the runs — (steps, batch size, weight of
the run's first gap), 12 bytes each, one per batch change — stay in memory.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: Steps buffered before they are appended to the spill file (8 MB).
SPILL_STEPS = 1 << 20


class StepLog:
    """Append-only log of one engine's decode steps, in commit order. With ``spill`` the end
    times are appended to that file as the buffer fills; without, they stay in memory.
    Readers (:meth:`ends`, :meth:`slice`, :meth:`blocks`) see every step appended so far."""

    def __init__(self, spill: Path | None = None) -> None:
        self._spill = spill
        self._buffer: list[F64] = []
        self._buffered = 0
        self._flushed = 0  #: steps in the spill file
        self._runs = array("i")  # (steps, batch, first weight) triples
        self._last_batch = -1  #: batch size of the last run
        self.n = 0
        if spill is not None:
            spill.write_bytes(b"")

    def append(self, ends: F64, batch: int, first_weight: int) -> None:
        """Log ``len(ends)`` steps of ``batch`` requests; ``first_weight`` requests also took
        the step logged before them."""
        n = len(ends)
        if first_weight == batch == self._last_batch:
            self._runs[-3] += n  # a continuation of the last run: the same batch, nobody joined
        else:
            self._runs.extend((n, batch, first_weight))
            self._last_batch = batch
        self._buffer.append(ends)
        self._buffered += n
        self.n += n
        if self._spill is not None and self._buffered >= SPILL_STEPS:
            self.flush()

    def flush(self) -> None:
        """Append the buffered end times to the spill file (no-op without one)."""
        if self._spill is None or not self._buffer:
            return
        with self._spill.open("ab") as f:
            np.concatenate(self._buffer).tofile(f)
        self._flushed += self._buffered
        self._buffer, self._buffered = [], 0

    def in_memory(self) -> StepLog:
        """A copy with every end time in memory and no spill file (what a pickled result
        carries to another process)."""
        copy = StepLog()
        if self.n:
            copy._buffer = [self.ends()]
        copy._buffered = copy.n = self.n
        copy._runs = array("i", self._runs)
        copy._last_batch = self._last_batch
        return copy

    # ---- reading ---------------------------------------------------------------------------------

    def ends(self) -> F64:
        """Every step's end time (simulated seconds), in order."""
        return self.slice(0, self.n)

    def slice(self, start: int, count: int) -> F64:
        """The end times of steps ``start .. start + count``."""
        count = max(0, min(count, self.n - start))
        parts: list[F64] = []
        if start < self._flushed and self._spill is not None:
            k = min(count, self._flushed - start)
            parts.append(np.fromfile(self._spill, np.float64, count=k, offset=8 * start))
        mem_lo = max(start, self._flushed) - self._flushed
        mem_hi = start + count - self._flushed
        if mem_hi > mem_lo:
            tail = np.concatenate(self._buffer) if self._buffer else np.zeros(0)
            parts.append(tail[mem_lo:mem_hi])
        return np.concatenate(parts) if parts else np.zeros(0)

    def runs(self) -> tuple[I64, I64, I64]:
        """(steps, batch size, weight of the first gap) of each run of steps."""
        r = np.frombuffer(self._runs, dtype=np.int32).reshape(-1, 3).astype(np.int64)
        return r[:, 0], r[:, 1], r[:, 2]

    def sizes(self) -> I64:
        """Every step's batch size."""
        n, b, _ = self.runs()
        return np.repeat(b, n)

    def gap_weights(self) -> I64:
        """``w[k]``: requests whose tokens include the ends of steps k−1 and k (``w[0]`` = 0)."""
        n, b, w = self.runs()
        out = np.repeat(b, n)
        if len(out):
            out[np.cumsum(n) - n] = w
        return out

    def blocks(self, steps: int = 1 << 20) -> Iterator[tuple[F64, I64]]:
        """(gaps, weights) of consecutive steps, ``steps`` at a time: ``gaps[k]`` is a step's
        end minus the previous step's, ``weights[k]`` how many requests saw that gap."""
        n, b, w = self.runs()
        starts = np.cumsum(n) - n
        prev = np.nan
        for lo in range(0, self.n, steps):
            hi = min(lo + steps, self.n)
            ends = self.slice(lo, hi - lo)
            gaps = np.diff(ends, prepend=prev)
            prev = ends[-1]
            first, last = np.searchsorted(starts, lo, "right") - 1, np.searchsorted(starts, hi)
            counts = np.minimum(starts[first:last] + n[first:last], hi) - np.maximum(
                starts[first:last], lo
            )
            weights = np.repeat(b[first:last], counts)
            begins = starts[first:last] - lo
            inside = begins >= 0
            weights[begins[inside]] = w[first:last][inside]
            yield gaps, weights
