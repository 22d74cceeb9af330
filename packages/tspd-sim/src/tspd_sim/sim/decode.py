"""A decode engine: one DP group of a D instance — admission queue, then batched decode steps.

**Admission** (first come first served, with back-pressure): a routed request waits until the
real scheduler admits it as "awaiting remote KV" (prefix pages from D's prefix store attached,
the rest of the prompt's pages allocated, and — by default — the pages its output will need
kept in reserve). Only then is it handed to P (its pre-allocation reached P), so a full D pool
holds P back, exactly like the PD handshake does.

**Decode in macro-steps**: between two changes of the batch (a request joins when its KV
arrives, or finishes), every step runs the same sequences with contexts growing by one token
each, so the cost model prices k steps at once (``decode_times``) and one wake-up is scheduled
at the k-th step's end, where k is the fewest steps any running request has left. A request
whose KV arrives mid-macro-step joins at the next step boundary: the macro-step is cut there.
At each boundary the scheduler advances every running request by the steps done in bulk
(``record`` of n tokens: pages allocated as they fill), so its state is exact at boundaries.

Every committed step's end time is logged; a request's token times are a slice of that log
(token 2 at its first step's end, token ``output_len`` at its last), so no per-token event
exists anywhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tspd_sim.sim.context import EngineCtx
from tspd_sim.sim.request import SimRequest

if TYPE_CHECKING:
    from tspd_sim.sim.kv import EngineKv, EngineLayout


class DecodeEngine:
    """Owns one D DP group's admission queue, batch and step clock; driven by SimPy callbacks."""

    def __init__(
        self,
        ctx: EngineCtx,
        kv: EngineKv,
        layout: EngineLayout,
        gpu_base: int,
        on_admitted: Callable[[SimRequest], None],
    ) -> None:
        self.ctx, self.kv, self.layout, self.gpu_base = ctx, kv, layout, gpu_base
        self.env = ctx.env
        self._on_admitted = on_admitted
        self.queue: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._joining: list[SimRequest] = []
        self._ends: npt.NDArray[np.float64] = np.zeros(0)
        self._version = 0
        self._t0 = 0.0
        self._done = 0  #: steps of the running macro-step already committed
        #: Committed steps: end times (arrays, in order) and run-length batch sizes.
        self.log_ends: list[npt.NDArray[np.float64]] = []
        self.log_sizes: list[tuple[int, int]] = []
        self.n_steps = 0
        self.busy_s = 0.0
        #: Routing load: requests routed here and not finished.
        self.load = 0
        self.finished = 0
        self.index = -1  #: position among all D engines (set by the simulation)

    # ---- admission -------------------------------------------------------------------------------

    def route(self, req: SimRequest) -> None:
        """The router chose this engine: queue for admission."""
        self.load += 1
        self.queue.append(req)
        self.try_admit()

    def route_load(self) -> float:
        """Requests routed here and not finished (least-load routing)."""
        return float(self.load)

    def try_admit(self) -> None:
        """Admit queued requests in order while pages and slots allow."""
        self.sync()
        while self.queue:
            req = self.queue[0]
            growth = req.output_len - 1 if self.ctx.tuning.reserve_output else 0
            hit = self.kv.try_admit(
                req.rid, req.keys, req.input_len, remote=True, growth_tokens=growth
            )
            if hit is None:
                break
            self.queue.popleft()
            req.d_hit = hit
            req.t_d_admit = self.env.now
            self._on_admitted(req)
        self.kv.record(self.env.now)

    # ---- KV arrival and the batch ----------------------------------------------------------

    def kv_arrived(self, req: SimRequest) -> None:
        """The request's KV and first token landed: join the batch at the next step boundary."""
        now = self.env.now
        self.sync()
        req.t_first_token = now
        self.kv.kv_arrived(req.rid, req.input_len)
        if req.output_len == 1:
            self._finish(req, now)
            self.try_admit()
            return
        req.steps_left = req.output_len - 1
        req.ctx = req.input_len + 1
        self._joining.append(req)
        if not self.running:
            self._start()
        else:
            self._cut(now)

    def _start(self) -> None:
        for req in self._joining:
            req.join_step = self.n_steps
        self.running.extend(self._joining)
        self._joining = []
        self._version += 1
        if not self.running:
            return
        b = len(self.running)
        ctx_sum = sum(r.ctx for r in self.running)
        k = min(min(r.steps_left for r in self.running), self.ctx.horizon)
        times = self.ctx.cost.decode_times(b, ctx_sum, k)
        self._t0 = self.env.now
        self._ends = self._t0 + np.cumsum(times)
        self._done = 0
        self._arm(k)

    def _arm(self, n: int) -> None:
        version = self._version
        delay = float(self._ends[n - 1]) - self.env.now
        self.env.timeout(max(delay, 0.0)).callbacks.append(lambda _e: self._wake(version, n))

    def _cut(self, t: float) -> None:
        """End the running macro-step at the first step boundary at or after ``t``."""
        idx = int(np.searchsorted(self._ends, t, side="left"))
        if idx < len(self._ends) - 1:
            self._ends = self._ends[: idx + 1]
            self._version += 1
            self._arm(idx + 1)

    def sync(self) -> None:
        """Commit the steps of the running macro-step that have ended by now, so the scheduler
        (and its pool) is exactly where a step-by-step engine would be before anything else
        touches it (an admission, a KV arrival)."""
        if self.running:
            upto = int(np.searchsorted(self._ends, self.env.now, side="right"))
            self._commit(min(upto, len(self._ends)))

    def _commit(self, upto: int) -> None:
        """Record steps ``_done .. upto`` of the running macro-step for every running request."""
        n = upto - self._done
        if n <= 0:
            return
        self.log_ends.append(self._ends[self._done : upto])
        self.log_sizes.append((n, len(self.running)))
        self.n_steps += n
        self._done = upto
        self._record(n)
        for req in self.running:
            req.steps_left -= n
            req.ctx += n

    def _record(self, n: int) -> None:
        """Record n steps of every running request in the scheduler, allocating pages in the
        order a step-by-step engine would: by step, then by batch position."""
        kv, running, page = self.kv, self.running, self.kv.page_size
        lazy = kv.decoding  # rid -> [steps not recorded, free slots in held pages]
        needs: list[tuple[int, int]] = []
        for i, req in enumerate(running):
            lag, room = lazy[req.rid]
            first = room - lag + 1  # the step that needs the request's next page
            if first <= n:
                needs.extend((step, i) for step in range(first, n + 1, page))
        done = [0] * len(running)
        if needs:
            needs.sort()
            for step, i in needs:
                kv.advance(running[i].rid, step - done[i])
                done[i] = step
        for i, req in enumerate(running):
            lazy[req.rid][0] += n - done[i]  # no page boundary left: only the count moves

    def _wake(self, version: int, n: int) -> None:
        if version != self._version:
            return  # superseded by a cut
        self._commit(n)
        end = float(self._ends[n - 1])
        self.busy_s += end - self._t0
        still: list[SimRequest] = []
        for req in self.running:
            if req.steps_left == 0:
                self._finish(req, end)
            else:
                still.append(req)
        self.running = still
        self.try_admit()
        self._start()
        self.kv.record(self.env.now)

    def _finish(self, req: SimRequest, t: float) -> None:
        req.t_finish = t
        self.kv.finish(req.rid)
        self.load -= 1
        self.finished += 1
