"""One decode engine's committed steps: what token times and inter-token latencies are read from.

A request's tokens after the first are the ends of the decode steps it took, so the engine logs
every committed step's end time once, with the batch size, and — for the inter-token latency
distribution — the **weight** of the gap that ends at each step: how many requests took both
that step and the one before. Inside a macro-step that is the whole batch; at a macro-step's
first step it is the batch less the requests that (re)joined there (their gap into it starts at
their first token or at their last step before a preemption, and is counted with them).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class StepLog:
    """Append-only log of one engine's decode steps, in commit order."""

    def __init__(self) -> None:
        self._ends: list[F64] = []
        #: Run lengths: (steps, batch size, weight of the gap into the run's first step).
        self._runs: list[tuple[int, int, int]] = []
        self.n = 0

    def append(self, ends: F64, batch: int, first_weight: int) -> None:
        """Log ``len(ends)`` steps of ``batch`` requests; ``first_weight`` requests also took
        the step logged before them."""
        self._ends.append(ends)
        self._runs.append((len(ends), batch, first_weight))
        self.n += len(ends)

    def ends(self) -> F64:
        """Every step's end time (simulated seconds), in order."""
        return np.concatenate(self._ends) if self._ends else np.zeros(0)

    def sizes(self) -> I64:
        """Every step's batch size."""
        runs = self._runs
        return np.repeat([b for _, b, _ in runs], [n for n, _, _ in runs]).astype(np.int64)

    def gap_weights(self) -> I64:
        """``w[k]``: requests whose tokens include the ends of steps k−1 and k (``w[0]`` = 0)."""
        w = self.sizes()
        starts = np.cumsum([0] + [n for n, _, _ in self._runs[:-1]])
        if len(w):
            w[starts] = [f for _, _, f in self._runs]
        return w
